"""`autotune node`: one of the other nodes of a run on several machines. The first node's search
(or probe) starts its ranks for each probe at its rendezvous (`--rendezvous HOST:PORT`); this
node starts its own ranks for the same probe, meeting them there through torchrun's static
rendezvous, and its ranks receive the probe from rank 0 over the process group. Each probe is a
round: this node starts its ranks again for the next one, until stopped (Ctrl-C, SIGTERM).

What a probe measured is the first node's to keep (its ranks gather every rank's result); this node
says each round's outcome on its own ranks. Torch-free, as the runner is: the ranks import torch.

A round waits for the first node's probe at most its rendezvous timeout (torchrun's agent gives up
by itself, and the round starts again: the first node may be between probes). One wait torch does
not bound: a program other than the first node's rendezvous that accepts the agent's connection and
never answers holds it forever; past the timeout (and time for torch's import) the round is stopped
and this node says so in one line.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import time
from collections.abc import Callable

from autotune.probe.rank_main import DEVICE_ENV
from autotune.probe.torchrun import POLL_SECONDS, RENDEZVOUS_SECONDS, RankLaunch, Rendezvous, ranks_started
from autotune.results.probe_result import ProbeResult
from autotune.vocabulary.units import format_size

# A round that ends at once (the first node not there yet, or between probes) is tried again after this.
RETRY_SECONDS = 1.0
# Time a round's agent may take beyond its rendezvous timeout (starting: torch's import; giving up:
# its last attempt to connect) before this node takes it as held by something that never answers.
STARTUP_SECONDS = 60.0
# The agent's last word, when it gave up: `torch.distributed.DistNetworkError: ...` and the like.
_ERROR_LINE = re.compile(r"^[\w.]*(?:Error|Exception): .+$", re.MULTILINE)
_NOBODY_LISTENING = "while trying to connect"  # (the first node between probes, or not started yet)


def serve_node(
    rendezvous: str,
    nodes: int,
    node_rank: int,
    gpus: int,
    device_kind: str,
    echo: Callable[[str], None],
    rounds: int | None = None,
    *,
    rendezvous_timeout: float = RENDEZVOUS_SECONDS,
    warn: Callable[[str], None] | None = None,
) -> None:
    """Run this node's `gpus` ranks for each probe the first node starts, `rounds` times (None:
    until interrupted), each round waiting `rendezvous_timeout` for the first node; `warn` hears a
    round that did not meet it for a reason other than the first node not being there (one line
    each). Every rank is stopped on the way out, however it ends."""
    meeting = Rendezvous(nodes, node_rank, rendezvous, timeout=rendezvous_timeout)
    limit = rendezvous_timeout + min(STARTUP_SECONDS, rendezvous_timeout)
    done = 0
    while rounds is None or done < rounds:
        started = time.monotonic()
        with RankLaunch("autotune-node-") as launch:
            agent = launch.start(
                "autotune.probe.rank_main", gpus, rendezvous=meeting, environment={DEVICE_ENV: device_kind}
            )
            held = not _wait(agent, launch.run_dir, started + limit)
            launch.stop()
            results = _results(launch.run_dir)
            # (a round whose ranks ran and left no result: the first node's probe says why)
            problem = (
                None
                if results or ranks_started(launch.run_dir)
                else _round_problem(meeting, held, limit, launch.run_dir)
            )
        if results:
            done += 1
            echo(_round_line(done, results))
            continue
        if problem is not None and warn is not None:
            warn(problem)
        if time.monotonic() - started < RETRY_SECONDS:
            time.sleep(RETRY_SECONDS)


def _wait(agent: subprocess.Popen, run_dir: str, rendezvous_by: float) -> bool:
    """Wait for the round's agent to end; False if it was still at the rendezvous (no rank of this
    node started) at `rendezvous_by` on the monotonic clock. Once the ranks run, the first node's
    probe says when they end."""
    while agent.poll() is None:
        if ranks_started(run_dir):
            agent.wait()
            break
        if time.monotonic() > rendezvous_by:
            return False
        time.sleep(POLL_SECONDS)
    return True


def _round_problem(meeting: Rendezvous, held: bool, limit: float, run_dir: str) -> str | None:
    """One line for a round that ended without a probe, unless only because the first node was
    not there (between probes, or not started yet)."""
    where = f"node {meeting.node_rank} of {meeting.nodes}"
    if held:
        return (
            f"{where}: torchrun's agent was still waiting for an answer from {meeting.endpoint} after "
            f"{limit:.0f} s: something there accepted its connection and never answered as the first node's "
            f"rendezvous does (another program holding that port?); stopped it, waiting for the first node's "
            f"next probe"
        )
    try:
        with open(os.path.join(run_dir, "torchrun.log"), errors="replace") as source:
            errors = _ERROR_LINE.findall(source.read())
    except OSError:
        return None
    if not errors or _NOBODY_LISTENING in errors[-1]:
        return None
    return (
        f"{where}: the rendezvous at {meeting.endpoint} ended without a probe ({errors[-1][:300]}); waiting for "
        f"the next"
    )


def _results(run_dir: str) -> dict[int, ProbeResult]:
    out = {}
    for name in os.listdir(run_dir):
        if name.startswith("rank-") and name.endswith(".result"):
            with open(os.path.join(run_dir, name), "rb") as source:
                out[int(name[len("rank-") : -len(".result")])] = pickle.load(source)
    return out


def _round_line(number: int, results: dict[int, ProbeResult]) -> str:
    ranks = ", ".join(
        f"rank {rank} {result.status} peak {format_size(result.peak_reserved_bytes)}"
        for rank, result in sorted(results.items())
    )
    return f"probe {number}: {ranks}"
