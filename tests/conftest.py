"""Shared fixtures. Every test runs hermetically: AUTOTUNE_HOME and AUTOTUNE_DB point into
tmp_path, so nothing touches a user's real data."""

from __future__ import annotations

import atexit
import contextlib
import getpass
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import pytest

from tests.helpers.faults import HERE as FAULTS_DIR
from tests.helpers.models import cuda_available, write_model_dir
from tests.helpers.ports import free_port
from tests.helpers.postgres import POSTGRES_BIN, PostgresServer, postgres_unavailable

# Two test workers share the machine's cores, and each probe or training step they start would run
# one OpenMP thread per core: threads that spin while the other worker holds their core slow a step
# many times over. One thread each (set before torch is imported here or in any child).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests never reach for the hub. Set once for the session, not per test: a module's fixtures run
# before a test's own, and a fork server started with another environment than a fixture's of the
# moment is not used for its trace child (spawned instead) and is restarted for its probe, killing
# the worker's warm probe child (autotune.host.processes.fork_server_fits).
os.environ["HF_HUB_OFFLINE"] = "1"
# For the same reason, what libraries write into the environment of the process that imports them,
# set from the start: torch's inductor its cache directory (its default, kept), lightning its way of
# telling whether CUDA is there (the NVML's, which it sets on import).
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
)
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
# The compiled probes' C++ kernels without SIMD: inductor's vectorized headers are most of each
# kernel's compile, and a fresh clone's venv misses the cache (its key holds the venv's path). The
# compiled-probe test, cold: 50 s / 63 CPU-s with them, 33 s / 44 without (2026-11-30). What the
# tests ask of a compiled probe (the compile reported apart, the window of compiled steps, the same
# peak and loss as eager) does not depend on how fast its kernels are.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# `datasets`' Arrow cache out of the user's home, one for the test process (it reads the variable
# at import, before any test).
_DATASETS_CACHE = tempfile.mkdtemp(prefix="autotune-tests-datasets-")
atexit.register(shutil.rmtree, _DATASETS_CACHE, ignore_errors=True)
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE
# Every process the tests start can be made to misbehave (tests/helpers/faults: a fault is named in
# the environment of the moment): a probe child forked from the worker's fork server as well, whose
# server started before the test that names one (autotune.host.processes.fork_server_context).
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != FAULTS_DIR:
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (FAULTS_DIR, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(autouse=True)
def _environment_restored():
    """What a test's code writes into this process's environment ends with the test: run in process,
    the CLI's main sets what a command's own process keeps (OpenMP's wait policy, the allocator a
    run measured), which would otherwise differ from what the worker's fork server started with."""
    with mock.patch.dict(os.environ):
        yield


@pytest.fixture(autouse=True)
def hermetic_home(tmp_path, monkeypatch):
    home = tmp_path / "autotune-home"
    home.mkdir()
    monkeypatch.setenv("AUTOTUNE_HOME", str(home))
    monkeypatch.setenv("AUTOTUNE_DB", f"sqlite:///{home / 'autotune.db'}")
    # Two pytest workers already share the cores: a search's estimator traces in one process here
    # (one per core otherwise; the benchmarks measure that).
    monkeypatch.setenv("AUTOTUNE_TRACE_PROCESSES", "1")
    monkeypatch.delenv("AUTOTUNE_INJECT_FAULT", raising=False)
    return home


@contextlib.contextmanager
def _no_processes_unless_slow(item):
    """`slow` is what `make test-fast` leaves out: tests that start probe children or estimator
    children (seconds each). A test without the mark that starts one, in its body or in any of its
    fixtures, fails here, so the mark cannot drift from what the test does."""
    if item.get_closest_marker("slow") is not None:
        yield
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{item.nodeid} starts a probe or estimator process: mark it @pytest.mark.slow")

    with (
        mock.patch("autotune.probe.runner.ProbeRunner._spawn", refuse),
        mock.patch("autotune.estimate.launch.TraceChild.start", refuse),
    ):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _no_processes_unless_slow(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _no_processes_unless_slow(item):
        yield


@pytest.fixture(scope="session")
def probe_runner():
    """`probe_runner(settings)`: this test worker's one warm probe child, seen with those settings
    (tests/helpers/runners.py). Its child starts at the first probe."""
    from tests.helpers.runners import SharedRunner

    shared = SharedRunner()
    yield shared
    shared.close()


@pytest.fixture
def warm_child(probe_runner):
    """The commands this test runs in this process (`invoke`: `search`, `probe`) probe with the
    worker's warm child (tests/helpers/runners.py: commands_probe_with)."""
    from tests.helpers.runners import commands_probe_with

    with commands_probe_with(probe_runner):
        yield


@pytest.fixture
def spawned_children(monkeypatch):
    """Probe children spawned afresh, as on a CUDA host, where a CPU runner forks them from its
    warm server (autotune.host.processes.fork_server_context): for the tests of the standby child, the
    CUDA path's answer to a fresh child's seconds of imports."""
    import multiprocessing as mp

    monkeypatch.setattr("autotune.probe.runner.fork_server_context", lambda cuda_possible: mp.get_context("spawn"))


@pytest.fixture(scope="session")
def trace_children():
    """This test worker's trace child, warm from one estimate to the next (a trace child answers
    request after request, as a search's later groups find it). It starts at the first trace."""
    from autotune.estimate.launch import TraceChildren

    with TraceChildren(1) as children:
        yield children


@pytest.fixture
def store(hermetic_home):
    """The default results database (in this test's hermetic home), open."""
    from autotune.store import open_store

    with open_store() as opened:
        yield opened


@pytest.fixture
def work(tmp_path, monkeypatch, hermetic_home):
    """A working directory holding a results database with one study (and an ok probe), also the
    default database ($AUTOTUNE_DB), so that a mistake that falls back to the default shows."""
    folder = tmp_path / "work"
    folder.mkdir()
    db = hermetic_home / "autotune.db"
    from autotune.store import open_store
    from tests.helpers.store import ENV, config, make_study, result

    with open_store(db) as store:
        study = make_study(store, "s1")
        store.record_probe(study.id, config(4), result(), env_fingerprint=ENV.fingerprint())
    monkeypatch.chdir(folder)
    return folder


@pytest.fixture
def tiny_model(tmp_path) -> str:
    """A local directory holding only the config.json of a tiny GPT-2."""
    return str(write_model_dir(tmp_path / "tiny-gpt2"))


def _freeze_what_is_held() -> None:
    # A test worker holds torch, transformers and the test modules (some 10^6 objects) for the whole
    # session, and Python's cyclic collector went over them again and again: a third of a worker's
    # CPU on two model-building modules (16.2 of 52.4 s; 3.9 of 39.4 s with these hooks). Frozen
    # once collected, they are out of every later collection.
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    _freeze_what_is_held()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    # The same at each module's end, after its fixtures are gone: what the next module keeps
    # alive for long (its fixtures, the modules it imports) is not gone over by every collection.
    # (Not after each test: a module fixture frozen while alive would never be collected after.)
    if nextitem is None or nextitem.module is not item.module:
        _freeze_what_is_held()


def pytest_collection_modifyitems(config, items):
    _check_gpu_marks(items)
    _heaviest_first(items)


# Seconds each module took in a whole run on the 2-core development machine (tests/conftest.py
# writes the file anew with `pytest --record-module-seconds tests/module_seconds.json`): the order
# the workers take modules in. A module not in it counts as SLOW_MODULE_SECONDS if it starts
# processes, else as nothing.
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
SLOW_MODULE_SECONDS = 20.0


def _heaviest_first(items) -> None:
    """The longest modules first, each module's tests in their order: a worker that took a long
    module last would run it alone while the other waits. (make test hands out whole modules,
    --dist loadfile, so that a module's fixtures are made once, and --no-loadscope-reorder keeps
    this order; xdist's loadgroup, which would spread the other tests one by one, renames node ids
    in a way pytest 9.2 no longer reads, and groups nothing.)"""
    import json

    recorded = json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.exists() else {}
    slow = {_module_of(item) for item in items if item.get_closest_marker("slow") is not None}
    first_seen = {_module_of(item): index for index, item in reversed(list(enumerate(items)))}

    def cost(module: str) -> float:
        return recorded.get(module, SLOW_MODULE_SECONDS if module in slow else 0.0)

    items.sort(key=lambda item: (-cost(_module_of(item)), first_seen[_module_of(item)]))


def _module_of(item) -> str:
    return item.nodeid.split("::")[0]


def pytest_addoption(parser):
    parser.addoption(
        "--record-module-seconds",
        metavar="FILE",
        default=None,
        help="write each test module's seconds (setup, call and teardown of its tests) to FILE as JSON",
    )


_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # (On the controller under xdist: it receives every worker's reports.)
    module = report.nodeid.split("::")[0].split("@")[0]
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_sessionfinish(session):
    target = session.config.getoption("--record-module-seconds")
    if target and not hasattr(session.config, "workerinput"):
        import json

        ordered = dict(sorted(((m, round(s, 1)) for m, s in _module_seconds.items()), key=lambda pair: -pair[1]))
        Path(target).write_text(json.dumps(ordered, indent=1) + "\n")


def _check_gpu_marks(items) -> None:
    # A GPU test starts probe or training processes; unmarked `slow`, it would be refused when it
    # runs (see _no_processes_unless_slow), which a machine without CUDA never shows: say it here.
    unmarked = [item.nodeid for item in items if "gpu" in item.keywords and "slow" not in item.keywords]
    if unmarked:
        raise pytest.UsageError(f"GPU tests must also be marked slow: {', '.join(unmarked)}")
    if any("gpu" in item.keywords for item in items) and not cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# -- PostgreSQL: a throwaway server for store tests (and later the distributed search) ---------------


@pytest.fixture(scope="session")
def postgres_server():
    """Start a throwaway PostgreSQL server for the session (skips where none can run).

    PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user, in a
    temporary directory that user owns."""
    import subprocess
    import tempfile

    reason = postgres_unavailable()
    if reason:
        pytest.skip(reason)
    as_postgres: list[str] = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    base = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    if os.geteuid() == 0:
        shutil.chown(base, user="postgres", group="postgres")
    data, log = base / "data", base / "server.log"
    port = free_port()

    def run(*args: str) -> None:
        subprocess.run([*as_postgres, *args], check=True, capture_output=True, text=True, timeout=120)

    try:
        run(
            str(POSTGRES_BIN / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        )
        # Durability off: this server lives for one test session.
        options = f"-h 127.0.0.1 -p {port} -k {base} -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        run(str(POSTGRES_BIN / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start")
    except subprocess.CalledProcessError as exc:
        server_log = log.read_text() if log.exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        pytest.fail(f"could not start PostgreSQL: {exc.stderr or exc.stdout}\n{server_log}")
    try:
        yield PostgresServer("127.0.0.1", port)
    finally:
        subprocess.run(
            [*as_postgres, str(POSTGRES_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server, request):
    """A fresh, empty PostgreSQL database for one test, as a postgresql+psycopg:// URL."""
    import re
    import uuid

    name = re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())[:40] + "_" + uuid.uuid4().hex[:8]
    url = postgres_server.create_database(name)
    yield url
    postgres_server.drop_database(name)
