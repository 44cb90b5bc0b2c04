"""Probes: short, real training runs of one configuration against a memory budget.

`settings` says how probes run (ProbeSettings, torch-free); `runner` is the parent side (no
torch); `child` is the process that trains, `step` the training step it times (and the estimator
traces), `protocol` what the two say over their pipe; `cap` holds a process to a memory budget
(probe and train alike); `memory` accounts and caps memory on CPU; `oom` classifies failures;
`devices` describes the hardware.
"""

from __future__ import annotations

from autotune.probe.oom import classify_exception, is_oom
from autotune.probe.runner import ProbeRunner, check_probe_config, run_probe
from autotune.probe.settings import ProbeSettings

__all__ = ["ProbeRunner", "ProbeSettings", "check_probe_config", "classify_exception", "is_oom", "run_probe"]
