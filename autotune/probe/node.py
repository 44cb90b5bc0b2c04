"""`autotune node`: one of the other nodes of a run on several machines. The first node's search
(or probe) starts its ranks for each probe at its rendezvous (`--rendezvous HOST:PORT`); this
node starts its own ranks for the same probe, meeting them there through torchrun's c10d
rendezvous, and its ranks receive the probe from rank 0 over the process group. Each probe is a
round: this node starts its ranks again for the next one, until stopped (Ctrl-C, SIGTERM).

What a probe measured is the first node's to keep (its ranks gather every rank's result); this node
says each round's outcome on its own ranks. Torch-free, as the runner is: the ranks import torch.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable

from autotune.probe.rank_main import DEVICE_ENV
from autotune.probe.torchrun import Rendezvous, start_ranks, stop_ranks
from autotune.result import ProbeResult
from autotune.units import format_size

# A round that ends at once (the first node not there yet, or between probes) is tried again after this.
RETRY_SECONDS = 1.0


def serve_node(rendezvous: str, nodes: int, node_rank: int, gpus: int, device_kind: str,
               echo: Callable[[str], None], rounds: int | None = None) -> None:
    """Run this node's `gpus` ranks for each probe the first node starts, `rounds` times (None:
    until interrupted). Every rank is stopped on the way out, however it ends."""
    done = 0
    while rounds is None or done < rounds:
        run_dir = tempfile.mkdtemp(prefix="autotune-node-")
        agent = None
        started = time.monotonic()
        try:
            with open(os.path.join(run_dir, "torchrun.log"), "wb") as log:
                agent = start_ranks("autotune.probe.rank_main", gpus, run_dir,
                                    rendezvous=Rendezvous(nodes, node_rank, rendezvous),
                                    environment={DEVICE_ENV: device_kind}, output=log)
            agent.wait()
            stop_ranks(agent, run_dir)
            results = _results(run_dir)
            if results:
                done += 1
                echo(_round_line(done, results))
            elif time.monotonic() - started < RETRY_SECONDS:
                time.sleep(RETRY_SECONDS)
        except BaseException:
            if agent is not None:
                stop_ranks(agent, run_dir)
            raise
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)


def _results(run_dir: str) -> dict[int, ProbeResult]:
    out = {}
    for name in os.listdir(run_dir):
        if name.startswith("rank-") and name.endswith(".result"):
            with open(os.path.join(run_dir, name), "rb") as source:
                out[int(name[len("rank-"):-len(".result")])] = pickle.load(source)
    return out


def _round_line(number: int, results: dict[int, ProbeResult]) -> str:
    ranks = ", ".join(f"rank {rank} {result.status} peak {format_size(result.peak_reserved_bytes)}"
                      for rank, result in sorted(results.items()))
    return f"probe {number}: {ranks}"
