"""Fastest on the user's data (pass 3, issue 57): a causal LM trained one example per row, as TRL's
SFTTrainer trains it, on long-tailed examples (benchmarks/real_lengths.py's). The search among
micro-batches, padded and padding-free; real TRL runs of its pick and of the fastest padded config;
and `autotune plan --dataset`'s predicted ratios between configs against the measured ones.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from benchmarks.gpu_evidence.common import SectionEnd, Skip
from benchmarks.gpu_evidence.invocation import Run
from benchmarks.gpu_evidence.run_speed import helper_train_data
from benchmarks.gpu_evidence.search import run_search

# The data_lengths section's examples (benchmarks/real_lengths.py's long tail, scaled): on the card a
# median of 192 tokens cut at 1,024, so that padding and the attention over a padding-free row are a
# card's work; on CPU the benchmark's own (median 24, cut at 128) on its 4-layer model.
LENGTHS_ON_CARD = {"block": 1024, "median": 192.0, "micro_batches": "4,8,16,32", "effective_batch": "32"}
LENGTHS_ON_CPU = {"block": 128, "median": 24.0, "micro_batches": "2,4", "effective_batch": "4"}


def section_data_lengths(run: Run) -> dict:
    """Fastest on the user's data, on the card (issue 57): a causal LM trained one example per row,
    as TRL's SFTTrainer trains it, on long-tailed examples; the search chooses among micro-batches,
    padded and padding-free. Then the real TRL runs of its pick and of the fastest padded config
    (real tokens/s against the probes'), and `plan --dataset`'s predictions for the same configs: the
    ratios between configs, predicted against measured."""
    shape = LENGTHS_ON_CARD if run.cuda else LENGTHS_ON_CPU
    work = run.state / "lengths"
    data = run.helper(
        "lengths_data", timeout=600, directory=str(work), block=shape["block"], median=shape["median"], card=run.cuda
    )
    # (the block above the longest example, TRL's end-of-sequence token included: the data caps it, and
    # TRL cuts no example under padding_free)
    space = [
        "--model",
        str(work / "model"),
        "--trainer",
        "trl",
        "--packing",
        "off",
        "--dataset",
        str(work / "data" / "examples.jsonl"),
        "--tokenizer",
        str(work / "data" / "tokenizer"),
        "--micro-batches",
        shape["micro_batches"],
        "--effective-batch",
        shape["effective_batch"],
        "--block-sizes",
        str(2 * shape["block"]),
        "--checkpointing",
        "off",
        "--attention",
        "sdpa",
        "--precisions",
        "bf16" if run.cuda else "fp32",
    ]
    probing = (
        ["--gpu-budget", "32GiB"]
        if run.cuda
        else ["--gpu-budget", "2GiB", "--device", "cpu", "--no-predict", "--measure-seconds", "0.5"]
    )
    db = run.db("lengths.db")
    searches = dict(run.previous("data_lengths").get("searches", {}))
    # The padded configs alone come second: the probes of the first, reused (same database), their
    # pick the fastest padded config.
    for name, padding_free in (("lengths", "off,on"), ("lengths-padded", "off")):
        if searches.get(name, {}).get("study_status") == "finished":
            continue
        try:
            searches[name] = run_search(
                run, searches.get(name, {}), [*space, *probing, "--padding-free", padding_free, "--study", name], db
            )
        except SectionEnd as end:
            end.figures = {"data": data, "searches": {**searches, name: end.figures}}
            raise
    searched, padded = searches["lengths"], searches["lengths-padded"]
    steps = 60 if run.cuda else 12
    runs = {
        name: run.helper("lengths_run", timeout=900, db=db, study=study, work=str(work), steps=steps)
        for name, study in (("pick", "lengths"), ("padded_pick", "lengths-padded"))
    }
    for name, search in (("pick", searched), ("padded_pick", padded)):
        probe = (search.get("pick") or {}).get("tokens_per_s")
        real = runs[name].get("real_tokens_per_s")
        runs[name].update(
            label=(search.get("pick") or {}).get("label"),
            probe_tokens_per_s=probe,
            probe_over_real=round(probe / real, 3) if probe and real else None,
        )
    card = ["--gpu", gpu_card_name(run)] if run.cuda else ["--gpu", "cpu", "--gpu-budget", "2GiB"]
    plan = run.autotune("plan", *space, "--padding-free", "off,on", *card, "--json", timeout=600).json(
        what="autotune plan"
    )
    measured = {row["label"]: row["tokens_per_s"] for row in searched["leaderboard"] if row.get("tokens_per_s")}
    predicted = {c["label"]: c.get("tokens_per_s") for c in plan.get("candidates", []) if c.get("label") in measured}
    return {
        "data": data,
        "searches": searches,
        "runs": runs,
        "plan": {"command": "autotune plan ... " + " ".join(card), "predicted": predicted},
        "plan_vs_probes": ratios_between(predicted, measured),
    }


def gpu_card_name(run: Run) -> str:
    from autotune.specs.cards import card_for_device

    card = card_for_device(str(run.doc.get("device") or ""))
    if card is None:
        raise Skip(f"no card of autotune's table is named like {run.doc.get('device')!r}: plan cannot price it")
    return card.short_name


def ratios_between(predicted: Mapping[str, float | None], measured: Mapping[str, float]) -> list[dict]:
    """Each config's speed against the fastest measured one's, predicted and measured."""
    best = max(measured, key=measured.__getitem__, default=None)
    if best is None or not predicted.get(best):
        return []
    return [
        {
            "label": label,
            "measured": round(speed / measured[best], 3),
            "predicted": round(predicted[label] / predicted[best], 3) if predicted.get(label) else None,
        }
        for label, speed in sorted(measured.items(), key=lambda item: -item[1])
    ]


def helper_lengths_data(directory: str, block: int, median: float, card: bool) -> dict:
    """benchmarks/real_lengths.py's data (a corpus, a tokenizer, 4,000 long-tailed examples) and its
    model: GPT-2's shape on a card, the benchmark's 4-layer one on CPU."""
    from benchmarks import real_lengths

    work = Path(directory)
    helper_train_data(str(work / "data"))
    (work / "model").mkdir(parents=True, exist_ok=True)
    shape = (
        {
            "model_type": "gpt2",
            "n_layer": 12,
            "n_embd": 768,
            "n_head": 12,
            "vocab_size": 50257,
            "n_positions": 2 * block,
        }
        if card
        else {**real_lengths.MODEL, "n_positions": 2 * block}
    )
    (work / "model" / "config.json").write_text(json.dumps(shape))
    return real_lengths.write_examples(work, block=block, median=median)


def helper_lengths_run(db: str, study: str, work: str, steps: int) -> dict:
    """The study's pick trained by TRL's SFTTrainer on the examples (benchmarks/real_lengths.py):
    real tokens/s after its first steps, counted at the collator."""
    from benchmarks import real_lengths

    return real_lengths.real_in_process(db, study, work, "sft", steps)
