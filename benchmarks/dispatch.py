"""The host's time to launch one transformer layer's training ops, measured: the speed model's
dispatch constants (autotune/planner/card_speed.py, LAYER_DISPATCH_SECONDS and its neighbours).

A micro-step of eager PyTorch issues every op from Python through the dispatcher and autograd.
On a GPU the host does that while the card computes; when the card's work per op is short (a
small model, a small micro-step) the host is the bound. That host time does not depend on the
tensors' sizes, so it is measured here on the CPU with models of the real depth and op graph but
a width of 64 and 8 tokens, whose kernels take a microsecond or two: what is left is the
launching. (A CUDA launch adds a few microseconds of driver time per kernel that this leaves
out; the CPU's own tiny kernels stand in for it.)

Each model is timed over full training micro-steps (forward, loss, backward), fp32 and under
autocast (its casts are ops too), with and without gradient checkpointing, and with LoRA adapters
on every linear module; the per-layer figure is the micro-step's time over the layer count. The
attention is SDPA's throughout; the ops a micro-step dispatches with transformers' eager attention
instead are counted against SDPA's (the dispatch bound is the same where they are as many).
Checkpointing is timed as autotune runs it (use_reentrant=False, transformers 5's default) and,
without adapters, as transformers 4.35-4.x ran it by default (use_reentrant=True: the recompute
is a plain forward under no_grad, with fewer hooks): the published runs of that era paid the latter.

    python -m benchmarks.dispatch [--out benchmarks/results/dispatch-<cpu>-<date>.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

LAYERS = 12
TOKENS = 8
REPEATS = 12
ADAPTED = {"gpt2": 4, "bert": 6, "llama": 7}


def _models():
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    narrow = {"vocab_size": 512, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    yield "gpt2", GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=4, n_layer=LAYERS, n_positions=64, **narrow))
    yield (
        "bert",
        BertForSequenceClassification(
            BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=256, num_hidden_layers=LAYERS, **narrow)
        ),
    )
    yield (
        "llama",
        LlamaForCausalLM(
            LlamaConfig(
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=4,
                intermediate_size=256,
                num_hidden_layers=LAYERS,
                **narrow,
            )
        ),
    )


def _micro_step_seconds(
    model, *, classifier: bool, checkpointing: bool, autocast: bool, reentrant: bool = False
) -> float:
    import torch

    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_disable()
    model.train()
    ids = torch.randint(0, 512, (1, TOKENS))
    labels = torch.zeros(1, dtype=torch.long) if classifier else ids

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()

    for _ in range(3):
        step()
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _attention_ops(model, *, classifier: bool, autocast: bool) -> dict[str, int]:
    """The ops a micro-step of `model` dispatches (forward and backward, as the dispatcher sees them)
    with SDPA and with eager attention. Counted, not timed: on the CPU, SDPA is a real kernel whose
    own work at these sizes outweighs its launch (eager's steps ran faster here), where on a card it
    is one fused launch; the launches are what the dispatch bound counts."""
    import collections

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    model.gradient_checkpointing_disable()
    model.train()
    ids = torch.randint(0, 512, (1, TOKENS))
    labels = torch.zeros(1, dtype=torch.long) if classifier else ids
    counts = {}
    for attention in ("sdpa", "eager"):
        model.set_attn_implementation(attention)
        with Count() as count:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
        counts[attention] = sum(count.ops.values())
    model.set_attn_implementation("sdpa")
    return counts


def measure(*, ops_only: bool = False) -> dict:
    import torch

    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(1)  # one host thread launches the ops
    rows = []
    for name, model in _models():
        classifier = "Classification" in type(model).__name__
        # Eager attention against SDPA: the ops each dispatches, fp32 and under autocast.
        for autocast in (False, True):
            ops = _attention_ops(model, classifier=classifier, autocast=autocast)
            rows.append({"model": name, "autocast": autocast, "ops": ops})
            print(
                f"{name:6s} autocast={autocast!s:5s} ops per micro-step: eager {ops['eager']}, sdpa {ops['sdpa']} "
                f"(x{ops['eager'] / ops['sdpa']:.2f})",
                flush=True,
            )
        if ops_only:
            continue
        for lora in (False, True):
            if lora:
                from peft import LoraConfig, get_peft_model

                model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.05))
            # (reentrant checkpointing of a model whose inputs need no gradient, a LoRA model's, needs
            # enable_input_require_grads: timed without adapters only)
            kinds = [(False, False), (True, False)] + ([] if lora else [(True, True)])
            for checkpointing, reentrant in kinds:
                for autocast in (False, True):
                    seconds = _micro_step_seconds(
                        model,
                        classifier=classifier,
                        checkpointing=checkpointing,
                        autocast=autocast,
                        reentrant=reentrant,
                    )
                    rows.append(
                        {
                            "model": name,
                            "lora": lora,
                            "checkpointing": checkpointing,
                            "reentrant": reentrant,
                            "autocast": autocast,
                            "micro_step_ms": round(seconds * 1e3, 2),
                            "per_layer_ms": round(seconds / LAYERS * 1e3, 3),
                        }
                    )
                    print(
                        f"{name:6s} lora={lora!s:5s} ckpt={checkpointing!s:5s} reentrant={reentrant!s:5s} "
                        f"autocast={autocast!s:5s} {seconds * 1e3:7.1f} ms/micro-step  "
                        f"{seconds / LAYERS * 1e3:6.3f} ms/layer",
                        flush=True,
                    )
    return {"rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    """The figures speed.py takes: the median over the models of the plain layer (fp32, no
    checkpointing), and of each lever's factor over it."""

    def per_layer(**where) -> dict[str, float]:
        return {
            r["model"]: r["per_layer_ms"]
            for r in rows
            if "per_layer_ms" in r and all(r.get(k, False) == v for k, v in where.items())
        }  # (rows before reentrant: False)

    plain = per_layer(lora=False, checkpointing=False, autocast=False)
    if not plain:  # (--ops: counted, not timed)
        return _eager_ops(rows)
    ratio = lambda other: round(statistics.median(other[m] / plain[m] for m in plain), 2)
    lora = per_layer(lora=True, checkpointing=False, autocast=False)
    reentrant = per_layer(lora=False, checkpointing=True, reentrant=True, autocast=False)
    return {
        "layer_ms": statistics.median(plain.values()),
        "checkpointing_factor": ratio(per_layer(lora=False, checkpointing=True, reentrant=False, autocast=False)),
        **({"reentrant_checkpointing_factor": ratio(reentrant)} if reentrant else {}),
        "autocast_factor": ratio(per_layer(lora=False, checkpointing=False, autocast=True)),
        **_eager_ops(rows),
        # each adapted module's own ops, forward and backward: all-linear adapts 4 modules a GPT-2 layer
        # (c_attn, c_proj, c_fc, the MLP's c_proj), 6 a BERT layer, 7 a Llama layer
        "adapter_ms": round(statistics.median((lora[m] - plain[m]) / ADAPTED[m] for m in plain), 3),
    }


def _eager_ops(rows: list[dict]) -> dict[str, float]:
    """Eager attention's ops per micro-step over SDPA's: the median over models, fp32 and autocast."""
    ratios = [r["ops"]["eager"] / r["ops"]["sdpa"] for r in rows if "ops" in r]
    return {"eager_over_sdpa_ops": round(statistics.median(ratios), 2)} if ratios else {}


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    from autotune.host.environment import cpu_name

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--summarize", type=Path, default=None, help="only summarize a measured file again")
    parser.add_argument("--ops", action="store_true", help="only count eager's and SDPA's ops (no timing)")
    args = parser.parse_args(argv)
    if args.summarize is not None:
        try:
            rows = json.loads(args.summarize.read_text())["rows"]
        except (OSError, ValueError, KeyError) as exc:
            print(
                f"dispatch: cannot summarize {args.summarize}: {exc} (give a file this benchmark wrote with --out)",
                file=sys.stderr,
            )
            return 2
        print(json.dumps(summarize(rows), indent=1))
        return 0
    data = measure(ops_only=args.ops)
    data.update(
        cpu=cpu_name(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        date=datetime.date.today().isoformat(),
        layers=LAYERS,
        tokens=TOKENS,
    )
    print(json.dumps(data["summary"], indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
