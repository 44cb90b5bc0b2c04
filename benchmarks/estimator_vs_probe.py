"""Estimator vs probe: predicted peak memory against what real probes measure, per configuration.

Predicts each configuration with `estimate_memories` (device type from --device) and probes it
for real with the probe runner, then prints the prediction error of the peak allocated, the peak
reserved and the total the card needs (reserved + context). Meant for a GPU machine, where it
checks the CUDA emulation, the allocator model and the assumed constants (CUDA context, cuBLAS
workspaces); on CPU it checks the trace against the CPU accountant.

    python -m benchmarks.estimator_vs_probe --device cuda            # gpt2, mb 1,4,8, blk 512, fp32/bf16, ckpt off/on
    python -m benchmarks.estimator_vs_probe --device cpu --model DIR --micro-batches 1,2 --block-size 128
    ... --json results.json                                          # also write every figure

Recipe levers (issue 15's GPU check: 8-bit AdamW and QLoRA on a ~1B model, TinyLlama-1.1B's shape):

    python -m benchmarks.estimator_vs_probe --device cuda --model tinyllama-1.1b --block-size 1024 \
        --micro-batches 1,4 --precisions bf16 --checkpointing on --optimizers adamw,adamw_8bit --peft none,lora,qlora

The budget is the whole device (uncapped probes, margin 0), so that the allocator's reserved
memory is not shrunk by a cap the estimate does not model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from autotune.levers.config import ProbeConfig
from autotune.levers.recipes import OPTIMIZERS, peft_text
from autotune.estimate import estimate_memories
from autotune.probe import ProbeRunner, ProbeSettings
from autotune.vocabulary.units import format_size, parse_choice_list, parse_int_list

MiB = 2**20
# TinyLlama-1.1B's config.json (public architecture numbers): a ~1B Llama for the recipe levers' GPU check.
TINYLLAMA_1_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}


def _model(name: str) -> str:
    """`name`, or a directory holding the config.json of a shape named here (no hub access needed)."""
    if name != "tinyllama-1.1b":
        return name
    folder = Path(tempfile.mkdtemp(prefix="autotune-bench-")) / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINYLLAMA_1_1B))
    return str(folder)


def _err(predicted: int | None, measured: int | None) -> str:
    if not predicted or not measured:
        return "      -"
    return f"{100 * (predicted - measured) / measured:+6.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--micro-batches", default="1,4,8")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--checkpointing", default="off,on")
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--optimizers", default="adamw", help=f"comma list of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--peft", default="none", help="comma list of none, lora, qlora (default rank 8, all-linear)")
    parser.add_argument("--weights", default="fp32", help="fp32 or bf16 (pure bf16)")
    parser.add_argument("--json", dest="json_path", default=None, help="write all figures to this file")
    args = parser.parse_args()

    device_type = "cpu" if args.device == "cpu" else "cuda"
    model = _model(args.model)
    configs = [
        ProbeConfig(
            model=model,
            micro_batch=mb,
            block_size=args.block_size,
            precision=precision,
            checkpointing=ckpt == "on",
            attention=args.attention,
            optimizer=optimizer,
            weights=args.weights,
            peft=None if peft == "none" else peft_text(peft),
        )
        for peft in parse_choice_list(args.peft, flag="--peft", allowed=("none", "lora", "qlora"))
        for optimizer in parse_choice_list(args.optimizers, flag="--optimizers", allowed=tuple(OPTIMIZERS))
        for precision in parse_choice_list(args.precisions, flag="--precisions", allowed=("fp32", "fp16", "bf16"))
        for ckpt in parse_choice_list(args.checkpointing, flag="--checkpointing", allowed=("off", "on"))
        for mb in parse_int_list(args.micro_batches, flag="--micro-batches")
    ]

    started = time.perf_counter()
    estimates = estimate_memories(configs, device_type=device_type, use_cache=False)
    estimate_seconds = time.perf_counter() - started

    settings = ProbeSettings(device=args.device, warmup_steps=2, measure_steps=2, margin=0)
    rows = []
    with ProbeRunner(settings) as runner:
        env = runner.environment()
        # The whole device: probes run uncapped (on CPU, half the host's memory).
        budget = env.device_total_bytes if device_type == "cuda" else (env.device_total_bytes or 2**36) // 2
        for config, est in zip(configs, estimates):
            probe = runner.run(config, settings.budget(budget))
            rows.append((config, est, probe))

    print(
        f"{env.device_name}; torch {env.torch_version}, transformers {env.transformers_version}; "
        f"estimates for {device_type}: {estimate_seconds:.1f} s for {len(configs)} ({estimate_seconds / len(configs):.1f} s each)"
    )
    header = (
        f"{'config':52} {'status':>6} | {'alloc pred':>10} {'measured':>10} {'error':>7} | "
        f"{'resv pred':>10} {'measured':>10} {'error':>7} | {'ctx pred':>9} {'measured':>9} | "
        f"{'need pred':>10} {'measured':>10} {'error':>7}"
    )
    print(header)
    print("-" * len(header))
    alloc_errors, need_errors = [], []
    for config, est, probe in rows:
        need = probe.required_bytes
        print(
            f"{config.label():52} {probe.status:>6} | "
            f"{est.peak_bytes / MiB:10.0f} {(probe.peak_allocated_bytes or 0) / MiB:10.0f} {_err(est.peak_bytes, probe.peak_allocated_bytes)} | "
            f"{est.reserved_bytes / MiB:10.0f} {(probe.peak_reserved_bytes or 0) / MiB:10.0f} {_err(est.reserved_bytes, probe.peak_reserved_bytes)} | "
            f"{est.context_bytes / MiB:9.0f} {(probe.context_bytes or 0) / MiB:9.0f} | "
            f"{est.required_bytes / MiB:10.0f} {(need or 0) / MiB:10.0f} {_err(est.required_bytes, need)}"
        )
        if probe.status == "ok" and probe.peak_allocated_bytes:
            alloc_errors.append(abs(est.peak_bytes - probe.peak_allocated_bytes) / probe.peak_allocated_bytes)
            if need:
                need_errors.append(abs(est.required_bytes - need) / need)
    if alloc_errors:
        print(
            f"peak allocated: mean |error| {100 * sum(alloc_errors) / len(alloc_errors):.1f}%, "
            f"max {100 * max(alloc_errors):.1f}% over {len(alloc_errors)} probes (MiB above)"
        )
    if need_errors:
        print(
            f"needed on the card (reserved + context): mean |error| {100 * sum(need_errors) / len(need_errors):.1f}%, "
            f"max {100 * max(need_errors):.1f}%"
        )
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(
                {
                    "environment": env.to_dict(),
                    "estimate_seconds": estimate_seconds,
                    "rows": [
                        {"config": c.to_dict(), "estimate": e.to_dict(), "probe": p.to_dict()} for c, e, p in rows
                    ],
                },
                fh,
                indent=2,
            )
        print(f"wrote {args.json_path}")
    budget_text = format_size(budget)
    print(f"(probed against a {budget_text} budget with no margin)")


if __name__ == "__main__":
    main()
