"""Fixtures for training runs: a tiny GPT-2 with real (random) weights and a tokenizer trained here,
a real English corpus from the standard library (`pydoc_data.topics`, no download), and a study
chosen by a real search on CPU. Built once per test process (the search alone takes seconds); each
module gets its own copy of the database."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import TINY_GPT2

SPECIAL = "<|endoftext|>"
STUDY = "tiny-cpu"
STUDY_BUDGET = 64 * 2**20


@dataclass(frozen=True)
class Workspace:
    root: Path
    model: Path          # config.json, model.safetensors and tokenizer files
    corpus: Path         # ~460 KB of English prose
    small_eval: Path     # a few KB of it, for evaluation
    db: str              # SQLAlchemy URL holding the study
    study: str


def corpus_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def write_tokenizer(text: str, directory: Path, vocab_size: int = 500) -> None:
    """A byte-level BPE tokenizer trained on `text` in about a second, saved as transformers loads it."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, special_tokens=[SPECIAL], show_progress=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=SPECIAL, eos_token=SPECIAL, unk_token=SPECIAL)
    fast.save_pretrained(directory)


# The special tokens of the task tests' tokenizer, ids 0-5: T5's pad 0 and end 1, BERT's pad 0.
TASK_SPECIALS = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>", "cls_token": "[CLS]",
                 "sep_token": "[SEP]", "mask_token": "[MASK]"}


def write_task_tokenizer(text: str, directory: Path, vocab_size: int = 500, *, mask: bool = True) -> None:
    """A word-level tokenizer trained on `text` in a fraction of a second, with the special tokens
    of seq2seq, classification and (with `mask`) masked-LM models, saved as transformers loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = {name: token for name, token in TASK_SPECIALS.items() if mask or name != "mask_token"}
    words = Tokenizer(models.WordLevel(unk_token=TASK_SPECIALS["unk_token"]))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator([text], trainers.WordLevelTrainer(vocab_size=vocab_size, show_progress=False,
                                                                special_tokens=list(specials.values())))
    PreTrainedTokenizerFast(tokenizer_object=words, **specials).save_pretrained(directory)


def write_weights(directory: Path, config: dict) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    model.save_pretrained(directory)


def write_pretrained_gpt2(text: str, directory: Path) -> Path:
    """A tiny GPT-2 as a user's directory holds one: config.json, a tokenizer trained on `text`, weights."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(TINY_GPT2))
    write_tokenizer(text, directory)
    write_weights(directory, TINY_GPT2)
    return directory


def datasets_cache(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep `datasets`' Arrow cache out of the user's home (it reads the variable at import)."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(path))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", path)


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    datasets_cache(tmp_path / "hf-datasets", monkeypatch)


@pytest.fixture(scope="session")
def searched_workspace(tmp_path_factory) -> Workspace:
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
        # A real search, kept small: two micro-batches of one block size, one probe step each.
        outcome = search(str(model), STUDY_BUDGET, settings=ProbeSettings(device="cpu", measure_steps=1),
                         options=SearchOptions(study=STUDY), db=db, micro_batches=(1, 2), block_sizes=(64,),
                         precisions=("fp32",), checkpointing=(False,), attentions=("sdpa",), effective_batch=2)
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
