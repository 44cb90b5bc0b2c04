"""A PostgreSQL server stopped (`pg_ctl -m immediate`) in the middle of a search: after its retries
the search stops with the database's one line (no second traceback from its cleanup), the study
reads as interrupted, and once the server is back the same command releases the claim left
running, measures what was not stored, and keeps what was. The search is the real command in its
own process; its probes are scripted (tests/helpers/fakes.py), and its retries shortened, so that this
takes seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autotune.vocabulary.status import ClaimState, StudyStatus
from autotune.store import open_store
from tests.helpers.postgres import POSTGRES_BIN

pytestmark = pytest.mark.slow

ARGS = [
    "search",
    "--model",
    "gpt2",
    "--gpu-budget",
    "16GiB",
    "--micro-batches",
    "1,2,4",
    "--block-sizes",
    "64",
    "--effective-batch",
    "4",
    "--precisions",
    "fp32",
    "--checkpointing",
    "off",
    "--attention",
    "sdpa",
    "--no-predict",
    "--no-confirm",
    "--strategy",
    "grid",
    "--device",
    "cpu",
    "--study",
    "dies",
]

# The command line, with the probe runner scripted; the runner stops the server (the command in
# $STOP_SERVER) when asked for its STOP_ON-th probe, and answers it once the server is down.
SCRIPT = textwrap.dedent("""
    import os, shlex, subprocess, sys
    import autotune.probe
    import autotune.store.base
    from dataclasses import replace
    from tests.helpers.fakes import FAKE_ENV, ScriptedRunner

    autotune.store.base.TRANSIENT_RETRY_DELAYS = (0.1, 0.2)  # (46 s of retries in earnest)

    class Runner(ScriptedRunner):
        def __init__(self, settings=None, **kwargs):
            super().__init__(env=replace(FAKE_ENV, device_type="cpu", device_name="Fake CPU"))

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            pass

        def run(self, config, budget, spec=None, deadline=None, timing_only=False, fresh_process=False):
            if len(self.asked) + 1 == int(os.environ.get("STOP_ON", "0")):
                subprocess.run(shlex.split(os.environ["STOP_SERVER"]), check=True, capture_output=True)
            return super().run(config, budget, spec, deadline, timing_only)

    autotune.probe.ProbeRunner = Runner
    from autotune.cli.app import main

    sys.argv = ["autotune", *sys.argv[1:]]
    main()
""")


def _pg_ctl(data: str, *args: str) -> list[str]:
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    return [*as_postgres, str(POSTGRES_BIN / "pg_ctl"), "-D", data, *args]


def _search(url: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, *ARGS, "--db", url],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
        env={**os.environ, **env},
    )


def _claims(url: str) -> list:
    with open_store(url, read_only=True) as store:
        return store.claims.of_study(store.study("dies").id, stale_after=3600)


def test_a_server_stopped_mid_search_gives_one_line_and_a_resumable_study(postgres_server, postgres_url):
    import psycopg

    with psycopg.connect(
        host=postgres_server.host, port=postgres_server.port, user="postgres", dbname="postgres"
    ) as conn:
        data = conn.execute("SHOW data_directory").fetchone()[0]
    log = str(Path(data).parent / "server.log")
    try:
        stopped = _search(
            postgres_url, STOP_ON="2", STOP_SERVER=" ".join(_pg_ctl(data, "-m", "immediate", "-w", "stop"))
        )
    finally:  # (the server is the session's: back for every later test, whatever happened here)
        restart = subprocess.run(_pg_ctl(data, "-l", log, "-w", "-t", "60", "restart"), capture_output=True, text=True)
    assert restart.returncode == 0, restart.stdout + restart.stderr

    lines = stopped.stderr.strip().splitlines()
    assert stopped.returncode == 2 and len(lines) == 1, stopped.stderr
    assert lines[0].startswith("autotune: error: cannot use the results database") and "retries" in lines[0]
    with open_store(postgres_url, read_only=True) as store:
        assert store.study("dies").status == StudyStatus.INTERRUPTED  # (its process is gone)
        before = store.probes("dies")
    assert len(before) == 1

    resumed = _search(postgres_url)
    assert resumed.returncode == 0, resumed.stderr
    with open_store(postgres_url, read_only=True) as store:
        assert store.study("dies").status == StudyStatus.FINISHED
        after = store.probes("dies")
    assert not [c for c in _claims(postgres_url) if c.state == ClaimState.RUNNING]
    assert len(after) == 3 and len({p.config_key for p in after}) == 3
    assert [p.id for p in after if p.config_key == before[0].config_key] == [before[0].id]
