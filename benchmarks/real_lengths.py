"""Fastest on the user's data? The measurement before the issue "Fastest on the user's data".

A causal-LM SFT recipe as TRL runs it by default (`packing=False`: each example padded to its
batch's longest) on examples of long-tailed lengths, for micro-batches 1, 2, 4 and 8 at an
effective batch of 8: real TRL SFTTrainer runs, each in a fresh process (interleaved, every config
once then again in reverse), their real (non-padding) tokens/s, padded tokens/s and padding share
after the first steps; beside them, what autotune's search says of each config today (a one-config
study of `--trainer trl`: it probes full blocks of the longest example's length).

    python -m benchmarks.real_lengths [--out DIR] [--steps 40] [--micro-batches 1,2,4,8] [--repeats 2]

The examples: 4,000 pieces of the pydoc corpus whose token counts are drawn from a log-normal
(median 24 tokens, sigma 0.9: mean about 33, a long tail) cut at the block of 128 tokens, as
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

from benchmarks.gpu_evidence import helper_train_data, steady_tokens_per_s
from benchmarks.run_vs_probe import autotune, sh

EFFECTIVE_BATCH = 8
BLOCK = 128
EXAMPLES = 4000
MODEL = {"model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 256}
SKIP_STEPS = 8


def write_examples(work: Path) -> dict:
    """`data/sft.jsonl`: pre-tokenized examples (`input_ids`) of long-tailed lengths, at most BLOCK."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "data" / "tokenizer")
    ids = tokenizer((work / "data" / "corpus.txt").read_text())["input_ids"]
    rng = random.Random(0)
    lengths, start = [], 0
    with (work / "data" / "sft.jsonl").open("w") as out:
        for _ in range(EXAMPLES):
            length = max(2, min(BLOCK, round(rng.lognormvariate(math.log(24), 0.9))))
            if start + length > len(ids):
                start = 0
            out.write(json.dumps({"input_ids": ids[start:start + length]}) + "\n")
            lengths.append(length)
            start += length
    lengths.sort()
    return {"examples": EXAMPLES, "mean": round(statistics.mean(lengths), 1), "median": statistics.median(lengths),
            "p90": lengths[int(0.9 * EXAMPLES)], "longest": lengths[-1],
            "at_block": sum(1 for n in lengths if n == BLOCK)}


def probe(work: Path, db: str, micro_batch: int, measure_seconds: float) -> dict:
    """What autotune says of the config today: a one-config study of TRL's step at the block size."""
    study = f"real-lengths-mb{micro_batch}"
    out = autotune("search", "--model", str(work / "model"), "--device", "cpu", "--gpu-budget", "4GiB",
                   "--micro-batches", str(micro_batch), "--effective-batch", str(EFFECTIVE_BATCH), "--block-sizes",
                   str(BLOCK), "--precisions", "fp32", "--checkpointing", "off", "--attention", "sdpa",
                   "--trainer", "trl", "--measure-seconds", str(measure_seconds), "--study", study, "--db", db,
                   "--json")
    best = json.loads(out)["best"]
    return {"study": study, "label": best["label"], "tokens_per_s": best["tokens_per_s"]}


def run_trl(work: Path, db: str, study: str, steps: int) -> dict:
    document = json.loads(autotune("best", "--study", study, "--db", db, "--format", "trl"))
    code = ("import json, sys\nfrom benchmarks.real_lengths import trl_in_process\n"
            f"print(json.dumps(trl_in_process({db!r}, {study!r}, {str(work)!r}, {steps}, "
            f"json.loads({json.dumps(json.dumps(document['sft_config']))}))))")
    return json.loads(sh(sys.executable, "-c", code, timeout=1800).splitlines()[-1])


