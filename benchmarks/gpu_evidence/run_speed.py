"""Does the run go as fast as its probe: `autotune train` with the README search's pick (pass 1 and
2), and the README's hand-off in a plain transformers Trainer (pass 2, `best.training_arguments()`,
`best.load_model()`), each run's tokens/s against its probe's. With the data both train on (a corpus
and a small tokenizer), which benchmarks/real_lengths.py and benchmarks/run_vs_probe.py use too.
"""

from __future__ import annotations

import shlex
import shutil
import time
from pathlib import Path

from benchmarks.gpu_evidence.common import Failed
from benchmarks.gpu_evidence.invocation import Run

# The goal the issue sets for a run's tokens/s against its probe's (reported met or not).
RUN_VS_PROBE_GOAL = 0.95
# The CPU mode's corpus: the first 60,000 characters of the whole (~28,000 tokens, 430 blocks of the
# tiny model's 64 for its 5 steps of 2). Its tokenizer trained, and it packed and tokenized by both
# runs, in ~0.3 s of CPU where the whole ~460 KB took ~2.5 s of the CPU mode's minute.
CPU_CORPUS_CHARS = 60_000


def corpus_size(run: Run) -> dict:
    """The train data's size, as helper_train_data's keyword: the whole corpus on a card."""
    return {} if run.cuda else {"chars": CPU_CORPUS_CHARS}


def section_train_200_steps(run: Run) -> dict:
    """`autotune train` with the README search's winner under its budget: the run's peak and speed
    against its probe's."""
    study = run.sections["readme_command"].get("study")
    if not study:
        raise Failed("readme_command recorded no study name")
    data = run.state / "train-data"
    run.helper("train_data", timeout=300, directory=str(data), **corpus_size(run))
    steps = 200 if run.cuda else 5
    output = run.state / "train-run"
    # A fresh directory each attempt: an earlier one's checkpoints would make this a resumed run.
    shutil.rmtree(output, ignore_errors=True)
    argv = [
        "train",
        "--study",
        study,
        "--dataset",
        str(data / "corpus.txt"),
        "--tokenizer",
        str(data / "tokenizer"),
        "--max-steps",
        str(steps),
        "--save-steps",
        str(steps * 10),
        "--device",
        run.mode,
        "--output-dir",
        str(output),
        "--db",
        run.db("readme.db"),
        "--json",
    ]
    summary = run.autotune(*argv, timeout=1200).json(accept=(0, 1), what="autotune train")
    probe = summary.get("probe") or {}
    speed, probe_speed = summary.get("tokens_per_s"), probe.get("tokens_per_s")
    required = (summary.get("peak_reserved_bytes") or 0) + (summary.get("context_bytes") or 0)
    return {
        "command": "autotune " + shlex.join(argv),
        "run_status": summary.get("status"),
        **{
            k: summary.get(k)
            for k in (
                "steps",
                "tokens_per_s",
                "wall_tokens_per_s",
                "train_seconds",
                "peak_allocated_bytes",
                "peak_reserved_bytes",
                "context_bytes",
                "budget_bytes",
                "margin_bytes",
                "cap_bytes",
                "peak_vs_probe",
                "final_loss",
                "warnings",
                "error",
            )
        },
        "config": (summary.get("config") or {}).get("label"),
        "probe": probe,
        "tokens_per_s_vs_probe": round(speed / probe_speed, 3) if speed and probe_speed else None,
        "within_budget": bool(summary.get("budget_bytes")) and required <= summary["budget_bytes"],
    }


def section_trainer_handoff(run: Run) -> dict:
    """The README's hand-off in a plain transformers Trainer (`best.training_arguments()`,
    `best.load_model()`), 200 steps on `autotune train`'s data: its tokens/s against the probe's."""
    readme = run.sections["readme_command"]
    data = run.state / "train-data"  # (made by helper_trainer_handoff where train_200_steps did not)
    output = run.state / "handoff-run"
    shutil.rmtree(output, ignore_errors=True)
    steps = 200 if run.cuda else 5
    result = run.helper(
        "trainer_handoff",
        timeout=900,
        db=run.db("readme.db"),
        study=readme.get("study"),
        data_dir=str(data),
        output_dir=str(output),
        steps=steps,
        **corpus_size(run),
    )
    probe = (readme.get("pick") or {}).get("tokens_per_s")
    truth = (run.sections.get("truth") or {}).get("pick") or {}
    train = run.sections.get("train_200_steps") or {}
    ratio = round(result["tokens_per_s"] / probe, 3) if result.get("tokens_per_s") and probe else None
    return {
        **result,
        "probe_tokens_per_s": probe,
        "tokens_per_s_vs_probe": ratio,
        "goal": RUN_VS_PROBE_GOAL,
        "met": ratio is not None and ratio >= RUN_VS_PROBE_GOAL,
        "tokens_per_s_vs_truth_median": (
            round(result["tokens_per_s"] / truth["truth_median"], 3)
            if result.get("tokens_per_s") and truth.get("truth_median")
            else None
        ),
        "autotune_train_tokens_per_s": train.get("tokens_per_s"),
        "autotune_train_vs_probe": train.get("tokens_per_s_vs_probe"),
    }


