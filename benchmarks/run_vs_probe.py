"""Does the run go as fast as its probe? For each of a few configs of one small GPT-2 (each its own
one-config study, probed by `autotune search`), three real runs on the same corpus, each in a
process of its own: a plain transformers Trainer from `best.training_arguments()` +
`best.load_model()` (the README's hand-off), TRL's SFTTrainer from `autotune best --format trl`, and
`autotune train`. Each run's tokens/s after its first 10 steps against the probe's, and the ratios
between configs (does the leaderboard's order hold in the runs?). TRL's run is set against a probe
of its own step (`--trainer trl`, a study of its own), the others against Trainer's. Runs are interleaved (every config
once, then every config again in reverse) and each figure is the median of its processes.

    python -m benchmarks.run_vs_probe [--out DIR] [--steps 60] [--micro-batches 1,4,8] [--repeats 2]
                                      [--runs trainer,trl,train] [--task causal-lm|classification] [--reprobe]

`--task classification`: a 4-layer BERT classifier of 3 labels instead, on short reviews of mixed
lengths padded to the block size as transformers' run_classification.py pads them
(`pad_to_max_length`, its default): the plain Trainer and `autotune train` (TRL trains causal LMs).

CPU only as written (`--device cpu`): on a card, benchmarks/gpu_evidence/run_speed.py's `trainer_handoff` and
`train_200_steps` sections measure the pick the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_evidence.run_speed import helper_train_data, helper_trainer_handoff, steady_tokens_per_s

EFFECTIVE_BATCH = 8
BLOCK = 64
MODEL = {"model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 128}
LABELS = ("negative", "neutral", "positive")
CLASSIFIER = {
    "model_type": "bert",
    "architectures": ["BertForSequenceClassification"],
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "intermediate_size": 1024,
    "vocab_size": 8192,
    "max_position_embeddings": 128,
    "id2label": dict(enumerate(LABELS)),
    "label2id": {label: i for i, label in enumerate(LABELS)},
}
# The word-level tokenizer's special tokens (a BERT classifier's, with a pad token).
SPECIALS = {"pad_token": "<pad>", "unk_token": "<unk>", "cls_token": "[CLS]", "sep_token": "[SEP]"}
# Steps a run takes before its clock starts (the first steps pay one-time costs).
SKIP_STEPS = 10


def sh(*args: str, timeout: float = 900) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(args[:4])}... exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def autotune(*args: str, timeout: float = 900) -> str:
    return sh(sys.executable, "-m", "autotune", *args, timeout=timeout)


def probe(
    work: Path,
    db: str,
    micro_batch: int,
    measure_seconds: float,
    task: str = "causal-lm",
    trainer: str = "transformers",
) -> dict:
    """One config's study: the search measures it (and its confirmation round, if any, again), timing
    `trainer`'s step."""
    study = f"run-vs-probe-mb{micro_batch}" + ("" if trainer == "transformers" else f"-{trainer}")
    recipe = ["--task", "classification", "--num-labels", str(len(LABELS))] if task == "classification" else []
    recipe += ["--trainer", trainer]
    out = autotune(
        "search",
        "--model",
        str(work / "model"),
        "--device",
        "cpu",
        "--gpu-budget",
        "4GiB",
        "--micro-batches",
        str(micro_batch),
        "--effective-batch",
        str(EFFECTIVE_BATCH),
        "--block-sizes",
        str(BLOCK),
        "--precisions",
        "fp32",
        "--checkpointing",
        "off",
        "--attention",
        "sdpa",
        *recipe,
        "--measure-seconds",
        str(measure_seconds),
        "--study",
        study,
        "--db",
        db,
        "--json",
    )
    summary = json.loads(out)
    return {"study": study, "label": summary["best"]["label"], "tokens_per_s": summary["best"]["tokens_per_s"]}