def trl_in_process(db: str, study: str, work: str, steps: int, sft_config: dict) -> dict:
    """TRL's SFTTrainer with autotune's file, but TRL's default recipe of examples: `packing=False`
    (each batch padded to its longest example). Real tokens: the batches' attention masks; padded
    tokens: their sizes; counted at the collator, per optimizer step."""
    import autotune as at

    best = at.best(study, db)
    os.environ.update(best.environment())
    import datasets
    import transformers
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    config = transformers.AutoConfig.from_pretrained(Path(work) / "model")
    model = best.load_model(config)
    tokenizer = AutoTokenizer.from_pretrained(Path(work) / "data" / "tokenizer")
    tokenizer.pad_token = tokenizer.eos_token
    dataset = datasets.load_dataset("json", data_files=str(Path(work) / "data" / "sft.jsonl"), split="train")
    kwargs = {k: v for k, v in sft_config.items() if k not in ("model_init_kwargs", "packing", "packing_strategy")}
    counted = {"real": 0, "padded": 0}
    ends: list[tuple[int, float, int, int]] = []
    with tempfile.TemporaryDirectory() as output:
        args = SFTConfig(output_dir=output, max_steps=steps, save_strategy="no", report_to=[], disable_tqdm=True,
                         logging_steps=max(1, steps // 4), packing=False, dataloader_num_workers=0, **kwargs)

        class StepClock(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                ends.append((state.global_step, time.perf_counter(), counted["real"], counted["padded"]))

        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=[StepClock()])
        collate = trainer.data_collator

        def counting(examples):
            batch = collate(examples)
            counted["real"] += int(batch["attention_mask"].sum())
            counted["padded"] += batch["input_ids"].numel()
            return batch

        trainer.data_collator = counting
        trainer.train()
    timed = [e for e in ends if e[0] >= SKIP_STEPS]
    (first, start, real0, padded0), (last, stop, real1, padded1) = timed[0], timed[-1]
    seconds = stop - start
    return {"real_tokens_per_s": (real1 - real0) / seconds, "padded_tokens_per_s": (padded1 - padded0) / seconds,
            "padding_share": 1 - (real1 - real0) / (padded1 - padded0), "steps_timed": last - first,
            "full_block_tokens_per_s": steady_tokens_per_s([(s, t) for s, t, _, _ in ends], best.config.tokens_per_step,
                                                           SKIP_STEPS)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="a directory for the model, data and results.json")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--micro-batches", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=2, help="processes of each run (default 2)")
    parser.add_argument("--measure-seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    work = Path(args.out or tempfile.mkdtemp(prefix="real-lengths-"))
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(MODEL))
    helper_train_data(str(work / "data"))
    lengths = write_examples(work)
    db = f"sqlite:///{work / 'studies.db'}"
    micro_batches = [int(m) for m in args.micro_batches.split(",")]
    probes = {mb: probe(work, db, mb, args.measure_seconds) for mb in micro_batches}
    runs: dict[int, list[dict]] = {}
    for repeat in range(args.repeats):
        for mb in micro_batches if repeat % 2 == 0 else reversed(micro_batches):
            run = run_trl(work, db, probes[mb]["study"], args.steps)
            runs.setdefault(mb, []).append(run)
            print(f"mb{mb}: real {run['real_tokens_per_s']:,.0f} tokens/s, padded {run['padded_tokens_per_s']:,.0f} "
                  f"({run['padding_share']:.0%} padding); the probe said {probes[mb]['tokens_per_s']:,.0f}",
                  file=sys.stderr)
    rows = []
    for mb in micro_batches:
        row = {"micro_batch": mb, "label": probes[mb]["label"], "probe_tokens_per_s": probes[mb]["tokens_per_s"]}
        for name in ("real_tokens_per_s", "padded_tokens_per_s", "padding_share"):
            row[name] = statistics.median(r[name] for r in runs[mb])
            row[f"{name}_processes"] = [round(r[name], 3) for r in runs[mb]]
        rows.append(row)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host_cpus": os.cpu_count(),
              "load_per_core": round(os.getloadavg()[0] / (os.cpu_count() or 1), 2), "steps": args.steps,
              "model": MODEL, "block": BLOCK, "effective_batch": EFFECTIVE_BATCH, "lengths": lengths, "rows": rows}
    (work / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
