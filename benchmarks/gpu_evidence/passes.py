"""The sections in order of value, each with the seconds it needs left to start, what it is expected
to take on a card, the passes (GPU commands of at most 9 minutes) it belongs to, and the sections that
must be measured before it. The one place that names every section; each one's code is in its own
module, and schedule runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.gpu_evidence.benchmark import section_benchmark
from benchmarks.gpu_evidence.checks import section_cuda_constants, section_cuda_facts, section_micro_checks
from benchmarks.gpu_evidence.data_lengths import section_data_lengths
from benchmarks.gpu_evidence.estimates import section_estimator_vs_probe
from benchmarks.gpu_evidence.eval_generation import section_eval_generation
from benchmarks.gpu_evidence.forum import section_forum_config
from benchmarks.gpu_evidence.invocation import Run
from benchmarks.gpu_evidence.liger import section_liger_allocator_search
from benchmarks.gpu_evidence.probe_overhead import section_probe_overhead
from benchmarks.gpu_evidence.pytest_gpu import section_pytest_gpu
from benchmarks.gpu_evidence.run_speed import section_train_200_steps, section_trainer_handoff
from benchmarks.gpu_evidence.search import section_readme_command
from benchmarks.gpu_evidence.spread import section_spread
from benchmarks.gpu_evidence.truth import section_truth
from benchmarks.gpu_evidence.versions import section_versions


@dataclass(frozen=True)
class Section:
    name: str
    function: Callable[[Run], dict]
    cuda_seconds: float  # at least this long left, or it is not started (CUDA mode)
    cpu_seconds: float  # the same in CPU mode
    expected_seconds: float  # what it is expected to take on a card (a guess until measured)
    passes: tuple[str, ...]  # the GPU commands (PASSES) it is part of
    cuda_only: bool = False
    needs: tuple[str, ...] = ()  # sections that must be measured first

    def min_seconds(self, mode: str) -> float:
        return self.cuda_seconds if mode == "cuda" else self.cpu_seconds


# Each pass is one GPU command of at most 9 minutes, its sections in order of value. Pass 1 (measured
# on an H100, 2026-11-26): the README's command and what it makes checkable, pytest -m gpu with what
# is left. Pass 2 (issue 55; run on an H200, 2026-11-29): is the pick the fastest on the card (the
# noise-proof truth against the README's search from an empty database), where a probe's seconds go,
# does the run go as fast as its probe (autotune train and a plain Trainer), the spread between
# processes. Pass 3: the rest (evaluation and generation, micro-checks, the benchmark's grid, Liger and
# the allocator).
SECTIONS: tuple[Section, ...] = (
    # expected_seconds: measured on an H100 on 2026-11-26 and an H200 on 2026-11-29 (benchmarks/results/),
    # rounded up; pytest_gpu's and the truth's what their pass leaves them (both resume).
    Section("versions", section_versions, 30, 10, expected_seconds=15, passes=("1",)),
    # 88 s on the H100 (6 probes), 227 s on the H200 (11 probes, and a confirmation round of 13 windows
    # in 103 s).
    Section("readme_command", section_readme_command, 120, 30, expected_seconds=230, passes=("1", "2")),
    Section(
        "probe_overhead", section_probe_overhead, 45, 15, expected_seconds=30, passes=("2",), needs=("readme_command",)
    ),
    # Whatever the pass leaves it: on the H200 (2026-11-29) a probe in a fresh process took 8-16 s, so
    # its 45 configs want two commands of their own; it stops to leave TRUTH_RESERVE_SECONDS to the
    # sections after it, and gives the contenders it measured their second process first.
    Section("truth", section_truth, 150, 20, expected_seconds=100, passes=("2",), needs=("readme_command",)),
    Section("forum_config", section_forum_config, 60, 15, expected_seconds=30, passes=("1",)),
    Section(
        "estimator_vs_probe",
        section_estimator_vs_probe,
        45,
        15,
        expected_seconds=25,
        passes=("1",),
        needs=("readme_command",),
    ),
    Section("cuda_facts", section_cuda_facts, 60, 0, expected_seconds=35, passes=("1",), cuda_only=True),
    Section(
        "cuda_constants",
        section_cuda_constants,
        5,
        0,
        expected_seconds=1,
        passes=("1",),
        cuda_only=True,
        needs=("cuda_facts",),
    ),
    Section(
        "train_200_steps",
        section_train_200_steps,
        90,
        20,
        expected_seconds=45,
        passes=("1", "2"),
        needs=("readme_command",),
    ),
    Section(
        "trainer_handoff",
        section_trainer_handoff,
        60,
        20,
        expected_seconds=55,
        passes=("2",),
        needs=("readme_command",),
    ),
    # Five fresh processes of the pick: 73 s on the H200.
    Section("spread", section_spread, 30, 10, expected_seconds=60, passes=("2",), needs=("readme_command",)),
    # What is left of pass 1's 9 minutes; its tests resume in a later command.
    Section("pytest_gpu", section_pytest_gpu, 60, 10, expected_seconds=130, passes=("1",)),
    # gpt2's evaluating search took 76 s on the H200, the Pegasus-shaped generating one over 52.
    # Guessed (not yet run on a card): a search of 8 configs, two 60-step TRL runs, a plan.
    Section("data_lengths", section_data_lengths, 120, 30, expected_seconds=240, passes=("3",)),
    Section("eval_generation", section_eval_generation, 90, 30, expected_seconds=150, passes=("3",)),
    Section("micro_checks", section_micro_checks, 60, 0, expected_seconds=350, passes=("3",), cuda_only=True),
    Section("benchmark", section_benchmark, 120, 30, expected_seconds=600, passes=("3",)),
    Section(
        "liger_allocator_search",
        section_liger_allocator_search,
        240,
        0,
        expected_seconds=270,
        passes=("3",),
        cuda_only=True,
    ),
)
SECTION_NAMES = tuple(s.name for s in SECTIONS)
PASSES = {p: tuple(s.name for s in SECTIONS if p in s.passes) for p in ("1", "2", "3")}
# One GPU command runs at most 10 minutes; a pass plans for 9 (the preamble and the last save in the tenth).
PASS_SECONDS = 540
