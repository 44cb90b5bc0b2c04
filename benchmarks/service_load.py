"""`autotune serve` under load: does the service stay quick, lose no event and leave the search's
speed alone while many clients follow one search?

Starts a real `autotune serve --local-worker --worker-device cpu` (a temporary SQLite database, a
token, a tiny GPT-2 under --model-root), submits a small CPU search and times it alone, then submits
the same search again under another study name (`fresh`: probed again, not reused) while CLIENTS
clients (asyncio, httpx) each loop: GET /v1/searches, GET /v1/searches/{name}, then follow
/v1/searches/{name}/events until the `end` event, or for --reconnect seconds before resuming with
Last-Event-ID (as a browser's EventSource resumes a dropped stream; 0: one stream to the end).

Reports the requests served, p50/p99 latency per endpoint (an event stream: time to its headers),
how long an event took from its probe's row to a client, errors (the goal: none), whether every
client's streams saw every probe row the study stored (and the final GET's settled count), and the
search's wall time under load against alone (a ratio). Everything it started is killed at the end,
Ctrl-C included.

    python -m benchmarks.service_load --out benchmarks/results/service-load.json
    python -m benchmarks.service_load --clients 50 --reconnect 0      # one stream per client, to the end
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

TINY_GPT2 = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 2,
    "vocab_size": 1000,
    "n_positions": 128,
}
# 4 micro-batches x 2 block sizes x checkpointing off/on: 16 candidates of a few seconds each on a CPU.
# fresh: each run probes again rather than reuse the last one's results; no prediction first, so that
# neither run gains from traces the other cached.
SEARCH = {
    "model": "tiny-gpt2",
    "gpu_budget": "4GiB",
    "device": "cpu",
    "micro_batches": [1, 2, 4, 8],
    "block_sizes": [32, 64],
    "checkpointing": "off,on",
    "precisions": "fp32",
    "attention": "sdpa",
    "effective_tokens": 512,
    "measure_seconds": 2,
    "fresh": True,
    "predict": False,
}
# One candidate first, so that neither timed run pays for the worker's first probe (imports, caches).
WARMUP = {**SEARCH, "micro_batches": [1], "block_sizes": [32], "checkpointing": "off"}
ENDED = {"finished", "interrupted", "failed", "cancelled"}


# -- the machine and the processes ----------------------------------------------------------------


def machine() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "note": "the machine may be shared: other processes (other agents, other jobs) may have used its cores "
        "during the run",
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (read from /proc), deepest last."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[parent].append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def stop(server: subprocess.Popen) -> None:
    """The server's group, then any of its descendants that lead groups of their own (probes do)."""
    below = descendants(server.pid)
    if server.poll() is None:
        try:
            os.killpg(server.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            pass
    for pid in [server.pid, *below]:
        for kill in (lambda p: os.killpg(p, signal.SIGKILL), lambda p: os.kill(p, signal.SIGKILL)):
            try:
                kill(pid)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        pass


def start_server(tmp: Path, db: str, port: int, env: dict[str, str]) -> subprocess.Popen:
    log = open(tmp / "serve.log", "w")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "autotune",
            "serve",
            "--port",
            str(port),
            "--db",
            db,
            "--local-worker",
            "--worker-device",
            "cpu",
            "--model-root",
            str(tmp / "models"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def make_token(db: str, env: dict[str, str]) -> str:
    made = subprocess.run(
        [sys.executable, "-m", "autotune", "token", "create", "bench", "--db", db],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    match = re.search(r"\bat_[A-Za-z0-9_-]+", made.stdout)
    if match is None:
        raise SystemExit(f"autotune token create printed no token: {made.stdout!r} {made.stderr!r}")
    return match.group(0)


# -- the clients ----------------------------------------------------------------------------------


@dataclass
class Tally:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: list[str] = field(default_factory=list)
    event_delays: list[float] = field(default_factory=list)
    requests: int = 0


async def timed_get(client: httpx.AsyncClient, tally: Tally, endpoint: str, url: str) -> httpx.Response | None:
    started = time.perf_counter()
    try:
        response = await client.get(url)
    except httpx.HTTPError as exc:
        tally.errors.append(f"{endpoint}: {exc.__class__.__name__}: {exc}")
        return None
    tally.latencies[endpoint].append(time.perf_counter() - started)
    tally.requests += 1
    if response.status_code != 200:
        tally.errors.append(f"{endpoint}: {response.status_code} {response.text[:200]}")
    return response


async def follow(
    client: httpx.AsyncClient, tally: Tally, url: str, seen: set[int], last_id: int | None, reconnect: float
) -> tuple[bool, int | None]:
    """One event stream: until `end` (True), or `reconnect` seconds; the last event id read."""
    headers = {"Last-Event-ID": str(last_id)} if last_id is not None else {}
    started = time.perf_counter()
    ends = started + reconnect if reconnect > 0 else float("inf")
    try:
        async with client.stream("GET", url, headers=headers, timeout=httpx.Timeout(30.0, read=60.0)) as response:
            tally.latencies["GET /v1/searches/{name}/events"].append(time.perf_counter() - started)
            tally.requests += 1
            if response.status_code != 200:
                tally.errors.append(f"events: {response.status_code} {(await response.aread())[:200]!r}")
                return False, last_id
            kind, data, event_id = None, [], None
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    kind = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif line.startswith("id:"):
                    event_id = int(line[3:].strip())
                elif line == "":
                    if event_id is not None:  # (the id counts once its event is read: a resume starts after it)
                        last_id = event_id
                    if kind == "probe":
                        event = json.loads("\n".join(data))
                        seen.add(event["id"])
                        finished = datetime.fromisoformat(event["finished_at"]).timestamp()
                        tally.event_delays.append(time.time() - finished)
                    elif kind == "error":
                        tally.errors.append(f"events: error event {''.join(data)[:200]}")
                    elif kind == "end":
                        return True, last_id
                    kind, data, event_id = None, [], None
                if time.perf_counter() > ends and kind is None and not data and event_id is None:
                    return False, last_id
    except httpx.HTTPError as exc:
        tally.errors.append(f"events: {exc.__class__.__name__}: {exc}")
    return False, last_id


async def one_client(
    base: str, token: str, name: str, tally: Tally, reconnect: float, done: asyncio.Event, seen: set[int]
) -> None:
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=httpx.Timeout(30.0)
    ) as client:
        last_id = None
        while True:
            await timed_get(client, tally, "GET /v1/searches", "/v1/searches")
            await timed_get(client, tally, "GET /v1/searches/{name}", f"/v1/searches/{name}")
            ended, last_id = await follow(client, tally, f"/v1/searches/{name}/events", seen, last_id, reconnect)
            if ended:
                return
            if done.is_set() and not ended:
                # The search has ended: one last stream, to the end, reads whatever is left.
                reconnect = 0


async def wait_for(base: str, token: str, name: str, done: asyncio.Event | None = None) -> dict:
    """Poll the search until it ends; its final view."""
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30.0) as client:
        while True:
            view = (await client.get(f"/v1/searches/{name}")).json()
            if view.get("state") in ENDED:
                if done is not None:
                    done.set()
                return view
            await asyncio.sleep(0.5)


async def submit(base: str, token: str, study: str, search: dict = SEARCH) -> tuple[str, float]:
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=60.0) as client:
        answer = await client.post("/v1/searches", json={**search, "study": study})
        if answer.status_code not in (200, 201):
            raise SystemExit(f"the search was refused: {answer.status_code} {answer.text}")
        return answer.json()["name"], time.perf_counter()


