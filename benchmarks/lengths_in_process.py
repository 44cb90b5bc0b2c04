"""The probe's step against TRL's real step in one process: what separates the leaderboard from the
run once the noise between processes (up to 35% on the 2-core VM) is taken away.

For each config of benchmarks/real_lengths.py's SFT recipe (micro-batches 1, 2, 4, 8 at an effective
batch of 8, padded and padding-free), one fresh process builds the model once and alternates, three
rounds: TRL's SFTTrainer on the long-tailed examples (`packing=False`, or `padding_free=True`), 24
optimizer steps timed after the 8th, real tokens counted at its collator; then the probe's step
(autotune.probe.step.ProbeStep, TRL's loss) on batches drawn from the same examples' lengths, two
whole cycles timed as the probe times them (autotune.results.timing.window_seconds). Each round's real
tokens/s of both, and their ratio; the median of the rounds' ratios.

    python -m benchmarks.lengths_in_process --work DIR [--rounds 3] [--configs 1,2,4,8] [--padding-free]

DIR is a benchmarks/real_lengths.py work directory (its model, tokenizer and examples). CPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.real_lengths import EFFECTIVE_BATCH, SKIP_STEPS, counting

REAL_STEPS = 24


def one_config(work: str, micro_batch: int, padding_free: bool, rounds: int) -> dict:
    """The rounds of one config, in this process."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # (as the probes and the hand-off run: before torch loads)
    import datasets
    import torch
    import transformers
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from autotune.levers.config import ProbeConfig
    from autotune.levers.lengths import Lengths
    from autotune.probe.step import ProbeStep, make_optimizer
    from autotune.results.timing import window_seconds

    root = Path(work)
    hf = transformers.AutoConfig.from_pretrained(root / "model")
    hf.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(root / "data" / "tokenizer")
    tokenizer.pad_token = tokenizer.eos_token
    data = datasets.load_dataset("json", data_files=str(root / "data" / "examples.jsonl"), split="train")
    data = data.remove_columns("label")
    accumulation = EFFECTIVE_BATCH // micro_batch
    counted = {"real": 0, "padded": 0}
    ends: list[tuple[float, int]] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append((time.perf_counter(), counted["real"]))

    def trainer() -> SFTTrainer:
        args = SFTConfig(
            output_dir=str(root / "in-process-out"),
            per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=accumulation,
            max_steps=REAL_STEPS,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            logging_steps=REAL_STEPS,
            use_cpu=True,
            bf16=False,
            packing=False,
            padding_free=padding_free,
            max_length=None if padding_free else 129,
            dataloader_num_workers=0,
        )
        built = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[Clock()])
        built.data_collator = counting(built.data_collator, counted)
        return built

    first = trainer()
    lengths = Lengths.of([len(ids) for ids in first.train_dataset["input_ids"]]).to_text()
    config = ProbeConfig(
        model="in-process",
        micro_batch=micro_batch,
        block_size=129,
        grad_accum=accumulation,
        lengths=lengths,
        trainer="trl",
        padding_free=padding_free,
    )
    out = []
    for index in range(rounds):
        ends.clear()
        (first if index == 0 else trainer()).train()
        (start, real0), (stop, real1) = ends[SKIP_STEPS - 1], ends[-1]
        real = (real1 - real0) / (stop - start)
        step = ProbeStep(model, make_optimizer(model, torch.device("cpu")), config, torch.device("cpu"), hf.vocab_size)
        cycle = config.timing_cycle or 1
        times = []
        for number in range(3):  # (the first cycle warms the step up: timed are the other two)
            step.draw_cycle(number)
            for _ in range(cycle):
                started = time.perf_counter()
                step()
                times.append(time.perf_counter() - started)
        seconds, spread = window_seconds(times[cycle:], cycle)
        probe = config.tokens_per_step / seconds
        out.append(
            {
                "real_tokens_per_s": round(real, 1),
                "probe_tokens_per_s": round(probe, 1),
                "probe_over_real": round(probe / real, 3),
                "probe_spread": spread,
            }
        )
    return {
        "label": config.label().replace("in-process", "").strip(),
        "micro_batch": micro_batch,
        "padding_free": padding_free,
        "rounds": out,
        "probe_over_real": statistics.median(r["probe_over_real"] for r in out),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="a benchmarks/real_lengths.py work directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default="1,2,4,8", help="micro-batches")
    parser.add_argument("--padding-free", action="store_true", help="padding-free configs beside the padded ones")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (a child: 'MB,FLAT')
    args = parser.parse_args(argv)
    if args.one is not None:
        micro_batch, flat = args.one.split(",")
        print(json.dumps(one_config(args.work, int(micro_batch), flat == "1", args.rounds)))
        return 0
    import subprocess

    rows = []
    for micro_batch in (int(m) for m in args.configs.split(",")):
        for flat in (False, True) if args.padding_free else (False,):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.lengths_in_process",
                    "--work",
                    args.work,
                    "--rounds",
                    str(args.rounds),
                    "--one",
                    f"{micro_batch},{int(flat)}",
                ],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-2000:])
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(
                f"{row['label']}: probe / real {row['probe_over_real']:.3f} "
                f"({', '.join(str(r['probe_over_real']) for r in row['rounds'])})",
                file=sys.stderr,
            )
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host_cpus": os.cpu_count(),
        "load_per_core": round(os.getloadavg()[0] / (os.cpu_count() or 1), 2),
        "rounds": args.rounds,
        "real_steps": REAL_STEPS,
        "rows": rows,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
