"""`autotune probe`: bad input is one line and exit status 2 (read in this process); a probe through a
real subprocess, and one that does not fit (in this process, with the worker's warm probe child)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import assert_usage_error, autotune, invoke, with_flags


BASE = [
    "probe",
    "--model",
    "gpt2",
    "--micro-batch",
    "1",
    "--block-size",
    "128",
    "--gpu-budget",
    "8GiB",
    "--device",
    "cpu",
]


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"--gpu-budget": "8XB"}, "unknown unit"),
        ({"--gpu-budget": "-1GiB"}, "not a positive size"),
        ({"--block-size": "2048"}, "maximum of 1024"),
        ({"--model": "nobody/no-such-model"}, "cannot resolve"),
        ({"--micro-batch": "0"}, "--micro-batch"),
        ({"--precision": "fp8"}, "--precision"),
        ({"--device": "tpu"}, "--device"),
        ({"--safety-margin": "120%"}, "--safety-margin"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(change, needle):
    assert_usage_error(invoke(*with_flags(BASE, change)), needle)


@pytest.mark.slow
def test_probe_json_on_cpu(tiny_model, tmp_path):
    # Under a TMPDIR as long as a batch job's: too long a path for the fork server's socket, so the
    # child is spawned (autotune.probe.runner: `_spawn`).
    tmpdir = tmp_path / ("slurm-job-" + "x" * 100)
    tmpdir.mkdir()
    proc = autotune(
        "probe",
        "--model",
        tiny_model,
        "--micro-batch",
        "2",
        "--block-size",
        "64",
        "--gpu-budget",
        "1GiB",
        "--device",
        "cpu",
        "--measure-steps",
        "1",
        "--json",
        env={"TMPDIR": str(tmpdir)},
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["status"] == "ok"
    for key in ("tokens_per_s", "peak_allocated_bytes", "peak_reserved_bytes", "step_seconds", "wall_seconds"):
        assert data[key] > 0


@pytest.mark.slow
def test_probe_that_does_not_fit_exits_1(tiny_model, warm_child):
    proc = invoke(
        "probe",
        "--model",
        tiny_model,
        "--micro-batch",
        "2",
        "--block-size",
        "64",
        "--gpu-budget",
        "3MiB",
        "--device",
        "cpu",
    )
    assert proc.returncode == 1
    assert "status  oom" in proc.stdout
