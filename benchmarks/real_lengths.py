"""Fastest on the user's data: the probes of padded runs against real runs on long-tailed data.

Two recipes of examples of long-tailed lengths, each padded to its batch's longest, for micro-batches
1, 2, 4 and 8 at an effective batch of 8:

- `sft`: a causal LM trained per example as TRL's SFTTrainer trains it by default (`packing=False`),
  searched with `--trainer trl --packing off --dataset`;
- `classifier`: a GPT-2 sequence classifier under transformers' Trainer with DataCollatorWithPadding
  (run_classification.py --pad_to_max_length False), searched with `--dataset`.

Each micro-batch is a one-config study, probed in fresh processes (`search --fresh`) interleaved
with the real runs (every config once, then again in reverse): real (non-padding) tokens/s, padded
tokens/s and padding share counted at the run's collator after its first steps, beside the
leaderboard's real tokens/s. Then a whole search over the four micro-batches, as autotune searches
now and as it searched before (full rows: `--packing on`; the classifier without `--dataset`): each
pick's real run against the real runs' fastest. `--before` probes each config the old way too.

    python -m benchmarks.real_lengths [--out DIR] [--recipe sft|classifier] [--before] [--padding-free]
                                      [--steps 40] [--repeats 3]

`--padding-free` (sft): each micro-batch twice, padded and padding-free (probed with `--padding-free
on`, run by SFTTrainer with `padding_free=True` from autotune's --format trl file), and the whole
search chooses among both (`--padding-free off,on`).

The examples: 4,000 pieces of the pydoc corpus whose token counts are drawn from a log-normal
(median 24 tokens, sigma 0.9: mean about 34, a long tail) cut at the block of 128 tokens, as
ms-swift's benchmark data (3,234 +- 2,548 tokens cut at 2,048) is cut at its max_length. CPU only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_evidence.run_speed import helper_train_data
from benchmarks.run_vs_probe import autotune, sh

EFFECTIVE_BATCH = 8
BLOCK = 128
EXAMPLES = 4000
MODEL = {"model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 256}
CLASSIFIER = {**MODEL, "architectures": ["GPT2ForSequenceClassification"], "num_labels": 2}
SKIP_STEPS = 8


def write_examples(work: Path, block: int = BLOCK, median: float = 24.0) -> dict:
    """`data/examples.jsonl`: text pieces of long-tailed token counts (a log-normal of this median,
    sigma 0.9, at most `block`), each with a label."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "data" / "tokenizer")
    ids = tokenizer((work / "data" / "corpus.txt").read_text())["input_ids"]
    rng = random.Random(0)
    lengths, start = [], 0
    with (work / "data" / "examples.jsonl").open("w") as out:
        for index in range(EXAMPLES):
            length = max(2, min(block, round(rng.lognormvariate(math.log(median), 0.9))))
            if start + length > len(ids):
                start = 0
            out.write(json.dumps({"text": tokenizer.decode(ids[start : start + length]), "label": index % 2}) + "\n")
            lengths.append(length)
            start += length
    lengths.sort()
    return {
        "examples": EXAMPLES,
        "mean": round(statistics.mean(lengths), 1),
        "median": statistics.median(lengths),
        "p90": lengths[int(0.9 * EXAMPLES)],
        "longest": lengths[-1],
        "at_block": sum(1 for n in lengths if n == block),
    }


def search_args(work: Path, recipe: str, before: bool, padding_free: str | None = None) -> list[str]:
    model = work / ("classifier" if recipe == "classifier" else "model")
    # TRL appends an end-of-sequence token (examples of up to BLOCK + 1 tokens) and cuts none under
    # padding_free: those studies ask for a block above it, which the data's longest caps at BLOCK + 1.
    block = 2 * BLOCK if padding_free else BLOCK
    args = [
        "--model",
        str(model),
        "--device",
        "cpu",
        "--gpu-budget",
        "4GiB",
        "--effective-batch",
        str(EFFECTIVE_BATCH),
        "--block-sizes",
        str(block),
        "--precisions",
        "fp32",
        "--checkpointing",
        "off",
        "--attention",
        "sdpa",
    ]
    data = ["--dataset", str(work / "data" / "examples.jsonl"), "--tokenizer", str(work / "data" / "tokenizer")]
    if recipe == "sft":
        flat = ["--padding-free", padding_free] if padding_free and not before else []
        return args + ["--trainer", "trl"] + (["--packing", "on"] if before else ["--packing", "off", *data, *flat])
    return args + ([] if before else data)


