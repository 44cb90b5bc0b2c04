"""The service for real: an `autotune serve` process and `autotune worker --queue` processes on
loopback, over one SQLite database, running tiny CPU searches submitted over HTTP with a token. A
pipeline submits, follows the events to the end and builds a real TrainingArguments from the
answer; a client cancels a running search and resubmits it; a worker is killed mid-search and
another takes its search over; the service is killed mid-search and the worker finishes anyway.
One deployment for the module (a service and a worker are started once), and one HTTP client and
one handle on the database for this process (a client per request loaded its TLS certificates, a
tenth of a second of CPU each time; a store opened per poll checked the schema, a hundredth)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from autotune.vocabulary.status import SearchState  # noqa: E402
from autotune.store import open_store  # noqa: E402
from tests.helpers.cli import invoke  # noqa: E402
from tests.helpers.plans import LONG_PLAN  # noqa: E402
from tests.helpers.faults import GATE_ENV, fault_env  # noqa: E402
from tests.helpers.models import write_model_dir  # noqa: E402
from tests.helpers.ports import free_port  # noqa: E402
from tests.helpers.processes import command_text, processes_named  # noqa: E402

pytestmark = pytest.mark.slow

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}


class Deployment:
    """A service and its workers, each the leader of its own process group (killed whole at the end)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.db = f"sqlite:///{base / 'service.db'}"
        self.root = base / "models"
        write_model_dir(self.root / "tiny", **TINY)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # (the command line, in this process: the token is the setup, not the subject)
        created = invoke("token", "create", "pipeline", "--db", self.db)
        assert created.returncode == 0, created.stderr
        self.token = created.stdout.strip()
        # Every request of this module: a connection of its own each (none kept alive), as a client
        # per request had, without one TLS context per request.
        self.http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
        self.store = open_store(self.db)  # (each read is a session of its own: it sees what others wrote)
        self.processes: dict[str, subprocess.Popen] = {}
        # Its own estimate cache and data directory: what it answers from the cache, it traced itself;
        # its own temporary directory: what a worker leaves there is seen.
        (base / "home").mkdir()
        (base / "tmp").mkdir()
        # The second probe of every probe process waits at its first step while the file `gate` is
        # missing (tests/helpers/faults): it is there, except while a test holds a search mid-probe.
        self.gate = base / "gate"
        self.gate.touch()
        self.env = {
            **fault_env("gate", on_probe=2),
            GATE_ENV: str(self.gate),
            "PYTHONUNBUFFERED": "1",
            "AUTOTUNE_HOME": str(base / "home"),
            "TMPDIR": str(base / "tmp"),
            # One trace process per plan or estimate, as tests/conftest.py has it for every test (two
            # pytest workers share the cores); this module's fixture is made before that fixture runs.
            "AUTOTUNE_TRACE_PROCESSES": "1",
        }

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.base / f"{name}.log", "a")
        process = subprocess.Popen(
            [sys.executable, "-m", "autotune", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=self.env,
            cwd=self.base,
        )
        self.processes[name] = process
        return process

    def start_service(self) -> None:
        self.start("serve", "serve", "--port", str(self.port), "--db", self.db, "--model-root", str(self.root))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if self.http.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError(f"the service did not answer: {(self.base / 'serve.log').read_text()}")

    def start_worker(self, name: str) -> subprocess.Popen:
        return self.start(name, "worker", "--queue", "--device", "cpu", "--db", self.db)

    def kill(self, name: str, signum: int = signal.SIGKILL) -> None:
        process = self.processes.pop(name)
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass
        process.wait(timeout=90)

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.kill(name)
        self.http.close()
        self.store.close()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def submit(self, **changes) -> httpx.Response:
        return self.http.post(f"{self.url}/v1/searches", json=search_body(**changes), headers=self.headers, timeout=30)

    def view(self, name: str) -> dict:
        answer = self.http.get(f"{self.url}/v1/searches/{name}", headers=self.headers, timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def row(self, name: str):
        return self.store.queue.get(name)

    def wait(self, name: str, test, what: str, seconds: float = 150.0):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            row = self.row(name)
            if test(row):
                return row
            time.sleep(0.3)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.base.glob("*.log")))
        raise AssertionError(f"{name}: {what} not seen in {seconds} s (last: {row}):\n{logs}")


