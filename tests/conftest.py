"""Shared fixtures. Every test runs hermetically: AUTOTUNE_HOME and AUTOTUNE_DB point into
tmp_path, so nothing touches a user's real data."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from unittest import mock
from pathlib import Path

import pytest

# Two test workers share the machine's cores, and each probe or training step they start would run
# one OpenMP thread per core: threads that spin while the other worker holds their core slow a step
# many times over. One thread each (set before torch is imported here or in any child).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A 2-layer GPT-2, small enough that a CPU probe takes about a second of steps.
TINY_GPT2 = {
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 2,
    "vocab_size": 1024, "n_positions": 256, "n_ctx": 256, "bos_token_id": 0, "eos_token_id": 0,
}


@pytest.fixture(autouse=True)
def hermetic_home(tmp_path, monkeypatch):
    home = tmp_path / "autotune-home"
    home.mkdir()
    monkeypatch.setenv("AUTOTUNE_HOME", str(home))
    monkeypatch.setenv("AUTOTUNE_DB", f"sqlite:///{home / 'autotune.db'}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # tests never reach for the hub
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

    with mock.patch("autotune.probe.runner.ProbeRunner._spawn", refuse), \
            mock.patch("autotune.estimate.launch.TraceChild.start", refuse):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _no_processes_unless_slow(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _no_processes_unless_slow(item):
        yield


def write_model_dir(path: Path, **overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY_GPT2, **overrides}))
    return path


@pytest.fixture
def tiny_model(tmp_path) -> str:
    """A local directory holding only the config.json of a tiny GPT-2."""
    return str(write_model_dir(tmp_path / "tiny-gpt2"))


def cuda_available() -> bool:
    # Ask torch only when a driver is visible: importing torch costs seconds.
    if not (shutil.which("nvidia-smi") or os.path.exists("/proc/driver/nvidia")):
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
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

POSTGRES_BIN = Path(os.environ.get("AUTOTUNE_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


class PostgresServer:
    """A private PostgreSQL server on 127.0.0.1, trusting local connections as `postgres`."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@{self.host}:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new, empty database; returns its SQLAlchemy URL."""
        import psycopg

        with psycopg.connect(host=self.host, port=self.port, user="postgres", dbname="postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(host=self.host, port=self.port, user="postgres", dbname="postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _postgres_unavailable() -> str | None:
    import importlib.util
    import pwd

    for tool in ("initdb", "pg_ctl", "postgres"):
        if not (POSTGRES_BIN / tool).exists():
            return f"PostgreSQL binaries not found in {POSTGRES_BIN} (set AUTOTUNE_TEST_PG_BIN)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
        if not shutil.which("runuser"):
            return "running as root and runuser is missing"
    if importlib.util.find_spec("psycopg") is None:
        return "psycopg is not installed (pip install 'autotune[postgres]')"
    return None


@pytest.fixture(scope="session")
def postgres_server():
    """Start a throwaway PostgreSQL server for the session (skips where none can run).

    PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user, in a
    temporary directory that user owns."""
    import socket
    import subprocess
    import tempfile

    reason = _postgres_unavailable()
    if reason:
        pytest.skip(reason)
    as_postgres: list[str] = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    base = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    if os.geteuid() == 0:
        shutil.chown(base, user="postgres", group="postgres")
    data, log = base / "data", base / "server.log"
    with socket.socket() as probe:  # a free port; the tiny race with other processes is acceptable
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def run(*args: str) -> None:
        subprocess.run([*as_postgres, *args], check=True, capture_output=True, text=True, timeout=120)

    try:
        run(str(POSTGRES_BIN / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
            "--no-sync", "--no-instructions")
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
        subprocess.run([*as_postgres, str(POSTGRES_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=60)
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
