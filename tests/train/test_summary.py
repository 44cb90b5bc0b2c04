"""RunSummary: the JSON form that autotune-run.json, `train --json` and the store hold, the figures
derived from the measured ones, the memory warnings, and the closing lines `autotune train` prints.
No training here: summaries are built by hand."""

from __future__ import annotations

import json
from dataclasses import replace

from autotune.levers.config import ProbeConfig
from autotune.render.tables import render_run_summary
from autotune.train import SUMMARY_FILE, ProbeMeasurement, RunSummary

MiB = 2**20

# The contract: these keys, in this order ("message" only for a run that ran out of memory).
KEYS = [
    "status",
    "run_id",
    "study",
    "probe_id",
    "model",
    "weights",
    "dataset",
    "output_dir",
    "device",
    "device_type",
    "config",
    "training_arguments",
    "block_size",
    "tokens_per_step",
    "train_blocks",
    "eval_blocks",
    "resumed_from",
    "steps",
    "steps_this_run",
    "max_steps",
    "tokens_per_s",
    "wall_tokens_per_s",
    "train_seconds",
    "seconds",
    "budget_bytes",
    "margin_bytes",
    "cap_bytes",
    "context_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "required_bytes",
    "probe",
    "peak_vs_probe",
    "final_loss",
    "eval_loss",
    "perplexity",
    "warnings",
    "error",
]


def finished_run(**changes) -> RunSummary:
    config = ProbeConfig(model="gpt2", micro_batch=4, block_size=128, grad_accum=2)
    summary = RunSummary(
        status="finished",
        run_id=7,
        study="gpt2-1GiB",
        probe_id=3,
        model="gpt2",
        weights="random-init",
        dataset="corpus.txt",
        output_dir="/runs/gpt2-1GiB",
        device="NVIDIA H100 80GB HBM3",
        device_type="cuda",
        config=config,
        training_arguments={"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
        train_blocks=900,
        eval_blocks=None,
        resumed_from=None,
        steps=20,
        steps_this_run=20,
        max_steps=20,
        tokens_per_s=50_000.0,
        wall_tokens_per_s=40_000.0,
        train_seconds=2.5,
        seconds=4.0,
        budget_bytes=1024 * MiB,
        margin_bytes=51 * MiB,
        cap_bytes=473 * MiB,
        context_bytes=500 * MiB,
        peak_allocated_bytes=400 * MiB,
        peak_reserved_bytes=420 * MiB,
        probe=ProbeMeasurement(
            peak_allocated_bytes=395 * MiB,
            peak_reserved_bytes=400 * MiB,
            context_bytes=500 * MiB,
            tokens_per_s=52_000.0,
        ),
        final_loss=3.25,
        eval_loss=3.5,
    )
    return replace(summary, **changes)


def test_to_dict_keeps_the_keys_and_derives_the_figures():
    data = finished_run().to_dict()
    assert list(data) == KEYS
    assert data["config"]["label"] == "mb4x2 blk128 fp32 no-ckpt sdpa" and data["config"]["micro_batch"] == 4
    assert (data["block_size"], data["tokens_per_step"]) == (128, 4 * 2 * 128)
    assert data["required_bytes"] == 920 * MiB  # peak reserved + context
    assert data["peak_vs_probe"] == 420 / 400
    assert abs(data["perplexity"] - 33.115) < 1e-3
    assert list(data["probe"]) == ["peak_allocated_bytes", "peak_reserved_bytes", "context_bytes", "tokens_per_s"]
    assert data["warnings"] == [] and data["error"] is None
    assert json.loads(json.dumps(data)) == data  # JSON-ready as it is: the store writes it without help


def test_missing_measurements_leave_the_derived_figures_empty():
    data = finished_run(
        peak_reserved_bytes=None, eval_loss=60.0, probe=ProbeMeasurement(None, None, None, None)
    ).to_dict()
    assert data["required_bytes"] is None and data["peak_vs_probe"] is None and data["perplexity"] is None


def test_message_only_for_a_run_that_stopped(tmp_path):
    stopped = finished_run(status="oom", message="out of memory at step 3", error="CUDA out of memory")
    assert list(stopped.to_dict()) == [*KEYS, "message"]
    assert "message" not in finished_run().to_dict()
    path = stopped.write(tmp_path)
    assert path == tmp_path / SUMMARY_FILE and json.loads(path.read_text()) == stopped.to_dict()


def test_memory_warnings():
    assert finished_run(peak_reserved_bytes=420 * MiB).with_memory_warnings().warnings == ()  # 5% over: tolerated
    over_probe = finished_run(peak_reserved_bytes=440 * MiB).with_memory_warnings()
    assert len(over_probe.warnings) == 1 and "10% above the probe's 400.00 MiB" in over_probe.warnings[0]
    # 40 MiB over the probe with 1.5 GiB to spare after it: no news.
    roomy = finished_run(peak_reserved_bytes=440 * MiB, budget_bytes=2560 * MiB).with_memory_warnings()
    assert roomy.warnings == ()
    # 420 + 560 context + 51 margin > 1024: the context grew past what the budget allows.
    grown = finished_run(context_bytes=560 * MiB, warnings=("earlier",)).with_memory_warnings()
    assert grown.warnings[0] == "earlier" and "the CUDA context grew" in grown.warnings[1]
    assert finished_run(status="oom", context_bytes=560 * MiB).with_memory_warnings().warnings == ()


def test_a_run_slower_than_its_probe_says_so_without_claiming_a_cause():
    assert finished_run().with_warnings().warnings == ()  # 50,000 against 52,000: within the tolerance
    (slow,) = finished_run(tokens_per_s=30_000.0).with_warnings().warnings
    assert "1.7x below its probe's 52,000" in slow and "may explain it" in slow and "real data" in slow
    assert finished_run(tokens_per_s=30_000.0, status="oom").with_warnings().warnings == ()


def test_render_a_finished_run():
    text = render_run_summary(finished_run(warnings=("study gpt2-1GiB is running",)))
    assert text.splitlines() == [
        "run #7 finished: 20 steps (20 this run) in 2.5 s, 50,000 tokens/s; mb4x2 blk128 fp32 no-ckpt sdpa on "
        "NVIDIA H100 80GB HBM3",
        "memory: peak allocated 400.00 MiB, reserved 420.00 MiB + context 500.00 MiB of the 1.00 GiB budget "
        "(margin 51.00 MiB): fits, 53.00 MiB to spare",
        "probe #3: peak reserved 400.00 MiB, 52,000 tokens/s; run/probe peak 1.05",
        "loss: 3.2500, eval loss 3.5000 (perplexity 33.1)",
        f"saved: /runs/gpt2-1GiB (model, tokenizer, {SUMMARY_FILE})",
        "warning: study gpt2-1GiB is running",
    ]


def test_render_a_run_that_ran_out_of_memory():
    text = render_run_summary(
        finished_run(
            status="oom",
            device_type="cpu",
            device="cpu",
            steps=2,
            steps_this_run=2,
            train_seconds=None,
            tokens_per_s=None,
            final_loss=None,
        )
    )
    assert text.splitlines() == [
        "run #7 oom: 2 steps (2 this run); mb4x2 blk128 fp32 no-ckpt sdpa on cpu",
        "memory: peak allocated 400.00 MiB, reserved 420.00 MiB before it stopped of the 1.00 GiB budget "
        "(margin 51.00 MiB)",
        "probe #3: peak reserved 400.00 MiB, 52,000 tokens/s",
    ]
