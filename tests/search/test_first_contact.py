"""First contact, as a new user meets it: the headline command on a machine without CUDA, the
effective batch (the user's recipe) in the header and the hint beside the pick, --workers bounded
before anything starts, a local folder that shadows a known model's name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autotune.specs.models import resolve_model
from autotune.probe.runner import cuda_may_be_visible
from autotune.render.tables import explain_winner, format_search_header
from autotune.search import SearchOptions, run_search
from autotune.search.space import SearchSpace
from autotune.store import open_store
from tests.helpers.models import write_model_dir
from tests.helpers.fakes import ScriptedRunner, request
from tests.helpers.cli import invoke

GiB = 2**30


@pytest.mark.skipif(cuda_may_be_visible(), reason="this machine may have CUDA: the refusal is for one without")
def test_without_cuda_a_search_of_device_auto_is_one_line_naming_device_cpu_and_plan(tmp_path, hermetic_home):
    db = tmp_path / "a.db"
    done = invoke("search", "--model", "gpt2", "--gpu-budget", "8GiB", "--db", str(db))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "no CUDA device here" in lines[0] and "--device cpu" in lines[0]
    assert "autotune plan --model gpt2 --gpu NAME" in lines[0]
    assert "a probe" in lines[0] and "for its 48 candidates" in lines[0]  # what the CPU would take, predicted
    assert not db.exists() and not list(hermetic_home.iterdir())  # no database, no cache: nothing written


def test_workers_beyond_the_cores_are_refused_before_anything_starts(tmp_path, tiny_model):
    db = tmp_path / "w.db"
    done = invoke(
        "search",
        "--model",
        tiny_model,
        "--gpu-budget",
        "64MiB",
        "--device",
        "cpu",
        "--workers",
        "1000",
        "--db",
        str(db),
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and f"this machine has {os.cpu_count()} core" in lines[0], (
        done.stderr
    )
    assert not db.exists()


def test_the_effective_batch_is_trainers_by_default_said_as_the_users_recipe_with_a_hint_beside_the_pick():
    space = SearchSpace.build(resolve_model("gpt2"), block_sizes=(512,), precisions=("bf16",), attentions=("sdpa",))
    assert space.effective_batch == 8 and max(c.micro_batch for c in space.candidates()) == 8
    headers: list[str] = []
    with open_store() as store:
        outcome = run_search(
            request(space, resolve_model("gpt2"), 16 * GiB, GiB, SearchOptions(study="roomy", predict=False)),
            ScriptedRunner(),
            store,
            on_start=lambda *a: headers.append(format_search_header(*a)),
        )
    assert "8 sequences per optimizer step (your recipe: --effective-batch; Trainer's default is 8)" in headers[0]
    said = explain_winner(outcome)
    assert outcome.best.config.micro_batch == 8 and outcome.best.config.grad_accum == 1  # the pick keeps the recipe
    assert "hint: " in said and "a larger --effective-batch" in said


def test_a_local_folder_named_like_a_known_model_is_said_with_the_config_it_read(tmp_path, monkeypatch):
    from autotune.search.request import shadowing_note

    monkeypatch.chdir(tmp_path)
    write_model_dir(Path("gpt2"))
    note = shadowing_note(resolve_model("gpt2"))
    assert note is not None and f"read {tmp_path / 'gpt2'}/config.json" in note and "openai-community/gpt2" in note
    assert shadowing_note(resolve_model("openai-community/gpt2")) is None


def test_best_says_why_a_study_has_no_winner_and_what_to_do(tmp_path):
    from autotune.vocabulary.errors import StudyNotFound
    from autotune.handoff import best
    from autotune.vocabulary.status import StudyStatus

    db = f"sqlite:///{tmp_path / 'b.db'}"
    space = SearchSpace.build(resolve_model("gpt2"), block_sizes=(512,), precisions=("bf16",), attentions=("sdpa",))
    with open_store(db) as store:
        # Searched through, and nothing fits a budget below the weights.
        run_search(
            request(space, resolve_model("gpt2"), 520 * 2**20, 26 * 2**20, SearchOptions(study="tiny", predict=False)),
            ScriptedRunner(),
            store,
        )
    with pytest.raises(
        StudyNotFound,
        match="searched every candidate and none fits its 520.00 MiB budget; search again with a larger --gpu-budget",
    ):
        best("tiny", db)
    with open_store(db) as store:  # a study stopped before its first probe (killed in its first minute)
        store.get_or_create_study(
            "empty",
            model=resolve_model("gpt2"),
            environment=ScriptedRunner().env,
            budget_bytes=8 * GiB,
            margin_bytes=GiB,
            effective_batch=8,
            space=space.to_dict(),
        )
        store.set_study_status("empty", StudyStatus.INTERRUPTED)
    with pytest.raises(
        StudyNotFound,
        match="study 'empty' is interrupted and it has no probe yet; run the same `autotune search` command to go on",
    ):
        best("empty", db)