def helper_train_data(directory: str, chars: int | None = None) -> dict:
    """A corpus (the standard library's pydoc topics, ~460 KB of English; its first `chars`
    characters when given) and a 500-token byte-level BPE tokenizer trained on it, as
    tests/train/conftest.py makes them (within any GPT-2 vocabulary)."""
    import pydoc_data.topics

    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    root = Path(directory)
    corpus, tokenizer = root / "corpus.txt", root / "tokenizer"
    if not (corpus.exists() and (tokenizer / "tokenizer.json").exists()):
        root.mkdir(parents=True, exist_ok=True)
        topics = pydoc_data.topics.topics
        text = "\n\n".join(topics[name] for name in sorted(topics))[:chars]
        corpus.write_text(text)
        special = "<|endoftext|>"
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator([text], vocab_size=500, min_frequency=2, special_tokens=[special], show_progress=False)
        PreTrainedTokenizerFast(
            tokenizer_object=bpe._tokenizer, bos_token=special, eos_token=special, unk_token=special
        ).save_pretrained(tokenizer)
    return {"corpus_bytes": corpus.stat().st_size, "tokenizer": str(tokenizer)}


def steady_tokens_per_s(ends: list[tuple[int, float]], tokens_per_step: int, skip: int) -> float | None:
    """A run's tokens/s from (optimizer step, wall time at its end) pairs, after its first `skip` steps."""
    timed = [(step, at) for step, at in ends if step >= skip]
    if len(timed) < 2 or timed[-1][1] <= timed[0][1]:
        return None
    return tokens_per_step * (timed[-1][0] - timed[0][0]) / (timed[-1][1] - timed[0][1])


def helper_trainer_handoff(
    db: str, study: str, data_dir: str, output_dir: str, steps: int, chars: int | None = None
) -> dict:
    """The README's hand-off as a user writes it: `best.training_arguments()` and `best.load_model()`
    into a plain transformers Trainer, on the data `autotune train` had (its corpus in blocks of
    `best.block_size` tokens of its tokenizer); tokens/s after the first 10 steps, and Trainer's own."""
    import os as _os

    import autotune

    helper_train_data(data_dir, chars)
    best = autotune.best(study, db)
    _os.environ.update(best.environment())  # the allocator's setting, before CUDA starts
    import torch
    import transformers
    from transformers import AutoTokenizer, Trainer, default_data_collator

    from autotune.specs.models import resolve_model

    spec = resolve_model(best.config.model)
    config = transformers.AutoConfig.for_model(
        spec.config["model_type"], **{k: v for k, v in spec.config.items() if k != "model_type"}
    )
    model = best.load_model(config)
    tokenizer = AutoTokenizer.from_pretrained(Path(data_dir) / "tokenizer")
    ids = tokenizer(Path(data_dir, "corpus.txt").read_text())["input_ids"]
    block = best.block_size
    blocks = [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)]
    dataset = [{"input_ids": b, "labels": b, "attention_mask": [1] * block} for b in blocks]
    args = best.training_arguments(
        output_dir,
        max_steps=steps,
        save_strategy="no",
        logging_steps=max(1, steps // 4),
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    skip = min(10, max(1, steps // 4))

    class StepClock(transformers.TrainerCallback):
        """The wall time at the end of each optimizer step, synchronised only at the first timed
        step and the last (a plain run has no synchronisation in between)."""

        ends: list[tuple[int, float]] = []

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (skip, state.max_steps) and torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append((state.global_step, time.perf_counter()))

    clock = StepClock()
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset, data_collator=default_data_collator, callbacks=[clock]
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    output = trainer.train()
    tokens_per_step = best.config.tokens_per_step
    steady = steady_tokens_per_s(clock.ends, tokens_per_step, skip)
    return {
        "config": best.config.label(),
        "steps": output.global_step,
        "blocks": len(blocks),
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": steady,
        "trainer_tokens_per_s": tokens_per_step * output.global_step / output.metrics["train_runtime"],
        "train_runtime": output.metrics["train_runtime"],
        "final_loss": output.training_loss,
        "args": {
            k: getattr(args, k)
            for k in (
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "bf16",
                "fp16",
                "gradient_checkpointing",
                "optim",
                "tf32",
                "max_grad_norm",
                "lr_scheduler_type",
            )
            if hasattr(args, k)
        },
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None,
    }
