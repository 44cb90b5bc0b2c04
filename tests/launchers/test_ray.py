"""`--launcher ray` on a real local Ray cluster: a head and a second node started on loopback (one
CPU each, so that each takes one worker), a tiny CPU search with two workers. Both nodes take
probes (held at a test gate until each holds one, tests/helpers/faults), one killed mid-probe has its
probe retried by the other, the configs that fit are the ones a single worker finds and its pick is
among the fastest, and nothing of the search is left on the cluster; the workers run at the search's
niceness, not at Ray's worker niceness (15); the search SIGTERMed stops its
workers (their claims given back) and leaves no task, saying so in autotune's one line, not Ray's
signal dump, also when the signal comes while ray.init connects; a cluster that is not there is one
line. One cluster for the module."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.search.fleet import WORKER_STOP_GRACE_SECONDS
from autotune.store import open_store
from tests.helpers.cli import invoke, wait_for
from tests.helpers.faults import GATE_ENV, STACKS_ENV, dump_stacks, fault_env
from tests.helpers.models import write_model_dir
from tests.helpers.ports import free_port
from tests.helpers.processes import (
    ancestors,
    command_text,
    descendants,
    marked_pids,
    processes_named,
    signal_state,
)

# (find_spec, not importorskip: importing Ray to collect this module costs every test worker seconds)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="Ray is not installed (pip install 'autotune[ray]')"
    ),
]

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# Token authentication off, said explicitly: where it is not said, Ray turns it on when it finds
# ~/.ray/auth_token (which any local ray.init on the machine writes), and the second node's `ray
# start` was refused by the head started without it: the whole module skipped.
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
CLUSTER_MARKER = "AUTOTUNE_TEST_RAY_CLUSTER"
TERMINATED = "autotune: terminated (SIGTERM); run the same command to resume"
# What Ray's C++ failure signal handler prints (abseil's: "*** SIGTERM received at time=...", then
# "PC: @ ..." and the stack, again through Ray's logging.cc), and Python's own dumps.
DUMPS = ("*** SIG", "received at time=", "PC: @", "logging.cc", "Traceback", "Fatal Python error")


def raylet_of(node: str) -> int:
    """The pid of the raylet of the node started with the custom resource `node`."""
    for pid in processes_named(node):
        if "raylet" in command_text(pid).split(" ")[0]:
            return pid
    raise AssertionError(f"no raylet for {node}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("ray")
    # Each probe the cluster's workers run waits at its first warm-up step while `gate` is missing
    # (tests/helpers/faults: `gate`); open but in the test that closes it.
    gate = base / "gate"
    gate.touch()
    stacks = base / "stacks"  # (each Python process's stacks, written on SIGUSR2: tests/helpers/faults)
    stacks.mkdir()
    # Every process of this cluster carries the marker (Ray's daemons pass their environment on to
    # the workers they start): the cluster is stopped by it. `ray stop` would stop every Ray process
    # on the machine, a user's own cluster among them, and anything else whose command line has
    # a name of Ray's in it (monitor.py, ...).
    env = {**fault_env("gate", ENV), GATE_ENV: str(gate), CLUSTER_MARKER: str(base), STACKS_ENV: str(stacks)}
    port = free_port()
    address = f"127.0.0.1:{port}"
    # Started as a script's background job starts it (`ray start ... &`, nohup): with SIGINT
    # ignored, which every Ray process inherits and which made ray.cancel's Ctrl-C a no-op (the
    # stop's test below). So the suite means the same in a terminal and in the background.
    ignore_sigint = {"preexec_fn": lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    # Without the daemons nothing here uses, each a Python process importing Ray (seconds of CPU at
    # the start, a poll every second after): the autoscaler's monitor (the cluster is what it is)
    # and each node's log monitor (which feeds workers' output to drivers; the search's and the
    # test's drivers do not take it, log_to_driver=False).
    common = [
        "--num-cpus",
        "1",
        "--num-gpus",
        "0",
        "--disable-usage-stats",
        "--node-ip-address",
        "127.0.0.1",
        "--include-log-monitor=false",
    ]
    head_command = [
        *RAY,
        "start",
        "--head",
        "--port",
        str(port),
        "--include-dashboard=false",
        "--no-monitor",
        "--resources",
        '{"autotune_node_a": 1}',
        *common,
    ]
    second_command = [*RAY, "start", "--address", address, "--resources", '{"autotune_node_b": 1}', *common]
    try:
        # The second node starts beside the head rather than after it (the module's setup 2-4 s
        # shorter): it waits for the head's GCS itself (Ray retries for some 20 s). Should it give
        # up first (a machine slow enough), it is started again once the head is up.
        head = subprocess.Popen(
            head_command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **ignore_sigint
        )
        second = subprocess.run(second_command, capture_output=True, text=True, env=env, timeout=180, **ignore_sigint)
        _, head_err = head.communicate(timeout=180)
        if head.returncode != 0:
            pytest.skip(f"a Ray head could not start here: {head_err.strip().splitlines()[-1:]}")
        if second.returncode != 0:
            second = subprocess.run(
                second_command, capture_output=True, text=True, env=env, timeout=180, **ignore_sigint
            )
        if second.returncode != 0:
            pytest.skip(f"a second Ray node could not start here: {second.stderr.strip().splitlines()[-1:]}")
        model = write_model_dir(base / "tiny", **TINY)
        yield {
            "address": address,
            "base": base,
            "model": str(model),
            "gate": gate,
            "stacks": stacks,
            "nodes": {"a": raylet_of("autotune_node_a"), "b": raylet_of("autotune_node_b")},
        }
    finally:
        stop_cluster(base)


def stop_cluster(base: Path) -> None:
    """SIGKILL every process of the cluster at once: the marked ones, and every process below them.
    Ray's agents (ray::DashboardAgent, ray::RuntimeEnvAgent) set their process title over the memory
    that /proc shows as their environment, so the marker does not find them: stopped by the marker
    alone, some outlived every run of the module. SIGTERM first only cost time: the GCS and
    the raylets outlived 3 s of it every time, and nothing of a test cluster needs a graceful stop."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        marked = marked_pids(CLUSTER_MARKER, str(base))
        pids = set(marked).union(*(descendants(pid) for pid in marked))
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    raise AssertionError(f"the test cluster's processes outlived SIGKILL: {marked_pids(CLUSTER_MARKER, str(base))}")