async def alone(base: str, token: str, study: str = "service-load-alone", search: dict = SEARCH) -> dict:
    name, started = await submit(base, token, study, search)
    view = await wait_for(base, token, name)
    return {
        "name": name,
        "wall_s": time.perf_counter() - started,
        "state": view["state"],
        "settled": view["progress"]["settled"],
    }


async def under_load(base: str, token: str, clients: int, reconnect: float) -> dict:
    name, started = await submit(base, token, "service-load-loaded")
    tally, done = Tally(), asyncio.Event()
    seen = [set() for _ in range(clients)]
    watcher = asyncio.create_task(wait_for(base, token, name, done))
    followers = [
        asyncio.create_task(one_client(base, token, name, tally, reconnect, done, seen[i])) for i in range(clients)
    ]
    view = await watcher
    wall = time.perf_counter() - started
    try:
        await asyncio.wait_for(asyncio.gather(*followers), 120)
    except TimeoutError:
        tally.errors.append("some clients had not read the end of their stream 120 s after the search ended")
    return {
        "name": name,
        "wall_s": wall,
        "state": view["state"],
        "settled": view["progress"]["settled"],
        "tally": tally,
        "seen": seen,
    }


# -- the run --------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def stored_probes(db: str, name: str) -> dict[int, str]:
    """The study's probe rows: id -> what it was (for a report of any a client missed)."""
    from autotune.store import open_store

    with open_store(db) as store:
        return {
            probe.id: f"{probe.config.label()} {probe.result.status} at {probe.finished_at.isoformat()}"
            for probe in store.probes(name)
        }


