"""Speed levers on CPU, through the real child: a compiled probe (inductor compiles on CPU too), the
levers this machine lacks skipped with their reasons, and a search over --compile off,on handed off.

Every compiled probe here has the same model and shapes, so after the first compile inductor's
cache answers the others (seconds, not the first's tens of seconds)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from autotune.levers.config import ProbeConfig
from autotune.specs.models import resolve_model
from autotune.probe import ProbeSettings
from autotune.search import SearchOptions, run_search
from autotune.search.space import SearchSpace
from autotune.store import open_store
from tests.helpers.cli import invoke
from tests.helpers.fakes import request

pytestmark = pytest.mark.slow
MiB = 2**20
GiB = 2**30


@pytest.fixture(scope="module")
def runner(probe_runner):
    return probe_runner(ProbeSettings(device="cpu", measure_steps=2, measure_seconds=0.0))


def config(model: str, **levers) -> ProbeConfig:
    return ProbeConfig(model=model, micro_batch=2, block_size=32, **levers)


def test_a_compiled_probe_times_compiled_steps_and_reports_the_compile_apart(runner, tiny_model):
    eager = runner.run(config(tiny_model), runner.settings.budget(1 * GiB))
    compiled = runner.run(config(tiny_model, compile=True), runner.settings.budget(1 * GiB))
    assert eager.status == compiled.status == "ok", compiled.error
    assert eager.compile_seconds is None
    # The first compiled step compiles (seconds even from inductor's cache): reported, not timed.
    # The window holds the timed steps alone.
    assert compiled.compile_seconds > 2 * compiled.step_seconds
    assert sum(compiled.step_times) == pytest.approx(compiled.measured_seconds, rel=0.2)
    assert compiled.wall_seconds > compiled.compile_seconds + compiled.measured_seconds
    # On CPU the accountant counts the eager warm-up steps (probe/speedups.py): the same tensors.
    assert compiled.peak_allocated_bytes == eager.peak_allocated_bytes
    assert compiled.first_loss == pytest.approx(eager.first_loss, rel=1e-5)  # same seed, same math


@pytest.mark.parametrize(
    "levers, reason",
    [
        ({"precision": "tf32"}, "there is no TF32 on CPU"),
        ({"allocator": "expandable"}, "CPU memory has no such allocator"),
        ({"liger": True}, "none run on CPU"),
    ],
)
def test_levers_this_machine_lacks_are_skipped_with_the_reason(runner, tiny_model, levers, reason):
    result = runner.run(config(tiny_model, **levers), runner.settings.budget(1 * GiB))
    assert result.status == "skipped" and reason in result.error
    assert result.tokens_per_s is None


def test_a_search_over_compile_off_and_on_settles_both_and_hands_off_the_lever(runner, tiny_model, tmp_path):
    spec = resolve_model(tiny_model)
    db = f"sqlite:///{tmp_path / 'compile.db'}"
    # The module's runner: its child has imported torch and transformers already.
    with open_store(db) as store:
        space = SearchSpace.build(
            spec,
            micro_batches=(2,),
            block_sizes=(32,),
            precisions=("fp32",),
            checkpointing=(False,),
            attentions=("sdpa",),
            effective_batch=2,
            compiles=(False, True),
        )
        outcome = run_search(
            request(space, spec, 1 * GiB, 50 * MiB, SearchOptions(study="compile", confirm=False)), runner, store
        )
    assert outcome.finished and not outcome.unmeasured
    rows = {row.config.compile: row for row in outcome.leaderboard}
    assert set(rows) == {False, True}
    assert rows[True].compile_seconds > 0 and rows[False].compile_seconds is None
    assert rows[True].label.endswith(" compiled")

    proc = invoke("best", "--study", "compile", "--db", db, "--format", "trainer-args")  # (in this process)
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    winner_compiled = outcome.best.config.compile
    assert document["training_arguments"].get("torch_compile", False) is winner_compiled

    from transformers import TrainingArguments

    from autotune.handoff import BestConfig

    compiled = BestConfig(rows[True], "cpu")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), **compiled.trainer_kwargs())
    assert args.torch_compile and args.use_cpu
    assert "--torch_compile" in compiled.cli_flags().split()


def test_a_compile_past_max_compile_seconds_is_stopped_there_by_the_wall_clock(runner, tiny_model):
    # (Last in the module: it kills the worker's warm child, whose compiled model the tests above share.)
    phases: list[tuple[str, float]] = []
    runner.on_phase = lambda name: phases.append((name, time.perf_counter()))
    runner.settings = dataclasses.replace(runner.settings, max_compile_seconds=0.01)
    try:
        bounded = runner.run(config(tiny_model, compile=True), runner.settings.budget(1 * GiB))
        ended = time.perf_counter()
    finally:
        runner.settings = dataclasses.replace(runner.settings, max_compile_seconds=None)
        runner.on_phase = None
    assert bounded.status == "skipped" and "within --max-compile-seconds 0.01" in bounded.error, bounded.error
    assert "stopped there" in bounded.error and bounded.compile_seconds is None
    # Stopped at the bound (its child killed), not after compiling (seconds, even from inductor's cache).
    began = dict(phases)["compile"]
    assert ended - began < 1.5, phases
