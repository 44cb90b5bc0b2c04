"""The search with real probes of a tiny GPT-2 on CPU: the pick against an exhaustive grid, the
structure-based skips, Ctrl-C and resume through the real command line, and the hand-off."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest

from autotune.specs.models import resolve_model
from autotune.probe import ProbeSettings
from autotune.search import SearchOptions, run_search
from autotune.search.space import SearchSpace
from autotune.store import open_store
from tests.helpers.cli import autotune_command, invoke
from tests.helpers.fakes import ScriptedRunner, modelled_result, request
from tests.helpers.faults import GATE_ENV, fault_env

pytestmark = pytest.mark.slow
MiB = 2**20
# Against this budget the tiny model (n_embd 64, block 128, effective batch 16) fits up to
# micro-batch 4 without checkpointing and 8 with it: some configs run out of memory.
BUDGET = 24 * MiB
MARGIN = int(0.05 * BUDGET)


def tiny_space(model: str) -> SearchSpace:
    return SearchSpace.build(
        resolve_model(model),
        micro_batches=(1, 2, 4, 8, 16),
        block_sizes=(128,),
        precisions=("fp32",),
        checkpointing=(False, True),
        attentions=("sdpa",),
        effective_batch=16,
    )


def test_search_pick_equals_the_exhaustive_grid_best(tiny_model, probe_runner):
    spec = resolve_model(tiny_model)
    space = tiny_space(tiny_model)
    # Which configs fit is all the grid's probes are asked: their shortest timed window will do.
    with open_store() as store:
        runner = probe_runner(ProbeSettings(device="cpu", measure_steps=1, measure_seconds=0))
        grid = run_search(
            request(space, spec, BUDGET, MARGIN, SearchOptions(study="grid", strategy="grid-full")), runner, store
        )
        assert grid.probed == len(space.candidates()) == 10
        statuses = {p.config.label(): p.result.status for p in store.probes("grid")}
        assert "oom" in statuses.values() and "ok" in statuses.values(), statuses

        # Both searches answered from the grid's real probes: which configs fit is what the CPU
        # measured; their speed is the fakes' noise-free model, because two test workers sharing
        # two cores can make a checkpointed config time faster than the same one without, which
        # the search rightly never probes. So the comparison is of the (default) strategy alone.
        table = {p.config_key: _modelled_speed(p.config, p.result) for p in store.probes("grid")}
        everything, replay = ScriptedRunner(table), ScriptedRunner(table)
        everything.env = replay.env = runner.environment()
        exhaustive = run_search(
            request(
                space,
                spec,
                BUDGET,
                MARGIN,
                SearchOptions(study="grid-replay", strategy="grid-full", fresh=True, confirm=False),
            ),
            everything,
            store,
        )
        searched = run_search(
            request(space, spec, BUDGET, MARGIN, SearchOptions(study="searched", fresh=True, confirm=False)),
            replay,
            store,
        )
    assert exhaustive.best is not None and searched.best.config == exhaustive.best.config
    assert searched.probed < exhaustive.probed == grid.probed
    skipped = [p for p in study_probes(searched.study.name) if p.result.status == "skipped"]
    assert skipped and not {p.config_key for p in skipped} & {c.key() for c in replay.asked}


def _modelled_speed(config, result):
    """`result` (a real probe's) with the fakes' throughput model in place of its measured timing."""
    if result.status != "ok":
        return result
    modelled = modelled_result(config, 2**62, 0)
    return dataclasses.replace(
        result,
        tokens_per_s=modelled.tokens_per_s,
        step_seconds=modelled.step_seconds,
        samples_per_s=modelled.samples_per_s,
        step_times=None,
        step_spread=None,
    )


def study_probes(study: str):
    with open_store() as store:
        return store.probes(study)


def _search_cmd(model: str, *extra: str) -> list[str]:
    return autotune_command(
        "search",
        "--model",
        model,
        "--gpu-budget",
        "24MiB",
        "--device",
        "cpu",
        "--micro-batches",
        "1,2,4,8,16",
        "--block-sizes",
        "128",
        "--effective-batch",
        "16",
        "--precisions",
        "fp32",
        "--attention",
        "sdpa",
        "--measure-steps",
        "2",
        "--no-confirm",
        "--no-predict",
        "--study",
        "ctrl-c",
        *extra,
    )


def test_ctrl_c_stops_after_the_probe_and_the_same_command_resumes(tiny_model, tmp_path, warm_child):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # The second probe waits at its first step for the gate (tests/helpers/faults): the Ctrl-C comes
    # while it is in flight, whatever the machine's speed, and the search finishes that probe.
    gate = tmp_path / "gate"
    held = {**fault_env("gate", env, on_probe=2), GATE_ENV: str(gate)}
    proc = subprocess.Popen(
        _search_cmd(tiny_model), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=held
    )
    for line in proc.stdout:  # wait until the first probe has been stored
        if line.startswith("["):
            break
    proc.send_signal(signal.SIGINT)
    gate.touch()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "run the same command to resume" in out
    with open_store() as store:
        first = store.probes("ctrl-c")
        assert store.study("ctrl-c").status == "interrupted"
    assert 1 <= len(first) < 10

    # (The same command again, in this process with the worker's warm probe child: the Ctrl-C is the subject.)
    done = invoke(*_search_cmd(tiny_model, "--json")[3:])
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["status"] == "finished" and summary["best"] is not None
    with open_store() as store:
        probes = store.probes("ctrl-c")
    keys = [p.config_key for p in probes]
    assert len(keys) == len(set(keys))  # nothing settled twice
    assert {p.config_key for p in first} <= set(keys)
    assert summary["probed"] + summary["skipped"] + summary["reused"] == len(probes) - len(first)

    # Once more: a finished study answers from the database, without starting a probe process
    # (no torch, no transformers in this process or any child).
    code = (
        "import sys\nfrom autotune.cli import main\nsys.argv = ['autotune', *sys.argv[1:]]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}), file=sys.stderr)"
    )
    again = subprocess.run(
        [sys.executable, "-c", code, *_search_cmd(tiny_model, "--json")[3:]],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert json.loads(again.stdout)["answered_from_database"] is True, again.stderr
    assert again.stderr.strip().splitlines()[-1] == "[]"