def wait_healthy(base: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"autotune serve exited ({server.returncode}):\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"autotune serve did not answer /healthz in 60 s:\n{log.read_text()[-2000:]}")


def summarise(report: dict) -> str:
    load, lone = report["under_load"], report["alone"]
    lines = [
        f"service under load: {report['clients']} clients, reconnect every "
        f"{report['reconnect_s'] or 'never (one stream to the end)'}{' s' if report['reconnect_s'] else ''}",
        f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores (may be shared)",
        f"requests served: {load['requests']}   errors: {len(load['errors'])}",
    ]
    for endpoint, figures in load["latency_ms"].items():
        lines.append(f"  {endpoint:34} n={figures['n']:5}  p50 {figures['p50']:8.1f} ms  p99 {figures['p99']:8.1f} ms")
    delay = load["event_delay_ms"]
    lines.append(
        f"  event delay (probe row -> client)  n={delay['n']:5}  p50 {delay['p50']:8.1f} ms  p99 {delay['p99']:8.1f} ms"
    )
    lines.append(
        f"probes stored: {load['stored_probes']}   final GET settled: {load['settled']}   clients that saw "
        f"every stored probe: {load['clients_complete']}/{report['clients']}"
    )
    lines.append(
        f"search wall time: alone {lone['wall_s']:.1f} s ({lone['state']}, {lone['settled']} settled), under "
        f"load {load['wall_s']:.1f} s ({load['state']}, {load['settled']} settled): x{report['slowdown']:.2f}"
    )
    for error in load["errors"][:10]:
        lines.append(f"  error: {error}")
    return "\n".join(lines)


def run(clients: int, reconnect: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="service-load-") as scratch:
        tmp = Path(scratch)
        (tmp / "models" / "tiny-gpt2").mkdir(parents=True)
        (tmp / "models" / "tiny-gpt2" / "config.json").write_text(json.dumps(TINY_GPT2))
        db = f"sqlite:///{tmp / 'service.db'}"
        env = {**os.environ, "AUTOTUNE_HOME": str(tmp / "home"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        token = make_token(db, env)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        server = start_server(tmp, db, port, env)
        try:
            wait_healthy(base, server, tmp / "serve.log")
            print("warm-up (one candidate) ...", file=sys.stderr, flush=True)
            warmup = asyncio.run(alone(base, token, "service-load-warmup", WARMUP))
            print("search alone ...", file=sys.stderr, flush=True)
            lone = asyncio.run(alone(base, token))
            print(f"  {lone['wall_s']:.1f} s; the same search with {clients} clients ...", file=sys.stderr, flush=True)
            loaded = asyncio.run(under_load(base, token, clients, reconnect))
            stored = stored_probes(db, loaded["name"])
        finally:
            stop(server)
        log_tail = (tmp / "serve.log").read_text()[-3000:]
    tally: Tally = loaded.pop("tally")
    seen: list[set[int]] = loaded.pop("seen")
    latency = {
        endpoint: {"n": len(values), "p50": 1000 * percentile(values, 50), "p99": 1000 * percentile(values, 99)}
        for endpoint, values in sorted(tally.latencies.items())
    }
    missing = [sorted(set(stored) - s) for s in seen]
    under = {
        **loaded,
        "requests": tally.requests,
        "errors": tally.errors,
        "latency_ms": latency,
        "event_delay_ms": {
            "n": len(tally.event_delays),
            "p50": 1000 * (percentile(tally.event_delays, 50) or 0),
            "p99": 1000 * (percentile(tally.event_delays, 99) or 0),
        },
        "stored_probes": len(stored),
        "clients_complete": sum(not m for m in missing),
        "missing_by_client": {i: [stored[p] for p in m] for i, m in enumerate(missing) if m},
    }
    return {
        "machine": machine(),
        "clients": clients,
        "reconnect_s": reconnect,
        "search": SEARCH,
        "warmup": warmup,
        "alone": lone,
        "under_load": under,
        "slowdown": under["wall_s"] / lone["wall_s"],
        "server_log_tail": log_tail,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument(
        "--reconnect",
        type=float,
        default=10.0,
        help="seconds a client follows one stream before resuming it with Last-Event-ID (0: to the end)",
    )
    parser.add_argument("--out", default=None, help="write the figures as JSON to this file")
    options = parser.parse_args()

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # (stop() in run's finally kills what it started)
    started = time.perf_counter()
    report = run(options.clients, options.reconnect)
    report["benchmark_s"] = time.perf_counter() - started
    print(summarise(report))
    if options.out:
        Path(options.out).parent.mkdir(parents=True, exist_ok=True)
        Path(options.out).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
