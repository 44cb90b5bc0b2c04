"""The service's door, in process (FastAPI's TestClient over a real SQLite or PostgreSQL store):
what it takes is the command line's (same fields, same refusals, same lines), who may write, what a
client may name, limits, the queue's idempotency and cancel, answers, and a database that goes
away. The real processes (serve, workers, a search) are in test_service_e2e.py."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from autotune.cli import cli
from autotune.flags.table import SEARCH
from autotune.service.app import ServiceConfig, create_app
from autotune.service.commands import closed_fields, fields
from autotune.service.routes.searches import search_body_schema
from autotune.service.submissions import SEARCH_OWN, ServicePolicy
from autotune.vocabulary.status import SearchState, StudyStatus
from autotune.store import open_store
from tests.helpers.cli import invoke
from tests.helpers.models import write_model_dir
from tests.helpers.processes import alive, parent_of, processes_named
from tests.helpers.store import FakeModel, config, make_study, result

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}


@pytest.fixture
def service(tmp_path):
    """A service over a fresh SQLite database, a model root with a tiny GPT-2, and a token."""
    db = f"sqlite:///{tmp_path / 'service.db'}"
    root = tmp_path / "models"
    write_model_dir(root / "tiny", **TINY)
    with open_store(db) as store:
        token = store.tokens.create("ci")
    app = create_app(ServiceConfig(db=db, policy=ServicePolicy(model_root=root)))
    with TestClient(app) as client:
        client.token, client.db, client.root = token, db, root  # type: ignore[attr-defined]
        yield client


def auth(client) -> dict[str, str]:
    return {"Authorization": f"Bearer {client.token}"}


def body(**changes) -> dict:
    values = {
        "model": "tiny",
        "gpu_budget": "200MiB",
        "device": "cpu",
        "micro_batches": [1, 2],
        "block_sizes": "32",
        "effective_batch": 2,
        "precisions": "fp32",
        "checkpointing": "off",
        "attention": "sdpa",
    }
    values.update(changes)
    return {k: v for k, v in values.items() if v is not None}


def submitted(client) -> list:
    with open_store(client.db) as store:
        return store.queue.all()


# -- one definition: the table both doors are made of ---------------------------------------------


def test_every_search_flag_is_a_field_or_closed_with_a_reason():
    search = cli.commands["search"]
    options = {max(p.opts, key=len).lstrip("-").replace("-", "_") for p in search.params if p.opts}
    taken, closed = set(fields(SEARCH)), closed_fields(SEARCH)
    assert taken | set(closed) == options and not taken & set(closed)
    assert all(closed.values())
    # The OpenAPI body is derived from the same fields, plus the service's own.
    assert set(search_body_schema()["properties"]) == taken | SEARCH_OWN


def test_a_new_search_flag_is_one_row_on_both_doors(monkeypatch):
    """A row added to the table is a flag of `autotune search` and a field of POST /v1/searches,
    read to the same value, with no other change to either door."""
    from autotune.flags import table
    from autotune.flags.flag import Flag, Part, options
    from autotune.flags.values import COUNT
    from autotune.service.commands import read_request

    row = Flag("max_probe_gib", "A made-up flag.", part=Part.SEARCH, type=COUNT)
    monkeypatch.setitem(table.REQUESTS, "search", (*SEARCH, row))
    request, _ = read_request("search", {"model": "gpt2", "gpu_budget": "8GiB", "max_probe_gib": 3})
    assert request.params["max_probe_gib"] == 3 and "--max-probe-gib=3" in request.arguments
    refused = pytest.raises(Exception, match="--max-probe-gib must be a whole number of at least 1")
    with refused:
        read_request("search", {"model": "gpt2", "gpu_budget": "8GiB", "max_probe_gib": 0})
    # The command line's decorator over the same table (as cli/search.py applies it):
    command = click.command("search")(options(table.REQUESTS["search"])(lambda **values: values))
    context = command.make_context("search", ["--model", "gpt2", "--gpu-budget", "8GiB", "--max-probe-gib", "3"])
    assert context.params["max_probe_gib"] == 3 and "--max-probe-gib" in command.get_help(context)


def test_the_doors_parse_with_their_own_commands():
    """The service reads a body with a command made from the table, never the command line's own
    click objects (which it does not import): `plan --help` keeps its `-h` whatever the service read."""
    from autotune.service.commands import read_request

    read_request("plan", {"model": "gpt2", "gpu": "a100"})
    plan = cli.commands["plan"]
    with plan.make_context(
        "plan", ["--model", "gpt2", "--gpu", "a100"], parent=click.Context(cli, **cli.context_settings)
    ) as ctx:
        assert plan.get_help_option(ctx).opts == ["-h", "--help"]


@pytest.mark.slow  # (the command line itself, or a PostgreSQL server)
@pytest.mark.parametrize(
    "changes",
    [
        {"gpu_budget": "lots"},
        {"micro_batches": "0,2"},
        {"precisions": "fp8"},
        {"measure_steps": "-1"},
        {"effective_batch": 3, "micro_batches": [2]},
    ],
)
def test_a_request_the_command_line_refuses_gets_its_line_and_writes_nothing(service, tmp_path, changes):
    answer = service.post("/v1/searches", json=body(**changes), headers=auth(service))
    assert answer.status_code == 422, answer.text
    flags = [
        f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in body(**changes).items()
        if k != "device"
    ]
    flags[0] = f"--model={service.root / 'tiny'}"
    # (The command line's refusal, read in this process: tests/helpers/cli.py's `invoke`.)
    cli_run = invoke("search", *flags, "--device", "cpu", "--db", str(tmp_path / "cli.db"))
    assert cli_run.returncode == 2
    assert answer.json() == {"error": cli_run.stderr.strip().removeprefix("autotune: error: ")}
    assert "Traceback" not in answer.text
    assert submitted(service) == []


def test_fields_the_service_does_not_take_and_malformed_bodies(service):
    refused = {"db": 403, "workers": 403, "no_such_flag": 422}
    for field, status in refused.items():
        answer = service.post("/v1/searches", json=body(**{field: "2"}), headers=auth(service))
        assert answer.status_code == status, answer.text
        assert field in answer.json()["error"]
    for bad in (b"[1, 2]", b"not json", b'"text"', b"null"):
        answer = service.post(
            "/v1/searches", content=bad, headers={**auth(service), "content-type": "application/json"}
        )
        assert (
            answer.status_code == 422
            and "JSON object" in answer.json()["error"]
            or "not JSON" in answer.json()["error"]
        )
    answer = service.post("/v1/searches", json=body(fresh="yes"), headers=auth(service))
    assert answer.status_code == 422 and "true or false" in answer.json()["error"]
    answer = service.post(
        "/v1/searches",
        content=b"{" + b" " * 70_000 + b"}",
        headers={**auth(service), "content-type": "application/json"},
    )
    assert answer.status_code == 413
    assert submitted(service) == []


# -- who may write; what a client may name --------------------------------------------------------


def test_writes_need_a_live_token_and_a_refused_one_writes_nothing(service):
    for headers in ({}, {"Authorization": "Bearer at_not-a-token"}, {"Authorization": "Basic eDp5"}):
        answer = service.post("/v1/searches", json=body(), headers=headers)
        assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
        assert "token" in answer.json()["error"]
    assert service.get("/v1/searches").status_code == 401  # reading is not public unless --public-read
    with open_store(service.db) as store:
        store.tokens.revoke("ci")
    assert service.post("/v1/searches", json=body(), headers=auth(service)).status_code == 401
    assert submitted(service) == []


def test_a_client_names_hub_ids_or_directories_under_the_model_root_only(service, tmp_path, monkeypatch):
    for model in ("/etc", "../models/tiny", "~/x", str(tmp_path)):
        answer = service.post("/v1/searches", json=body(model=model), headers=auth(service))
        assert answer.status_code == 403, (model, answer.text)
        assert "--model-root" in answer.json()["error"]
    # A name that is also a path in the server's working directory is not read from there.
    monkeypatch.chdir(tmp_path)
    write_model_dir(tmp_path / "local-model", **TINY)
    assert service.post("/v1/searches", json=body(model="local-model"), headers=auth(service)).status_code == 403
    answer = service.post("/v1/searches", json=body(model=str(service.root / "tiny")), headers=auth(service))
    assert answer.status_code == 201 and answer.json()["model"] == str(service.root / "tiny")
    answer = service.post("/v1/searches", json=body(trust_remote_code=True), headers=auth(service))
    assert answer.status_code == 403 and "--allow-remote-code" in answer.json()["error"]


# -- the queue: idempotent, cancellable -----------------------------------------------------------


def test_the_same_request_is_the_same_search(service):
    first = service.post("/v1/searches", json=body(), headers=auth(service))
    assert first.status_code == 201 and first.json()["state"] == SearchState.QUEUED
    assert first.json()["name"] == "tiny-200MiB" and first.json()["progress"] == {
        "settled": 0,
        "total": 2,
        "confirming": 0,
        "phase": None,
    }
    reordered = dict(reversed(list(body().items())))
    again = service.post("/v1/searches", json=reordered, headers=auth(service))
    assert again.status_code == 200 and again.json()["name"] == "tiny-200MiB" and again.json()["created"] is False
    # Another request under the same study name while that one waits: refused, not a second search.
    clash = service.post("/v1/searches", json=body(micro_batches=[1]), headers=auth(service))
    assert clash.status_code == 409 and "queued with other settings" in clash.json()["error"]
    keyed = service.post("/v1/searches", json=body(study="keyed"), headers={**auth(service), "Idempotency-Key": "k1"})
    assert keyed.status_code == 201
    reused = service.post("/v1/searches", json=body(study="other"), headers={**auth(service), "Idempotency-Key": "k1"})
    assert reused.status_code == 409 and "Idempotency-Key" in reused.json()["error"]
    assert [s.name for s in submitted(service)] == ["keyed", "tiny-200MiB"]


def test_cancel_a_queued_search_then_resubmit_resumes_it(service):
    service.post("/v1/searches", json=body(), headers=auth(service))
    assert service.post("/v1/searches/tiny-200MiB/cancel").status_code == 401
    answer = service.post("/v1/searches/tiny-200MiB/cancel", headers=auth(service))
    assert answer.status_code == 202 and answer.json()["state"] == SearchState.CANCELLED
    assert "by ci" in answer.json()["reason"]
    again = service.post("/v1/searches", json=body(), headers=auth(service))
    assert again.json()["state"] == SearchState.QUEUED and again.json()["created"] is False
    assert service.post("/v1/searches/nothing-here/cancel", headers=auth(service)).status_code == 404


def test_a_worker_takes_only_what_its_device_serves_and_a_dead_holder_is_taken_over(service):
    from autotune.search.queue_worker import WorkerDevice

    service.post("/v1/searches", json=body(gpu="A10G", device="cuda"), headers=auth(service))
    service.post("/v1/searches", json=body(study="on-cpu"), headers=auth(service))
    cpu = WorkerDevice("cpu", "cpu", "cpu: test", 8 * 2**30, 2, "f")
    h100 = WorkerDevice("cuda", "cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30, 1, "f")
    a10g = WorkerDevice("cuda", "cuda", "NVIDIA A10G", 22 * 2**30, 1, "f")
    with open_store(service.db) as store:
        assert store.queue.take("host-b:1", h100.can_serve) is None  # not an A10G
        taken = store.queue.take("host-a:1", cpu.can_serve)
        assert taken is not None and taken.name == "on-cpu"
        assert store.queue.take("host-c:1", cpu.can_serve) is None  # held, and its holder beats
        assert store.queue.take("host-d:1", a10g.can_serve).name == "tiny-200MiB"
        # A holder on this machine whose process is gone: its search reads interrupted and is taken up.
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        import socket

        with store.db.writing() as session:
            from sqlalchemy import update

            from autotune.store.schema import Search

            session.execute(
                update(Search)
                .where(Search.name == "on-cpu")
                .values(worker=f"{socket.gethostname()}:{dead.stdout.strip()}")
            )
        assert store.queue.get("on-cpu").state == SearchState.INTERRUPTED
        again = store.queue.take("host-e:1", cpu.can_serve)
        assert again is not None and again.name == "on-cpu" and again.attempts == 2


# -- answers --------------------------------------------------------------------------------------


def finished_study(db: str, name: str = "gpt2-8GiB") -> None:
    with open_store(db) as store:
        study = make_study(store, name, model=FakeModel("gpt2"))
        store.record_probe(study.id, config(4), result(tokens_per_s=2000.0), env_fingerprint="e")
        store.record_probe(study.id, config(8), result(tokens_per_s=3000.0), env_fingerprint="e")
        store.set_study_status(study.id, StudyStatus.FINISHED)


@pytest.mark.slow  # (the command line itself, or a PostgreSQL server)
def test_answers_and_best_say_what_the_command_line_says(service):
    missing = service.get(
        "/v1/answers", params={"model": "gpt2", "budget": "8GiB", "gpu": "H100"}, headers=auth(service)
    )
    assert missing.status_code == 404 and "POST /v1/searches" in missing.json()["error"]
    finished_study(service.db)
    found = service.get("/v1/answers", params={"model": "gpt2", "budget": "8GiB", "gpu": "h100"}, headers=auth(service))
    assert found.status_code == 200 and found.json()["study"] == "gpt2-8GiB"
    assert found.json()["best"]["micro_batch"] == 8
    assert (
        service.get("/v1/answers", params={"model": "gpt2", "budget": "16GiB"}, headers=auth(service)).status_code
        == 404
    )
    for fmt in ("json", "trainer-args", "cli", "accelerate", "yaml", "trl"):
        printed = invoke("best", "--study", "gpt2-8GiB", "--format", fmt, "--db", service.db)  # (in this process)
        answer = service.get("/v1/searches/gpt2-8GiB/best", params={"format": fmt}, headers=auth(service))
        assert answer.status_code == 200 and answer.text == printed.stdout, fmt
        # /v1/answers says it the same way, with the notes `best` prints on stderr (it gave none before)
        answered = service.get(
            "/v1/answers", params={"model": "gpt2", "budget": "8GiB", "format": fmt}, headers=auth(service)
        )
        said = [
            line.removeprefix("autotune: ") for line in printed.stderr.splitlines() if line.startswith("autotune: ")
        ]
        assert answered.headers.get("autotune-note", "") == answer.headers.get("autotune-note", ""), fmt
        assert answered.headers["content-type"] == answer.headers["content-type"], fmt
        if fmt == "json":
            assert answered.json()["notes"] == said
        else:
            assert bool(said) == (fmt == "trl")  # (a Trainer study handed to TRL: its warning)
            if said:
                assert answered.headers["autotune-note"].split(" | ")[0] == said[0][:500], fmt
    assert (
        service.get("/v1/searches/gpt2-8GiB/best", params={"format": "xml"}, headers=auth(service)).status_code == 422
    )
    view = service.get("/v1/searches/gpt2-8GiB", headers=auth(service)).json()
    assert view["state"] == SearchState.FINISHED and view["source"] == "command line"
    assert [row["micro_batch"] for row in view["leaderboard"]] == [8, 4]
    assert view["why"].startswith("Chosen: mb8x4")


def test_events_of_a_finished_study_replay_and_resume_after_last_event_id(service):
    finished_study(service.db)
    text = service.get("/v1/searches/gpt2-8GiB/events", headers=auth(service)).text
    ids = [int(line[4:]) for line in text.splitlines() if line.startswith("id: ")]
    data = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and '"line"' in line]
    assert len(ids) == 2 and [d["settled"] for d in data] == [1, 2]
    assert data[0]["line"].startswith("[1/2] mb4x8") and "* best so far" in data[0]["line"]
    assert text.rstrip().splitlines()[-2] == "event: end"
    after = service.get("/v1/searches/gpt2-8GiB/events", headers={**auth(service), "Last-Event-ID": str(ids[0])}).text
    assert [int(line[4:]) for line in after.splitlines() if line.startswith("id: ")] == ids[1:]
    assert '"settled": 2' in after


# -- a database that goes away --------------------------------------------------------------------


@pytest.mark.slow  # (the command line itself, or a PostgreSQL server)
def test_an_unreachable_database_is_a_503_with_one_line(postgres_server, tmp_path):
    import psycopg

    name = "service_outage"
    postgres_server.drop_database(name)
    url = postgres_server.create_database(name)
    with open_store(url, upgrade=True) as store:
        token = store.tokens.create("ci")
    finished_study(url)
    admin = dict(
        host=postgres_server.host, port=postgres_server.port, user="postgres", dbname="postgres", autocommit=True
    )
    with TestClient(create_app(ServiceConfig(db=url))) as client:
        headers = {"Authorization": f"Bearer {token}"}
        assert client.get("/v1/searches/gpt2-8GiB", headers=headers).status_code == 200
        with psycopg.connect(**admin) as conn:
            conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
            conn.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
        try:
            for path in ("/healthz", "/v1/searches/gpt2-8GiB", "/v1/searches"):
                answer = client.get(path, headers=headers)
                assert answer.status_code == 503, (path, answer.text)
                assert "database" in answer.json()["error"] and "Traceback" not in answer.text
        finally:
            with psycopg.connect(**admin) as conn:
                conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
        assert client.get("/healthz").status_code == 200
    postgres_server.drop_database(name)


# -- the commands: serve, token, worker --queue ---------------------------------------------------


@pytest.mark.slow  # (the command line itself)
def test_serve_token_and_queue_worker_refuse_mistakes_in_one_line(tmp_path):
    db = str(tmp_path / "cli.db")

    # Each command as the console script runs it, in this process (`invoke`): what is read is the
    # one line of each refusal, not a second interpreter's start.
    run = invoke

    def refused(done, words: str) -> None:
        assert done.returncode == 2, done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("autotune: error: ") and words in lines[0], done.stderr

    refused(run("serve", "--host", "0.0.0.0", "--db", db), "no token exists")
    refused(run("serve", "--model-root", str(tmp_path / "absent"), "--db", db), "no such directory")
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        refused(run("serve", "--port", str(taken.getsockname()[1]), "--db", db), "cannot listen on")
    made = run("token", "create", "ci", "--db", db)
    assert made.returncode == 0 and made.stdout.strip().startswith("at_") and len(made.stdout.strip()) > 40
    refused(run("token", "create", "ci", "--db", db), "exists already")
    refused(run("token", "create", "bad name!", "--db", db), "not usable")
    refused(run("token", "revoke", "nobody", "--db", db), "no token called")
    listed = run("token", "list", "--db", db)
    assert listed.stdout.startswith("ci\t") and made.stdout.strip() not in listed.stdout
    assert run("token", "revoke", "ci", "--db", db).returncode == 0
    refused(run("worker", "--queue", "--study", "x", "--db", db), "one of them")
    refused(run("worker", "--db", db), "one of them")
    refused(run("worker", "--queue", "--max-trials", "3", "--db", db), "--max-trials")
    refused(run("worker", "--study", "x", "--max-searches", "3", "--db", db), "--max-searches")


@pytest.mark.slow  # (a real service and its workers)
def test_serve_starts_queue_workers_by_a_launcher_and_stops_them_with_it(tmp_path):
    import os
    import signal
    import socket
    import time

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    db = str(tmp_path / "launched.db")
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "autotune",
            "serve",
            "--port",
            str(port),
            "--db",
            db,
            "--workers",
            "1",
            "--launcher",
            "local",
            "--worker-device",
            "cpu",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline, workers = time.monotonic() + 60, []
        while time.monotonic() < deadline and not workers:
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            except httpx.HTTPError:
                pass
            workers = [
                pid for pid in processes_named("worker --queue --device cpu --json") if parent_of(pid) == serve.pid
            ]
            time.sleep(0.3)
        assert len(workers) == 1, "the service started no queue worker"
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=90)
        assert "1 queue worker by local" in serve.stderr.read()
        deadline = time.monotonic() + 10
        while alive(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(workers[0])
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
