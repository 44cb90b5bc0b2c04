"""One rank of a run on several GPUs: the process torchrun starts (`-m autotune.train.rank_main`)
for `autotune train` of a multi-rank winner (autotune/train/ranks.py). It trains as a run on one
GPU does (fine_tune.run_rank), on its own device (cuda:LOCAL_RANK, or the CPU), and leaves its end
in the run's directory. A rank that did not finish leaves at once (FAILED_EXIT): torchrun stops
the others, which would otherwise wait for it in a collective."""

from __future__ import annotations

import os
import sys


def main() -> None:
    from autotune.probe.rank_main import FAILED_EXIT, tie_to_agent

    run_dir, rank = tie_to_agent()
    import pickle
    from dataclasses import replace

    from autotune.vocabulary.errors import AutotuneError
    from autotune.train.fine_tune import run_rank
    from autotune.train.ranks import JOB_FILE, RankRecorder

    with open(os.path.join(run_dir, JOB_FILE), "rb") as source:
        job = pickle.load(source)
    options = job.options
    if (options.device or "auto").startswith(("cuda", "auto")):
        import torch

        if torch.cuda.is_available():  # one GPU per rank: this node's share, by LOCAL_RANK
            options = replace(options, device=f"cuda:{os.environ.get('LOCAL_RANK', '0')}")

    def echo(line: str) -> None:
        if rank == 0:  # (every rank says the same: once is enough)
            print(line, file=sys.stderr, flush=True)

    recorder = RankRecorder(run_dir, rank)
    try:
        outcome = run_rank(options, job.study, job.model, job.gpu_budget, job.flags, job.db, recorder, job.run_id, echo)
    except AutotuneError as exc:
        print(f"autotune: rank {rank}: {exc}", file=sys.stderr, flush=True)
        os._exit(FAILED_EXIT)
    except Exception:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(FAILED_EXIT)
    if not outcome.finished:
        sys.stderr.flush()
        os._exit(FAILED_EXIT)  # (no goodbye collective: the other ranks may be waiting in one)


if __name__ == "__main__":
    main()
