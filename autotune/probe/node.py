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
import time
from collections.abc import Callable

from autotune.probe.rank_main import DEVICE_ENV
from autotune.probe.torchrun import RankLaunch, Rendezvous
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
        started = time.monotonic()
        with RankLaunch("autotune-node-") as launch:
            launch.start("autotune.probe.rank_main", gpus, rendezvous=Rendezvous(nodes, node_rank, rendezvous),
                         environment={DEVICE_ENV: device_kind}).wait()
            launch.stop()
            results = _results(launch.run_dir)
        if results:
            done += 1
            echo(_round_line(done, results))
        elif time.monotonic() - started < RETRY_SECONDS:
            time.sleep(RETRY_SECONDS)


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
