"""Ports for the servers and rendezvous a test starts.

A port found free by binding port 0 is one of the kernel's ephemeral ports, which it hands out
again, to the next process that binds port 0 and as the source port of outgoing connections: in the
time between "found free" and "bound by the server", a process of the other pytest worker (a
torchrun store, a uvicorn server, Ray, PostgreSQL) can take it, and a rendezvous or client then
meets the wrong server. So tests take ports from a block of their own, below the ephemeral range
and above Ray's worker ports (10002-19999), one block per pytest worker, handed out in turn and
checked free by binding."""

from __future__ import annotations

import itertools
import os
import socket

FIRST_PORT = 20_000
PORTS_PER_WORKER = 1_000


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ... (none: one process)
    return int(worker[2:]) if worker[2:].isdigit() else 0


_block = FIRST_PORT + _worker_index() * PORTS_PER_WORKER
# Starting where this process's id points: two test sessions run side by side (a loop beside the
# suite) do not both begin at the block's first port.
_start = os.getpid() % PORTS_PER_WORKER
_next = itertools.cycle([*range(_block + _start, _block + PORTS_PER_WORKER), *range(_block, _block + _start)])


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now and that no other test process will be given."""
    for port in itertools.islice(_next, PORTS_PER_WORKER):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port left in {_block}-{_block + PORTS_PER_WORKER - 1}")