def search_body(**changes) -> dict:
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
        "measure_seconds": "0.05",  # (a few steps: what is measured here is the service, not a speed)
        "warmup_steps": 2,
        "measure_steps": 2,
        "predict": False,
        "confirm": False,
    }
    values.update(changes)
    return {k: v for k, v in values.items() if v is not None}


def processes_under(path: Path) -> list[str]:
    """Command lines of live processes that name `path` (what this module's deployment started)."""
    return [command_text(pid) for pid in processes_named(str(path)) if pid != os.getpid()]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    deployed = Deployment(tmp_path_factory.mktemp("service"))
    deployed.start_service()
    deployed.start_worker("worker-a")
    yield deployed
    deployed.stop_all()
    deadline = time.monotonic() + 10
    while processes_under(deployed.base) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_under(deployed.base) == []  # every process the deployment's commands started is gone


def follow(deployment: Deployment, name: str, seconds: float = 180.0) -> list[tuple[str, dict]]:
    """Read the search's event stream to its `end`: (event, data) pairs."""
    events, kind = [], None
    with deployment.http.stream(
        "GET",
        f"{deployment.url}/v1/searches/{name}/events",
        headers=deployment.headers,
        timeout=httpx.Timeout(seconds, connect=10),
    ) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
                if kind in ("end", "error"):
                    break
    return events


def test_a_pipeline_submits_follows_and_trains_with_the_answer(deployment):
    # Without a token: refused, and nothing is written.
    refused = deployment.http.post(f"{deployment.url}/v1/searches", json=search_body(), timeout=30)
    assert refused.status_code == 401
    with open_store(deployment.db) as store:
        assert store.queue.all() == []
    submitted = deployment.submit()
    assert submitted.status_code == 201, submitted.text
    name = submitted.json()["name"]
    assert submitted.headers["location"] == f"/v1/searches/{name}"
    events = follow(deployment, name)
    probes = [data for kind, data in events if kind == "probe"]
    assert events[-1][0] == "end" and events[-1][1]["state"] == SearchState.FINISHED
    deployment.wait(name, lambda row: row.state == SearchState.FINISHED, "the worker's record of the end")
    assert list((deployment.base / "tmp").glob("autotune-queue-*")) == []  # (the child's directory went with it)
    assert sorted(p["settled"] for p in probes) == [1, 2] and {p["total"] for p in probes} == {2}
    assert all(p["line"].startswith(f"[{p['settled']}/2] ") for p in probes)
    view = deployment.view(name)
    assert view["state"] == SearchState.FINISHED and view["progress"]["settled"] == view["progress"]["total"] == 2
    # (the confirmation round's windows beside them, as its stored decision counts them)
    assert view["progress"]["confirming"] == ((view["confirmation"] or {}).get("probes") or 0)
    assert view["best"]["label"] == view["leaderboard"][0]["label"] and view["why"].startswith("Chosen: ")
    # The answer, fed into a real TrainingArguments, as a pipeline would.
    answer = deployment.http.get(
        f"{deployment.url}/v1/searches/{name}/best",
        params={"format": "trainer-args"},
        headers=deployment.headers,
        timeout=30,
    )
    document = answer.json()
    from transformers import TrainingArguments

    arguments = TrainingArguments(output_dir=str(deployment.base / "run"), **document["training_arguments"])
    assert arguments.per_device_train_batch_size == view["best"]["micro_batch"]
    assert arguments.gradient_accumulation_steps == view["best"]["grad_accum"]
    # The same request again: the same search, answered, not a second one.
    again = deployment.submit()
    assert again.status_code == 200 and again.json()["name"] == name and again.json()["state"] == SearchState.FINISHED
    with open_store(deployment.db) as store:
        assert [s.name for s in store.queue.all()] == [name]
        assert store.queue.get(name).attempts == 1
    # The command line reads the same study, unchanged (run in this process: the database is the subject).
    board = invoke("leaderboard", "--study", name, "--format", "json", "--db", deployment.db)
    assert board.returncode == 0, board.stderr
    assert [row["label"] for row in json.loads(board.stdout)] == [row["label"] for row in view["leaderboard"]]
    printed = invoke("best", "--study", name, "--format", "trainer-args", "--db", deployment.db)
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout) == document