def search_args(cluster, db: Path) -> list[str]:
    return [
        "search",
        "--model",
        cluster["model"],
        "--gpu-budget",
        "200MiB",
        "--device",
        "cpu",
        "--micro-batches",
        "1,2,4",
        "--effective-batch",
        "4",
        "--block-sizes",
        "32",
        "--precisions",
        "fp32",
        "--checkpointing",
        "off",
        "--attention",
        "sdpa",
        "--measure-seconds",
        "0.3",
        "--warmup-steps",
        "2",
        "--measure-steps",
        "2",
        "--no-predict",
        "--no-confirm",
        "--db",
        str(db),
        "--json",
    ]


def search(cluster, db: Path, *extra: str, **popen) -> subprocess.Popen:
    """The search on the cluster, two workers, in a process of its own."""
    command = [
        sys.executable,
        "-m",
        "autotune",
        *search_args(cluster, db),
        "--launcher",
        "ray",
        "--ray-address",
        cluster["address"],
        "--workers",
        "2",
        "--heartbeat",
        "1",
    ]
    return subprocess.Popen(
        [*command, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, "PYTHONUNBUFFERED": "1", STACKS_ENV: str(cluster["stacks"])},
        start_new_session=True,
        **popen,
    )


def stacks_of_the_search(cluster, run: subprocess.Popen) -> str:
    """Where every Python process of the search and of the cluster is (the search, Ray's task
    processes, the workers they started, their probe children): for a stop that did not come. First
    each one's state and signal masks (pending, blocked, ignored, caught: a stop that was sent and
    not taken shows there), one line each, then the stacks."""
    pids = [run.pid] + [
        pid
        for pid in marked_pids(CLUSTER_MARKER, str(cluster["base"]))
        if "python" in command_text(pid) or command_text(pid).startswith("ray::")
    ]
    states = [f"{line}: {command_text(pid)[:100]}" for pid in pids if (line := signal_state(pid)) is not None]
    return "\n".join(states) + "\n\n" + dump_stacks(pids, cluster["stacks"])


