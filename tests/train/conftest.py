"""Fixtures for training runs: a tiny GPT-2 with real (random) weights and a tokenizer trained here,
a real English corpus from the standard library (`pydoc_data.topics`, no download), and a study
chosen by a real search on CPU. Built once per test process (the search alone takes seconds); each
module gets its own copy of the database."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from tests.helpers.corpus import corpus_text, write_pretrained_gpt2
from tests.helpers.training import STUDY, STUDY_BUDGET, Workspace


@pytest.fixture(scope="session")
def searched_workspace(tmp_path_factory, probe_runner) -> Workspace:
    """The model, the corpus and a database with the study, made once for the test process."""
    from autotune.probe import ProbeSettings
    from autotune.search import SearchOptions, search

    root = tmp_path_factory.mktemp("train")
    text = corpus_text()
    corpus = root / "corpus.txt"
    corpus.write_text(text)
    small_eval = root / "eval.txt"
    small_eval.write_text(text[:1500])
    model = write_pretrained_gpt2(text, root / "tiny-gpt2")
    db = f"sqlite:///{root / 'studies.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        # A real search, kept small: two micro-batches of one block size, one probe step each, in
        # the worker's warm probe child; no memory prediction (no assertion here reads one).
        runner = probe_runner(ProbeSettings(device="cpu", measure_steps=1))
        outcome = search(
            str(model),
            STUDY_BUDGET,
            settings=runner.settings,
            runner=runner,
            options=SearchOptions(study=STUDY, predict=False),
            db=db,
            micro_batches=(1, 2),
            block_sizes=(64,),
            precisions=("fp32",),
            checkpointing=(False,),
            attentions=("sdpa",),
            effective_batch=2,
        )
    assert outcome.best is not None and outcome.study.status == "finished"
    return Workspace(root=root, model=model, corpus=corpus, small_eval=small_eval, db=db, study=STUDY)


@pytest.fixture(scope="module")
def workspace(searched_workspace, tmp_path_factory) -> Workspace:
    """The session's workspace with its own copy of the database: a module's runs are its own. (The
    model, its tokenizer and the corpus are only read.)"""
    root = tmp_path_factory.mktemp("train-db")
    db = root / "studies.db"
    shutil.copyfile(searched_workspace.db.removeprefix("sqlite:///"), db)
    return dataclasses.replace(searched_workspace, db=f"sqlite:///{db}")