def test_predictions_need_no_gpu_and_refuse_as_the_command_line_does(deployment):
    # (a config no search of this module traced: the estimate cache is keyed by the architecture)
    body = {"model": "tiny", "micro_batch": 3, "block_size": 24}
    answer = deployment.http.post(f"{deployment.url}/v1/estimate", json=body, headers=deployment.headers, timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.json()["peak_bytes"] > 0 and set(answer.json()["breakdown"]) >= {"params", "grads", "optimizer"}
    assert answer.json()["cached"] is False
    again = deployment.http.post(f"{deployment.url}/v1/estimate", json=body, headers=deployment.headers, timeout=300)
    assert again.json()["peak_bytes"] == answer.json()["peak_bytes"]
    assert again.json()["cached"] is True  # (answered from the estimate cache: no trace)
    refused = deployment.http.post(
        f"{deployment.url}/v1/plan",
        json={"model": "tiny", "gpu": "no-such-card"},
        headers=deployment.headers,
        timeout=60,
    )
    assert refused.status_code == 422 and "no-such-card" in refused.json()["error"]
    assert deployment.http.post(f"{deployment.url}/v1/estimate", json=body, timeout=30).status_code == 401


def test_a_plan_its_client_abandoned_is_stopped_and_frees_its_slot(deployment):
    # A long plan (every config traced, no cache), its client gone after 2 s: before, the child
    # traced on for nobody, holding the service's one prediction slot to its end.
    body = LONG_PLAN
    with pytest.raises(httpx.TimeoutException):
        deployment.http.post(f"{deployment.url}/v1/plan", json=body, headers=deployment.headers, timeout=2)
    deadline = time.monotonic() + 10
    while any(" plan " in command for command in processes_under(deployment.base)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [command for command in processes_under(deployment.base) if " plan " in command]
    # Its slot is free: the next plan is answered (a refusal, quickly), not kept waiting for a slot
    # (30 s, then 503).
    refused = deployment.http.post(
        f"{deployment.url}/v1/plan",
        json={"model": "tiny", "gpu": "no-such-card"},
        headers=deployment.headers,
        timeout=25,
    )
    assert refused.status_code == 422, refused.text


def test_a_plan_in_flight_dies_with_the_service(deployment):
    # Past the service's wait (10 s) the plan is answered 202 and goes on as a job; the service is then
    # killed -9 (its process alone, not its group): its plan child and that child's traces go with it.
    body = {
        "model": "tiny",
        "gpu": "a100,h100",
        "gpus": "1,2",
        "tokens": "10M",
        "micro_batches": "1,2,3,4,5,6,7,8",
        "block_sizes": "16,24,32,48,64",
        "exact": True,
        "no_cache": True,
    }
    accepted = deployment.http.post(f"{deployment.url}/v1/plan", json=body, headers=deployment.headers, timeout=60)
    assert accepted.status_code == 202, accepted.text
    location = accepted.headers["location"]
    assert deployment.http.get(f"{deployment.url}{location}", headers=deployment.headers, timeout=30).status_code == 202
    assert [command for command in processes_under(deployment.base) if " plan " in command]
    serve = deployment.processes.pop("serve")
    os.kill(serve.pid, signal.SIGKILL)
    serve.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(" plan " in command for command in processes_under(deployment.base)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [command for command in processes_under(deployment.base) if " plan " in command]
    # A service started again knows no plan of the one before: said as for any plan it does not know.
    deployment.start_service()
    gone = deployment.http.get(f"{deployment.url}{location}", headers=deployment.headers, timeout=30)
    assert gone.status_code == 404 and "no plan" in gone.json()["error"]


def test_a_cancelled_search_stops_its_probe_and_resumes_when_submitted_again(deployment):
    # The cancel comes mid-search, whatever the machine's speed: the search's second probe waits at
    # its first step until the gate is back.
    body = dict(study="cancel-me", micro_batches=[1, 2, 4], effective_batch=4)
    deployment.gate.unlink()
    try:
        assert deployment.submit(**body).status_code == 201
        with open_store(deployment.db) as store:
            deadline = time.monotonic() + 120
            while not store.queue.settled_counts(["cancel-me"]) and time.monotonic() < deadline:
                time.sleep(0.3)
            settled_before = store.queue.settled_counts(["cancel-me"]).get("cancel-me", 0)
        assert settled_before == 1 and deployment.row("cancel-me").state == SearchState.RUNNING
        cancelled = deployment.http.post(
            f"{deployment.url}/v1/searches/cancel-me/cancel", headers=deployment.headers, timeout=30
        )
        assert cancelled.status_code == 202 and cancelled.json()["cancel_requested"] is True
        row = deployment.wait("cancel-me", lambda r: r.state == SearchState.CANCELLED, "cancelled", seconds=90)
        assert "cancelled by pipeline" in row.reason
        # Nothing of that search is left running: no search or probe process names its study.
        deadline = time.monotonic() + 10
        while [
            line for line in processes_under(deployment.base) if "cancel-me" in line
        ] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [line for line in processes_under(deployment.base) if "cancel-me" in line] == []
    finally:
        deployment.gate.touch()
    with open_store(deployment.db) as store:
        probes_before = {p.config_key: p.id for p in store.probes("cancel-me")}
    resumed = deployment.submit(**body)
    assert resumed.status_code == 200 and resumed.json()["state"] == SearchState.QUEUED
    deployment.wait("cancel-me", lambda r: r.state == SearchState.FINISHED, "finished after resuming", seconds=240)
    with open_store(deployment.db) as store:
        after = store.probes("cancel-me")
    # What was settled before the cancel was not probed again (the confirmation round adds windows, not rows).
    assert all(sum(1 for p in after if p.config_key == key) == 1 for key in probes_before)


def test_a_killed_worker_s_search_is_taken_over_and_the_service_can_die(deployment):
    deployment.start_worker("worker-b")
    body = dict(study="survivor", checkpointing="off,on")
    deployment.gate.unlink()  # (the holder's second probe waits: the kill comes mid-search)
    try:
        assert deployment.submit(**body).status_code == 201
        row = deployment.wait("survivor", lambda r: r.state == SearchState.RUNNING, "running")
        holder = "worker-a" if row.worker.endswith(f":{deployment.processes['worker-a'].pid}") else "worker-b"
        other = "worker-b" if holder == "worker-a" else "worker-a"
        with open_store(deployment.db) as store:
            deadline = time.monotonic() + 120
            while not store.queue.settled_counts(["survivor"]) and time.monotonic() < deadline:
                time.sleep(0.2)
        assert deployment.row("survivor").state == SearchState.RUNNING
        deployment.kill(holder)  # kill -9 of the worker: its search and probe processes die with it
        deployment.kill("serve")  # and the service, kill -9, while the other worker goes on
    finally:
        deployment.gate.touch()
    row = deployment.wait(
        "survivor", lambda r: r.state == SearchState.FINISHED, "finished by the other worker", seconds=240
    )
    assert row.worker.endswith(f":{deployment.processes[other].pid}") and row.attempts == 2
    with open_store(deployment.db) as store:
        study = store.study("survivor")
        claims = store.claims.of_study(study.id, stale_after=15.0)
    assert study.status == "finished" and all(c.state == "done" for c in claims)
    # A restarted service shows it.
    deployment.start_service()
    view = deployment.view("survivor")
    assert view["state"] == SearchState.FINISHED and view["leaderboard"]