def probe(
    work: Path,
    db: str,
    recipe: str,
    before: bool,
    micro_batch: int,
    measure_seconds: float,
    repeat: int,
    padding_free: bool = False,
    flat_study: bool = False,
) -> dict:
    """The leaderboard's figure of one config: a one-config study of its own for each repeat (a
    study's settled configs are not probed again), measured afresh (--fresh: no other study's)."""
    study = f"{recipe}-{'before' if before else 'after'}{'-flat' if padding_free else ''}-mb{micro_batch}-r{repeat}"
    out = autotune(
        "search",
        *search_args(work, recipe, before, ("on" if padding_free else "off") if flat_study else None),
        "--micro-batches",
        str(micro_batch),
        "--measure-seconds",
        str(measure_seconds),
        "--study",
        study,
        "--db",
        db,
        "--fresh",
        "--json",
    )
    best = json.loads(out)["best"]
    return {
        "study": study,
        "label": best["label"],
        "tokens_per_s": best["tokens_per_s"],
        "padding_share": best.get("padding_share"),
    }


def search_all(
    work: Path, db: str, recipe: str, before: bool, measure_seconds: float, padding_free: bool = False
) -> dict:
    study = f"{recipe}-{'before' if before else 'after'}{'-flat' if padding_free else ''}-search"
    out = autotune(
        "search",
        *search_args(work, recipe, before, "off,on" if padding_free else None),
        "--micro-batches",
        "1,2,4,8",
        "--measure-seconds",
        str(measure_seconds),
        "--study",
        study,
        "--db",
        db,
        "--json",
    )
    summary = json.loads(out)
    return {
        "study": study,
        "pick": summary["best"]["label"],
        "pick_micro_batch": summary["best"]["micro_batch"],
        "probes": summary["probed"],
        "confirming_probes": summary["confirming_probes"],
        "leaderboard": [(row["label"], row["tokens_per_s"]) for row in summary.get("leaderboard", [])],
    }


def run_real(work: Path, db: str, recipe: str, study: str, steps: int) -> dict:
    code = (
        "import json\nfrom benchmarks.real_lengths import real_in_process\n"
        f"print(json.dumps(real_in_process({db!r}, {study!r}, {str(work)!r}, {recipe!r}, {steps})))"
    )
    return json.loads(sh(sys.executable, "-c", code, timeout=1800).splitlines()[-1])


