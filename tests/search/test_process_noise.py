"""The noise between processes: the confirmation round measures each window in a process of its
own, so that a process that runs a config slow (as a card runs some processes slower than others:
one config measured 82,507 and 63,373 tokens/s in two processes on an H100) is outvoted, and a
noise the timing cannot see through is said. Real searches, real probe processes; the steps are
paced by sleeping (tests/helpers/faults: `paced`), so that which config is fastest is known on a
busy machine too: mb4x1 1.4x mb2x2, which is 1.57x mb1x4."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import invoke
from tests.helpers.faults import GATE_ENV, fault_env

pytestmark = pytest.mark.slow

SPACE = [
    "--device",
    "cpu",
    "--gpu-budget",
    "1GiB",
    "--micro-batches",
    "1,2,4",
    "--effective-batch",
    "4",
    "--block-sizes",
    "32",
    "--precisions",
    "fp32",
    "--checkpointing",
    "off",
    "--attention",
    "sdpa",
    "--strategy",
    "grid",
    "--no-predict",
    "--warmup-steps",
    "2",
    "--measure-steps",
    "3",
    "--measure-seconds",
    "0.2",
    "--json",
]
# A paced step of mb4x1 (tests/helpers/faults/sitecustomize.py): its tokens/s in a process that is not slowed.
MB4X1_TOKENS_PER_S = 4 * 32 / 0.10


def search(tiny_model, tmp_path, slow: str) -> dict:
    processes = tmp_path / "processes"
    processes.mkdir()
    env = {**fault_env("paced"), GATE_ENV: str(processes), "AUTOTUNE_INJECT_FAULT_SLOW": slow}
    done = invoke("search", "--model", tiny_model, *SPACE, "--db", f"sqlite:///{tmp_path / 'noise.db'}", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    # Every window of the round had a process of its own: the search's first child measured the
    # three configs, each window after it one more process.
    assert len(list(processes.iterdir())) == 1 + summary["confirmation"]["probes"], summary["confirmation"]
    return summary


def test_a_process_that_runs_the_fastest_config_slow_is_outvoted_by_the_rounds_processes(tiny_model, tmp_path):
    # The search's own probe process runs mb4x1 at 0.6x: there it measures below mb2x2. Measured
    # again in that process, it stayed below and mb2x2 was "confirmed"; in processes of their own,
    # its windows say what it is.
    summary = search(tiny_model, tmp_path, "1:4:0.6")
    decision = summary["confirmation"]
    assert summary["best"]["label"].startswith("mb4x1"), decision
    assert decision["confirmed"] and decision["reliable"], decision
    # Its figure is what the processes that were not slowed measured (the median of its windows).
    assert summary["best"]["tokens_per_s"] == pytest.approx(MB4X1_TOKENS_PER_S, rel=0.1)


def test_processes_that_disagree_by_2x_make_the_pick_not_reliable(tiny_model, tmp_path):
    # Every other probe process runs every config at half speed: windows of one config disagree
    # by 2x, more than the 40% between the two fastest, and the round says it cannot tell.
    summary = search(tiny_model, tmp_path, "even:*:0.5")
    decision = summary["confirmation"]
    assert not decision["confirmed"] and decision["reliable"] is False, decision
    assert decision["noise"] > 0.4, decision