def cluster_tasks_left(address: str, study: str) -> list[str]:
    """What is left of `study`'s workers: CPUs the cluster has not got back (a task of ours queued or
    running holds one; nothing else runs on this cluster), and worker processes still alive."""
    code = (
        f"import ray, time\nray.init(address={address!r}, log_to_driver=False, logging_level='ERROR')\n"
        f"deadline = time.monotonic() + 20\n"
        f"while ray.available_resources().get('CPU', 0) < ray.cluster_resources()['CPU'] and time.monotonic() < deadline:\n"
        f"    time.sleep(0.5)\n"
        f"print(ray.cluster_resources()['CPU'] - ray.available_resources().get('CPU', 0))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    held = float(done.stdout.strip().splitlines()[-1])
    left = [f"{held:g} CPUs held"] if held else []
    return left + [command_text(pid) for pid in processes_named(f" worker --study {study} ")]


def node_of(cluster, pid: int) -> str | None:
    up = ancestors(pid)
    return next((name for name, raylet in cluster["nodes"].items() if raylet in up), None)


def test_two_workers_on_two_nodes_pick_what_one_worker_picks_and_a_killed_one_s_probe_is_retried(cluster, warm_child):
    db = cluster["base"] / "ray.db"
    # Probes wait at the gate until each node's worker holds one: then both probe at once, however
    # late one node's worker starts on a busy machine (else the first could settle the space alone).
    # Then one of them is killed (kill -9) mid-probe: its configuration goes to the other worker.
    cluster["gate"].unlink()
    victim = None
    try:
        run = search(cluster, db, "--strategy", "grid")  # (every config that fits measured: the runs compare)
        # While it runs, each probe's worker process is under one node's raylet.
        nodes_seen: set[str] = set()
        priorities: set[int] = set()
        deadline = time.monotonic() + 300
        while victim is None and run.poll() is None and time.monotonic() < deadline:
            workers = {}
            for pid in processes_named(" worker --study tiny-200MiB"):
                if (node := node_of(cluster, pid)) is not None:
                    workers[pid] = node
                    with contextlib.suppress(ProcessLookupError):
                        priorities.add(os.getpriority(os.PRIO_PROCESS, pid))
            nodes_seen |= set(workers.values())
            holders = {int(worker.split(":")[1]) for worker in _probing(db, "tiny-200MiB")}
            if set(workers.values()) == {"a", "b"} and holders == set(workers):
                with open_store(db) as store:
                    held = next(
                        c
                        for c in store.claims.of_study(store.study("tiny-200MiB").id, stale_after=3)
                        if c.state == "running"
                    )
                victim = (int(held.worker.split(":")[1]), held.config_key)
                os.kill(victim[0], signal.SIGKILL)
                cluster["gate"].touch()
            else:
                time.sleep(0.2)
    finally:
        cluster["gate"].touch()
    assert victim is not None, "no worker was seen probing while both nodes ran one"
    # One worker, the same space: the same configs fit (memory is exact on CPU), and each search
    # picks the fastest of what it measured. Which of two close configs is faster is not asked of
    # timings taken beside other processes on two shared cores: the two workers' probes are timed
    # alone or beside each other, which skews them by 2x (--no-confirm: no confirmation round).
    # (In this process, with the test worker's warm probe child: the one-worker search needs no
    # cluster. It runs while the fleet ends, most of which is the other worker waiting for the
    # killed one's claim to go stale.)
    alone = invoke(*search_args(cluster, cluster["base"] / "alone.db"), "--strategy", "grid")
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["workers"] == 2 and summary["status"] == "finished", summary
    assert nodes_seen == {"a", "b"}
    # Not Ray's worker niceness (15): the search's own, or its probes would be timed, and its SIGTERM
    # handled, behind any other work on the node (the other test worker's, here: minutes).
    assert priorities == {os.getpriority(os.PRIO_PROCESS, 0)}
    with open_store(db) as store:
        retried = next(
            c for c in store.claims.of_study(store.study("tiny-200MiB").id, stale_after=3) if c.config_key == victim[1]
        )
        assert retried.state == "done" and retried.attempts == 2
        [row] = [p for p in store.probes("tiny-200MiB") if p.config_key == victim[1]]
        assert row.result.status in ("ok", "oom") and f":{victim[0]}:" not in row.worker
    assert "ray task" in summary["failures"][0] if summary.get("failures") else True
    assert cluster_tasks_left(cluster["address"], "tiny-200MiB") == []
    assert alone.returncode == 0, alone.stderr[-3000:]
    single = json.loads(alone.stdout)
    assert {row["label"] for row in single["leaderboard"]} == {row["label"] for row in summary["leaderboard"]}
    for outcome in (summary, single):
        fastest = max(outcome["leaderboard"], key=lambda row: row["tokens_per_s"])
        assert outcome["best"]["label"] == fastest["label"], outcome


def _probing(db: Path, study: str) -> set[str]:
    """The workers holding a running claim of `study` (none before the study is written)."""
    try:
        with open_store(db) as store:
            return {
                c.worker for c in store.claims.of_study(store.study(study).id, stale_after=3) if c.state == "running"
            }
    except Exception:
        return set()


def test_sigterm_stops_every_worker_within_the_grace_and_leaves_no_task(cluster):
    # The search SIGTERMed while its workers probe (held at the gate, so that a probe is in flight
    # however the machine's load times it): every task of it is cancelled.
    cluster["gate"].unlink()
    try:
        run = search(cluster, cluster["base"] / "term.db", "--study", "term")
        deadline = time.monotonic() + 240
        with_probe = False
        while not with_probe and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                with open_store(cluster["base"] / "term.db") as store:
                    study = store.study("term")
                    with_probe = any(c.state == "running" for c in store.claims.of_study(study.id, stale_after=3))
            except Exception:
                continue
        assert with_probe
        os.killpg(run.pid, signal.SIGTERM)
        stacks = ""
        try:
            _, err = run.communicate(timeout=WORKER_STOP_GRACE_SECONDS - 2)
        except subprocess.TimeoutExpired:
            # Not stopped yet, near the end of the stop's grace (after which Ray's force-cancel kills
            # the workers): where each process is, for the assertion below.
            stacks = stacks_of_the_search(cluster, run)
            _, err = run.communicate(timeout=120)
    finally:
        cluster["gate"].touch()
    # Stopped by the cancel, within the grace: not by the force-cancel after it.
    assert not stacks, f"the search had not stopped {WORKER_STOP_GRACE_SECONDS - 2} s after SIGTERM\n{stacks[:12000]}"
    # Said as the local launcher says it: autotune's line, last, and no signal dump (Ray's handlers
    # taken back after ray.init: test_a_sigterm_while_ray_init_connects_...) nor traceback.
    lines = [line for line in err.splitlines() if line.strip()]
    assert run.returncode == 143 and lines[-1:] == [TERMINATED], err[-3000:]
    assert not [line for line in lines if any(dump in line for dump in DUMPS)], err[-3000:]
    # Each task's worker was stopped as SIGTERM stops it (its claim given back), not killed when
    # the stop's grace ran out: a probe's claim left running would wait out its staleness.
    with open_store(cluster["base"] / "term.db") as store:
        running = [
            c.config_key for c in store.claims.of_study(store.study("term").id, stale_after=3) if c.state == "running"
        ]
    assert running == []
    assert cluster_tasks_left(cluster["address"], "term") == []
    # (Ray ends a cancelled task's worker process by itself, a moment later.)
    wait_for(lambda: processes_named(" worker --study term") == set(), seconds=15, what="the term workers gone")


# `autotune search` (its main, as `python -m autotune` runs it) with ray.init sending this process a
# SIGTERM as it returns: after Ray's SIGTERM handlers are in (its Python handler, sys.exit(15), and its
# C++ failure handler over it, which printed "*** SIGTERM received at time=..." and a stack), before the
# search takes the signal back.
SIGTERM_IN_RAY_INIT = """
import os, signal, sys
import ray
from autotune.cli.app import main
connect = ray.init
def init(*args, **kwargs):
    connected = connect(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    return connected
ray.init = init
sys.argv = ["autotune", *sys.argv[1:]]
main()
"""


def test_a_sigterm_while_ray_init_connects_is_autotune_s_one_line_and_nothing_written(tmp_path, cluster):
    # (Ray's dump and exit status 15, reported once in five SIGTERMs of a search: the signal came
    # between ray.init and the watch that installs the search's own handler.)
    db = tmp_path / "init.db"
    args = [*search_args(cluster, db), "--launcher", "ray", "--ray-address", cluster["address"], "--workers", "2"]
    done = subprocess.run(
        [sys.executable, "-c", SIGTERM_IN_RAY_INIT, *args], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert done.returncode == 143 and done.stderr.strip().splitlines() == [TERMINATED], done.stderr[-3000:]
    assert not db.exists()


def test_no_cluster_at_the_address_is_one_line_and_nothing_written(tmp_path, cluster):
    db = tmp_path / "none.db"
    run = search(cluster, db, "--ray-address", f"127.0.0.1:{free_port()}")
    out, err = run.communicate(timeout=120)
    assert run.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no Ray cluster answers there" in lines[0]
    assert not db.exists()