def real_in_process(db: str, study: str, work: str, recipe: str, steps: int) -> dict:
    """The real run of the study's winner, as its tool runs it by default: TRL's SFTTrainer with
    `packing=False` (autotune's --format trl file, packing set false whatever it says), or
    transformers' Trainer with DataCollatorWithPadding. Real tokens: the batches' attention masks;
    padded tokens: their sizes; counted at the collator, per optimizer step."""
    import autotune as at

    best = at.best(study, db)
    os.environ.update(best.environment())
    import datasets
    import transformers
    from transformers import AutoTokenizer

    config = transformers.AutoConfig.from_pretrained(Path(work) / ("classifier" if recipe == "classifier" else "model"))
    model = best.load_model(config)
    tokenizer = AutoTokenizer.from_pretrained(Path(work) / "data" / "tokenizer")
    tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    dataset = datasets.load_dataset("json", data_files=str(Path(work) / "data" / "examples.jsonl"), split="train")
    counted = {"real": 0, "padded": 0}
    ends: list[tuple[int, float, int, int]] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append((state.global_step, time.perf_counter(), counted["real"], counted["padded"]))

    common = {
        "max_steps": steps,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "logging_steps": max(1, steps // 4),
        "dataloader_num_workers": 0,
    }
    with tempfile.TemporaryDirectory() as output:
        if recipe == "sft":
            from trl import SFTConfig, SFTTrainer

            from autotune.handoff.tools import trl_document

            document = trl_document(best)
            kwargs = {
                k: v for k, v in document.items() if k not in ("model_init_kwargs", "packing", "packing_strategy")
            }
            args = SFTConfig(output_dir=output, packing=False, **common, **kwargs)
            trainer = SFTTrainer(
                model=model,
                args=args,
                train_dataset=dataset.remove_columns("label"),
                processing_class=tokenizer,
                callbacks=[StepClock()],
            )
        else:
            encoded = dataset.map(
                lambda b: tokenizer(b["text"], truncation=True, max_length=best.block_size),
                batched=True,
                remove_columns=["text"],
            ).rename_column("label", "labels")
            args = best.training_arguments(output, **common)
            trainer = transformers.Trainer(
                model=model,
                args=args,
                train_dataset=encoded,
                callbacks=[StepClock()],
                data_collator=transformers.DataCollatorWithPadding(tokenizer),
            )
        trainer.data_collator = counting(trainer.data_collator, counted)
        trainer.train()
    timed = [e for e in ends if e[0] >= SKIP_STEPS]
    (first, start, real0, padded0), (last, stop, real1, padded1) = timed[0], timed[-1]
    seconds = stop - start
    return {
        "real_tokens_per_s": (real1 - real0) / seconds,
        "padded_tokens_per_s": (padded1 - padded0) / seconds,
        "padding_share": 1 - (real1 - real0) / (padded1 - padded0),
        "steps_timed": last - first,
    }


def counting(collate, counted: dict[str, int]):
    """`collate`, adding each batch's real tokens (its mask's ones; a padding-free batch has no mask:
    every token is real) and its positions to `counted["real"]` and `counted["padded"]`."""

    def collated(examples):
        batch = collate(examples)
        positions = batch["input_ids"].numel()
        counted["real"] += int(batch["attention_mask"].sum()) if "attention_mask" in batch else positions
        counted["padded"] += positions
        return batch

    return collated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="a directory for the models, data and results.json")
    parser.add_argument("--recipe", choices=("sft", "classifier"), default="sft")
    parser.add_argument("--before", action="store_true", help="probe as autotune did before: full rows")
    parser.add_argument("--padding-free", action="store_true", help="sft: padding-free batches (TRL padding_free)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--micro-batches", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=3, help="processes of each probe and run (default 3)")
    parser.add_argument("--measure-seconds", type=float, default=3.0)
    parser.add_argument("--no-search", action="store_true", help="leave out the whole search")
    args = parser.parse_args(argv)
    work = Path(args.out or tempfile.mkdtemp(prefix="real-lengths-"))
    for name, config in (("model", MODEL), ("classifier", CLASSIFIER)):
        (work / name).mkdir(parents=True, exist_ok=True)
        (work / name / "config.json").write_text(json.dumps(config))
    helper_train_data(str(work / "data"))
    lengths = write_examples(work)
    db = f"sqlite:///{work / 'studies.db'}"
    # (micro-batch, padding-free): every one probed and run in each repeat, interleaved
    variants = [
        (int(m), flat)
        for m in args.micro_batches.split(",")
        for flat in ((False, True) if args.padding_free else (False,))
    ]
    probes: dict[tuple, list[dict]] = {}
    runs: dict[tuple, list[dict]] = {}
    for repeat in range(args.repeats):
        for mb, flat in variants if repeat % 2 == 0 else list(reversed(variants)):
            measured = probe(
                work, db, args.recipe, args.before, mb, args.measure_seconds, repeat, flat, args.padding_free
            )
            probes.setdefault((mb, flat), []).append(measured)
            run = run_real(work, db, args.recipe, measured["study"], args.steps)
            runs.setdefault((mb, flat), []).append(run)
            print(
                f"{measured['label']}: real {run['real_tokens_per_s']:,.0f} tokens/s, padded "
                f"{run['padded_tokens_per_s']:,.0f} ({run['padding_share']:.0%} padding); the probe said "
                f"{measured['tokens_per_s']:,.0f}",
                file=sys.stderr,
            )
    rows = []
    for mb, flat in variants:
        key = (mb, flat)
        row: dict = {
            "micro_batch": mb,
            "padding_free": flat,
            "label": probes[key][0]["label"],
            "probe_tokens_per_s": statistics.median(p["tokens_per_s"] for p in probes[key]),
            "probe_processes": [round(p["tokens_per_s"], 1) for p in probes[key]],
            "probe_padding_share": probes[key][0]["padding_share"],
        }
        for name in ("real_tokens_per_s", "padded_tokens_per_s", "padding_share"):
            row[name] = statistics.median(r[name] for r in runs[key])
            row[f"{name}_processes"] = [round(r[name], 3) for r in runs[key]]
        row["probe_over_real"] = round(row["probe_tokens_per_s"] / row["real_tokens_per_s"], 3)
        rows.append(row)
    fastest = max(rows, key=lambda r: r["real_tokens_per_s"])
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host_cpus": os.cpu_count(),
        "load_per_core": round(os.getloadavg()[0] / (os.cpu_count() or 1), 2),
        "recipe": args.recipe,
        "before": args.before,
        "padding_free": args.padding_free,
        "steps": args.steps,
        "model": CLASSIFIER if args.recipe == "classifier" else MODEL,
        "block": BLOCK,
        "effective_batch": EFFECTIVE_BATCH,
        "lengths": lengths,
        "rows": rows,
        "real_fastest": fastest["label"],
        "same_order": sorted(rows, key=lambda r: -r["probe_tokens_per_s"])
        == sorted(rows, key=lambda r: -r["real_tokens_per_s"]),
    }
    if not args.no_search:  # the whole search as autotune runs it now, and as it ran before (full rows)
        for key, before in (("search", args.before), ("search_as_before", True)):
            if key == "search_as_before" and args.before:
                continue
            result[key] = search_all(work, db, args.recipe, before, args.measure_seconds, args.padding_free)
            # (by micro-batch and kind: the search as before probed full rows, of another block)
            flat = result[key]["pick"].endswith(" padding-free")
            picked = next(
                r for r in rows if (r["micro_batch"], r["padding_free"]) == (result[key]["pick_micro_batch"], flat)
            )
            result[key]["pick_real_over_fastest"] = round(picked["real_tokens_per_s"] / fastest["real_tokens_per_s"], 3)
    (work / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