def run_trainer(work: Path, db: str, study: str, steps: int) -> float:
    code = (
        "import json, sys\nfrom benchmarks.run_vs_probe import trainer_in_process\n"
        f"print(json.dumps(trainer_in_process({db!r}, {study!r}, {str(work)!r}, {steps})))"
    )
    return json.loads(sh(sys.executable, "-c", code).splitlines()[-1])["tokens_per_s"]


def trainer_in_process(db: str, study: str, work: str, steps: int) -> dict:
    if (Path(work) / "data" / "reviews.csv").exists():
        return classifier_trainer_in_process(db, study, work, steps)
    with tempfile.TemporaryDirectory() as output:
        return helper_trainer_handoff(db, study, str(Path(work) / "data"), output, steps)


def write_reviews(work: Path) -> None:
    """The classifier's data: reviews of 20 to 400 characters (a long tail, as real ones), cut from
    the corpus, each with one of LABELS; and a word-level tokenizer with BERT's special tokens, in
    the model's directory."""
    import csv
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = (work / "data" / "corpus.txt").read_text()
    words = Tokenizer(models.WordLevel(unk_token=SPECIALS["unk_token"]))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(
        [text], trainers.WordLevelTrainer(vocab_size=2000, show_progress=False, special_tokens=list(SPECIALS.values()))
    )
    PreTrainedTokenizerFast(tokenizer_object=words, **SPECIALS).save_pretrained(work / "model")
    rng = random.Random(0)
    with (work / "data" / "reviews.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        start = 0
        for _ in range(2000):
            length = min(400, int(rng.paretovariate(1.2) * 20))
            writer.writerow([text[start : start + length].replace("\n", " "), rng.choice(LABELS)])
            start = (start + length) % (len(text) - 400)


def classifier_trainer_in_process(db: str, study: str, work: str, steps: int) -> dict:
    """The README's hand-off for the classifier: `best.training_arguments()` and `best.load_model()`
    into a plain Trainer, the reviews tokenized and padded to the block size as run_classification.py
    does by default; tokens/s after the first SKIP_STEPS steps, counting the padded tokens (what the
    probe's figure counts)."""
    import csv

    import autotune

    best = autotune.best(study, db)
    os.environ.update(best.environment())
    import torch
    import transformers
    from transformers import AutoTokenizer, Trainer, default_data_collator

    config = transformers.AutoConfig.from_pretrained(Path(work) / "model")
    model = best.load_model(config)
    tokenizer = AutoTokenizer.from_pretrained(Path(work) / "model")
    with (Path(work) / "data" / "reviews.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    encoded = tokenizer([r["text"] for r in rows], padding="max_length", truncation=True, max_length=best.block_size)
    dataset = [
        {"input_ids": ids, "attention_mask": mask, "labels": LABELS.index(r["label"])}
        for ids, mask, r in zip(encoded["input_ids"], encoded["attention_mask"], rows)
    ]
    ends: list[tuple[int, float]] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append((state.global_step, time.perf_counter()))

    with tempfile.TemporaryDirectory() as output:
        args = best.training_arguments(
            output,
            max_steps=steps,
            save_strategy="no",
            logging_steps=max(1, steps // 4),
            report_to=[],
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        Trainer(
            model=model, args=args, train_dataset=dataset, data_collator=default_data_collator, callbacks=[StepClock()]
        ).train()
    steady = steady_tokens_per_s(ends, best.config.tokens_per_step, SKIP_STEPS)
    return {"tokens_per_s": steady, "torch_threads": torch.get_num_threads()}


def run_trl(work: Path, db: str, study: str, steps: int) -> float:
    document = json.loads(autotune("best", "--study", study, "--db", db, "--format", "trl"))
    code = (
        "import json, sys\nfrom benchmarks.run_vs_probe import trl_in_process\n"
        f"print(json.dumps(trl_in_process({db!r}, {study!r}, {str(work)!r}, {steps}, "
        f"json.loads({json.dumps(json.dumps(document['sft_config']))}))))"
    )
    return json.loads(sh(sys.executable, "-c", code).splitlines()[-1])["tokens_per_s"]


def trl_in_process(db: str, study: str, work: str, steps: int, sft_config: dict) -> dict:
    """TRL's SFTTrainer as its user runs it with autotune's file: SFTConfig(**sft_config), the model
    built by best.load_model (model_init_kwargs apply only to a model given by name), the corpus as
    text (SFTTrainer tokenizes and packs it into full blocks, as the document says)."""
    import autotune

    best = autotune.best(study, db)
    os.environ.update(best.environment())
    import datasets
    import torch
    import transformers
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from autotune.specs.models import resolve_model

    spec = resolve_model(best.config.model)
    config = transformers.AutoConfig.for_model(
        spec.config["model_type"], **{k: v for k, v in spec.config.items() if k != "model_type"}
    )
    model = best.load_model(config)
    tokenizer = AutoTokenizer.from_pretrained(Path(work) / "data" / "tokenizer")
    text = (Path(work) / "data" / "corpus.txt").read_text()
    dataset = datasets.Dataset.from_dict({"text": [p for p in text.split("\n\n") if p.strip()]})
    kwargs = {k: v for k, v in sft_config.items() if k != "model_init_kwargs"}
    with tempfile.TemporaryDirectory() as output:
        args = SFTConfig(
            output_dir=output,
            max_steps=steps,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            logging_steps=max(1, steps // 4),
            **kwargs,
        )
        ends: list[tuple[int, float]] = []

        class StepClock(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                ends.append((state.global_step, time.perf_counter()))

        trainer = SFTTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[StepClock()]
        )
        trainer.train()
    steady = steady_tokens_per_s(ends, best.config.tokens_per_step, SKIP_STEPS)
    return {"tokens_per_s": steady, "torch_threads": torch.get_num_threads()}


def run_probe(work: Path, db: str, study: str, steps: int, measure_seconds: float = 3.0) -> float:
    """The study's config probed again in a fresh process (`autotune probe`), so that the probe's
    figure is, like each run's, the median of processes measured in the same interleaved order, not
    the one window of the search's process."""
    c = json.loads(autotune("best", "--study", study, "--db", db, "--format", "json"))
    recipe = ["--task", c["task"]] + (["--num-labels", str(c["num_labels"])] if c["num_labels"] else [])
    out = autotune(
        "probe",
        "--model",
        c["model"],
        "--micro-batch",
        str(c["micro_batch"]),
        "--block-size",
        str(c["block_size"]),
        "--grad-accum",
        str(c["grad_accum"]),
        "--precision",
        c["precision"],
        "--attention",
        c["attention"],
        "--trainer",
        c["trainer"],
        *recipe,
        "--gpu-budget",
        "4GiB",
        "--device",
        "cpu",
        "--measure-seconds",
        str(measure_seconds),
        "--json",
    )
    return json.loads(out)["tokens_per_s"]


def run_train(work: Path, db: str, study: str, steps: int) -> float:
    classifier = (work / "data" / "reviews.csv").exists()
    data = (
        ["--dataset", str(work / "data" / "reviews.csv"), "--tokenizer", str(work / "model")]
        if classifier
        else ["--dataset", str(work / "data" / "corpus.txt"), "--tokenizer", str(work / "data" / "tokenizer")]
    )
    with tempfile.TemporaryDirectory() as output:
        out = autotune(
            "train",
            "--study",
            study,
            "--db",
            db,
            *data,
            "--max-steps",
            str(steps),
            "--save-steps",
            str(steps * 10),
            "--device",
            "cpu",
            "--output-dir",
            output,
            "--json",
        )
    return json.loads(out)["tokens_per_s"]


RUNS = {"trainer": run_trainer, "trl": run_trl, "train": run_train}
# With --reprobe, each trainer's probe again in fresh processes, interleaved with the runs.
PROBES = {"transformers": "probe", "trl": "probe_trl"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="a directory for the model, data and results.json")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--micro-batches", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=2, help="processes of each run (default 2)")
    parser.add_argument("--measure-seconds", type=float, default=3.0)
    parser.add_argument(
        "--runs", default=None, help=f"which runs (default {','.join(RUNS)}; trainer,train for a classifier)"
    )
    parser.add_argument("--task", default="causal-lm", choices=("causal-lm", "classification"))
    parser.add_argument(
        "--reprobe",
        action="store_true",
        help="probe each config again in a fresh process beside each repeat of the runs: the probe's "
        "figure becomes the median of its processes too",
    )
    args = parser.parse_args(argv)
    classifier = args.task == "classification"
    runs = (args.runs or ("trainer,train" if classifier else ",".join(RUNS))).split(",")
    if classifier and "trl" in runs:
        parser.error("TRL's SFTTrainer trains causal LMs: --runs trainer,train for a classifier")
    work = Path(args.out or tempfile.mkdtemp(prefix="run-vs-probe-"))
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(CLASSIFIER if classifier else MODEL))
    helper_train_data(str(work / "data"))
    if classifier:
        write_reviews(work)
    db = f"sqlite:///{work / 'studies.db'}"
    micro_batches = [int(m) for m in args.micro_batches.split(",")]
    # Each run against the probe of its own trainer's step: TRL's SFTTrainer, or Trainer's.
    trainers = {kind: "trl" if kind == "trl" else "transformers" for kind in runs}
    probes = {
        (mb, trainer): probe(work, db, mb, args.measure_seconds, args.task, trainer)
        for trainer in dict.fromkeys(trainers.values())
        for mb in micro_batches
    }
    measured: dict[tuple[int, str], list[float]] = {}
    kinds = runs + ([PROBES[trainer] for trainer in dict.fromkeys(trainers.values())] if args.reprobe else [])
    order = [(mb, kind) for mb in micro_batches for kind in kinds]
    for repeat in range(args.repeats):
        for mb, kind in order if repeat % 2 == 0 else reversed(order):
            reprobed = next((t for t, name in PROBES.items() if name == kind), None)
            probed = probes[(mb, reprobed or trainers[kind])]
            if reprobed is not None:
                figure = run_probe(work, db, probed["study"], args.steps, args.measure_seconds)
            else:
                figure = RUNS[kind](work, db, probed["study"], args.steps)
            measured.setdefault((mb, kind), []).append(figure)
            print(f"mb{mb} {kind}: {figure:,.0f} tokens/s (probe {probed['tokens_per_s']:,.0f})", file=sys.stderr)
    rows = []
    for mb in micro_batches:
        row = {"micro_batch": mb, "label": probes[(mb, trainers[runs[0]])]["label"]}
        for trainer in dict.fromkeys(trainers.values()):
            # The search's window, or with --reprobe the median of the probe's processes.
            name = PROBES[trainer]
            row[f"{name}_search"] = probes[(mb, trainer)]["tokens_per_s"]
            row[name] = statistics.median(measured[(mb, name)]) if args.reprobe else row[f"{name}_search"]
            if args.reprobe:
                row[f"{name}_processes"] = measured[(mb, name)]
        for kind in runs:
            figures = measured[(mb, kind)]
            row[kind] = statistics.median(figures)
            row[f"{kind}_processes"] = figures
            row[f"{kind}_vs_probe"] = round(row[kind] / row[PROBES[trainers[kind]]], 3)
        rows.append(row)
    first = rows[0]
    columns = [name for name in PROBES.values() if name in first] + runs
    ratios = {
        f"mb{row['micro_batch']}/mb{first['micro_batch']}": {
            kind: round(row[kind] / first[kind], 3) for kind in columns
        }
        for row in rows[1:]
    }
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host_cpus": os.cpu_count(),
        "load_per_core": round(os.getloadavg()[0] / (os.cpu_count() or 1), 2),
        "steps": args.steps,
        "task": args.task,
        "model": CLASSIFIER if classifier else MODEL,
        "block": BLOCK,
        "effective_batch": EFFECTIVE_BATCH,
        "rows": rows,
        "ratios": ratios,
    }
    (work / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
