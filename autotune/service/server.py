"""`autotune serve`: the application under uvicorn, checked before it listens (a database it can
use, tokens before any address but loopback), with a queue worker of its own where asked
(`--local-worker`: one command and it answers). The local worker dies with the service, kill -9
included; the search it ran is resumed by the next worker."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

from autotune.vocabulary.errors import BadInput, quoted
from autotune.launchers.base import Launcher, WorkerSpec
from autotune.vocabulary.devices import worker_kind
from autotune.service.guard import allowed_hosts, is_loopback
from autotune.service.submissions import ServicePolicy

# A queue worker stopped with the service has this long to put its search back in the queue.
STOP_GRACE_SECONDS = 70.0


def check_serving(host: str, port: int, model_root: str | None) -> Path | None:
    """The flags, refused in one line where they cannot be served; returns the model root."""
    if not 0 < port < 65536:
        raise BadInput(f"--port {port}: give a port from 1 to 65535.")
    if not re.fullmatch(r"[A-Za-z0-9._:\[\]-]{1,253}", host, re.ASCII):
        raise BadInput(f"--host {quoted(host)} is not an address or a host name (e.g. 127.0.0.1, 0.0.0.0, ::1).")
    root = None
    if model_root is not None:
        if not model_root.strip():
            raise BadInput(
                "--model-root is empty; give the directory under which clients may name local models, "
                "or leave it out (hub ids only)."
            )
        try:
            root = Path(model_root).expanduser().resolve()
            usable = root.is_dir()
        except (OSError, ValueError):  # (a name past the file system's limits, a NUL)
            usable = False
        if not usable:
            raise BadInput(
                f"--model-root {model_root[:80]!r}: no such directory; give the directory under which clients may "
                f"name local models, data sets and tokenizers."
            )
    return root


def serve(
    *,
    host: str,
    port: int,
    db: str | None,
    local_worker: bool,
    worker_device: str,
    public_read: bool,
    model_root: str | None,
    allow_remote_code: bool,
    hosts: tuple[str, ...] = (),
    say=print,
    workers: int | None = None,
    launcher: Launcher | None = None,
) -> None:
    """Serve until SIGTERM or Ctrl-C. `workers` queue workers are started by `launcher` (Ray tasks,
    a Slurm job array, or this machine's processes) and stopped with the service."""
    from autotune.service.app import ServiceConfig, create_app
    from autotune.store import open_store
    from autotune.store.engine import check_service_database

    try:
        import fastapi  # noqa: F401
        import jinja2  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise BadInput(
            f"autotune serve needs FastAPI, uvicorn and Jinja2 ({exc.name} is missing): pip install 'autotune[service]'."
        ) from None
    root = check_serving(host, port, model_root)
    if launcher is not None and not workers:
        raise BadInput(f"--launcher {launcher.name} starts the service's queue workers: give --workers N too.")
    check_service_database(db)
    guarded = is_loopback(host)
    if not guarded and _no_database_yet(db):  # (refused before the database would be created)
        raise BadInput(_NO_TOKEN.format(host=host))
    _check_port_free(host, port)
    with open_store(db) as store:  # (creates or upgrades the embedded database, as search does)
        url = store.engine.url.render_as_string(hide_password=False)
        shown = store.url
        has_tokens = store.tokens.any()
    if not guarded and not has_tokens:
        raise BadInput(_NO_TOKEN.format(host=host))
    config = ServiceConfig(
        db=url,
        policy=ServicePolicy(root, allow_remote_code),
        public_read=public_read,
        allowed_hosts=allowed_hosts(host, hosts),
    )
    app = create_app(config)
    spec = WorkerSpec(None, url, worker_kind(worker_device))
    if workers and launcher is None:
        from autotune.launchers.local import LocalLauncher
        from autotune.search.fleet import worker_devices

        launcher = LocalLauncher(worker_devices(workers, worker_device))
    if workers and launcher is not None:
        launcher.check(workers, spec)
    worker = _start_local_worker(url, worker_device) if local_worker else None
    if workers and launcher is not None:
        launcher.start(workers, spec)
    reads = "open to all" if public_read else "with a token"
    started = (
        f"; {workers} queue worker{'s' if workers != 1 else ''} by {launcher.name}" if workers and launcher else ""
    )
    say(
        f"autotune serve: http://{host}:{port}/ (database {shown}; reads {reads}, writes with a token"
        f"{'; no tokens yet: autotune token create NAME' if not has_tokens else ''}"
        f"{f'; local worker pid {worker.pid}' if worker else ''}{started})"
    )
    try:
        listen(app, host, port)
    finally:
        if worker is not None:
            _stop(worker)
        if workers and launcher is not None:
            launcher.stop(grace=STOP_GRACE_SECONDS)


_NO_TOKEN = (
    "--host {host} listens beyond this machine, and no token exists to guard it; make one first "
    "(autotune token create NAME --db ...), or listen on 127.0.0.1."
)


def _no_database_yet(db: str | None) -> bool:
    """A SQLite database not made yet (so no token in it either)."""
    from autotune.store.engine import resolve_url, sqlite_path

    path = sqlite_path(resolve_url(db))
    return path is not None and not path.exists()


def listen(app, host: str, port: int) -> None:
    """Serve `app` until SIGTERM or Ctrl-C (uvicorn's own handlers: requests in flight are finished)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise BadInput(
                f"cannot listen on {host}:{port}: {exc.strerror}; give another --port (or --host)."
            ) from None


def _start_local_worker(db_url: str, device: str) -> subprocess.Popen:
    from autotune.host.processes import kill_me_with_parent

    return subprocess.Popen(
        [sys.executable, "-m", "autotune", "worker", "--queue", "--db", db_url, "--device", device],
        stdin=subprocess.DEVNULL,
        preexec_fn=kill_me_with_parent,
    )


def _stop(worker: subprocess.Popen) -> None:
    """The local worker stops as SIGTERM stops it: its search put back in the queue."""
    if worker.poll() is None:
        worker.terminate()
        try:
            worker.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
