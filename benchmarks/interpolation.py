"""Interpolation vs trace: how far a group's interpolated members are from a trace of the same
config (on CPU, where a trace equals the probe to the byte, so from what a probe measures).

A search and a plan trace each group's smallest and largest micro-batch (and the middle one of four
or more) and interpolate the rest (estimate/interpolate.py). This traces every member of groups of
tiny models of three tasks, with and without an eval phase, and prints each member's error two ways:
the chord of the largest peak (how autotune interpolated before) and each phase's chord, the peak
their largest (how it interpolates now). estimate/interpolate.py states the worst as
INTERPOLATION_OVERSHOOT.

    python -m benchmarks.interpolation                 # about a minute on 2 cores, traces cached after
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from autotune.levers.config import ProbeConfig
from autotune.estimate import estimate_memories
from autotune.estimate.interpolate import INTERPOLATION_OVERSHOOT, between, interpolated, traced_members

TINY_GPT2 = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 2,
    "vocab_size": 1024,
    "n_positions": 256,
    "n_ctx": 256,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
TINY_BERT = {
    "model_type": "bert",
    "architectures": ["BertForSequenceClassification"],
    "vocab_size": 1024,
    "max_position_embeddings": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 128,
    "num_labels": 3,
}
TINY_PEGASUS = {
    "model_type": "pegasus",
    "architectures": ["PegasusForConditionalGeneration"],
    "vocab_size": 1024,
    "max_position_embeddings": 256,
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "is_encoder_decoder": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
}
MODELS = {
    "gpt2": (TINY_GPT2, {}),
    "bert-classification": (TINY_BERT, {"task": "classification", "num_labels": 3}),
    "pegasus": (TINY_PEGASUS, {"task": "seq2seq", "target_length": 32}),
}
EVALUATIONS = ({}, {"eval_batch": 8}, {"eval_batch": 16, "eval_logits": "kept", "eval_accumulation_steps": 4})


def groups(root: Path) -> list[list[ProbeConfig]]:
    """Every accumulating group (micro-batch 1, 2, 4 of an effective batch of 8) of each model,
    evaluation and attention kernel."""
    out = []
    for name, (config, fields) in MODELS.items():
        directory = root / name
        directory.mkdir(exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config))
        for evaluation in EVALUATIONS:
            for attention in ("sdpa", "eager"):
                out.append(
                    [
                        ProbeConfig(
                            str(directory), mb, 64, grad_accum=8 // mb, attention=attention, **fields, **evaluation
                        )
                        for mb in (1, 2, 4)
                    ]
                )
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cases = groups(Path(tmp))
        estimates = {e.config.key(): e for e in estimate_memories([c for g in cases for c in g], device_type="cpu")}
        worst_before = worst_after = 0.0
        count = 0
        print(f"{'model':20s} {'config':50s} {'exact':>10s} {'before':>8s} {'after':>8s}")
        for group in cases:
            traced = [estimates[c.key()] for c in traced_members(group)]
            for config in group:
                if config in traced_members(group):
                    continue
                exact = estimates[config.key()].peak_bytes
                low, high, t = between(config, traced)
                before = round(low.peak_bytes + t * (high.peak_bytes - low.peak_bytes)) / exact - 1
                after = interpolated(config, low, high, t).peak_bytes / exact - 1
                worst_before, worst_after = max(worst_before, before), max(worst_after, after)
                count += 1
                print(
                    f"{Path(config.model).name:20s} {config.label():50s} {exact / 2**20:8.2f}Mi {before:+8.1%} "
                    f"{after:+8.1%}"
                )
        print(
            f"\n{count} interpolated configs on cpu: worst overshoot before {worst_before:+.1%} (chord of the largest "
            f"phase), after {worst_after:+.1%} (each phase's chord); stated: {INTERPOLATION_OVERSHOOT:.0%}"
        )


if __name__ == "__main__":
    main()
