"""A helper child's entry: `helper_main(["name", "{json kwargs}"])` runs HELPERS[name] and prints its
figures as the last line, after RESULT_MARK, where Run.helper (and document.cuda_device) reads them.
Each helper lives beside the section that asks for it; this module only names them, and only
children import it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from benchmarks.gpu_evidence.check_helpers import (
    helper_allocator_settings,
    helper_bitsandbytes_import,
    helper_cap_oom,
    helper_context_after_step,
    helper_context_with_other_process,
    helper_cublas_workspace,
    helper_device_assert,
    helper_handoff_compile,
)
from benchmarks.gpu_evidence.common import RESULT_MARK
from benchmarks.gpu_evidence.data_lengths import helper_lengths_data, helper_lengths_run
from benchmarks.gpu_evidence.document import helper_device_info
from benchmarks.gpu_evidence.estimates import helper_estimates
from benchmarks.gpu_evidence.fresh_probes import helper_fresh_probes, helper_truth_candidates
from benchmarks.gpu_evidence.probe_overhead import helper_probe_phases
from benchmarks.gpu_evidence.run_speed import helper_train_data, helper_trainer_handoff
from benchmarks.gpu_evidence.search import helper_study_probes
from benchmarks.gpu_evidence.versions import helper_versions


def helper_main(argv: Sequence[str]) -> None:
    """Entry of a helper child: HELPERS[argv[0]](**json(argv[1])), its figures as the last line."""
    name, kwargs = argv[0], json.loads(argv[1])
    figures = HELPERS[name](**kwargs)
    print(RESULT_MARK + json.dumps(figures, default=str), flush=True)


HELPERS: dict[str, Callable[..., dict]] = {
    "device_info": helper_device_info,
    "versions": helper_versions,
    "cap_oom": helper_cap_oom,
    "context_after_step": helper_context_after_step,
    "context_with_other_process": helper_context_with_other_process,
    "device_assert": helper_device_assert,
    "allocator_settings": helper_allocator_settings,
    "cublas_workspace": helper_cublas_workspace,
    "bitsandbytes_import": helper_bitsandbytes_import,
    "handoff_compile": helper_handoff_compile,
    "study_probes": helper_study_probes,
    "lengths_data": helper_lengths_data,
    "lengths_run": helper_lengths_run,
    "estimates": helper_estimates,
    "train_data": helper_train_data,
    "truth_candidates": helper_truth_candidates,
    "fresh_probes": helper_fresh_probes,
    "trainer_handoff": helper_trainer_handoff,
    "probe_phases": helper_probe_phases,
}
