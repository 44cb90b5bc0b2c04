"""POST /v1/plan and GET /v1/plans/ID: a plan ready within the wait is answered at once (200); a longer
one is a job answered `202 Accepted` with where to ask, polled to its answer, read only by the token
that asked, stopped when nobody asks. In process (FastAPI's TestClient) with the child canned where
the HTTP is the point, and with the real `autotune plan` child of a tiny model where the process is
(its answer, its death and its slot)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from autotune.service.app import ServiceConfig, create_app
from autotune.service.plans import PLAN_RETRY_SECONDS, Outcome, PlanJobs
from autotune.service.submissions import ServicePolicy
from autotune.store import open_store
from tests.helpers.models import write_model_dir
from tests.helpers.plans import LONG_PLAN
from tests.helpers.processes import alive, descendants, processes_named

RENTED = {"model": "tiny", "tokens": 10_000_000, "options": [], "front": [], "cheapest": None, "fastest": None}
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}


@pytest.fixture
def service(tmp_path):
    """A database with two tokens, `asker` and `other`, and a model root holding a tiny GPT-2."""
    db = f"sqlite:///{tmp_path / 'plans.db'}"
    with open_store(db) as store:
        tokens = {name: store.tokens.create(name) for name in ("asker", "other")}
    write_model_dir(tmp_path / "models" / "tiny", **TINY)
    return db, tokens, tmp_path / "models"


def client_of(service, **settings) -> TestClient:
    db, tokens, root = service
    config = ServiceConfig(db=db, policy=ServicePolicy(model_root=root), **settings)
    client = TestClient(create_app(config))
    client.headers["Authorization"] = f"Bearer {tokens['asker']}"
    return client


def as_other(service) -> dict[str, str]:
    return {"Authorization": f"Bearer {service[1]['other']}"}


def canned(monkeypatch, release: threading.Event | None = None, outcome: Outcome | None = None) -> list:
    """The child `autotune plan --json`, canned: it answers `outcome` (RENTED) once `release` is set."""
    from autotune.service.routes import predictions

    asked = []

    async def run(command, arguments, config, on_progress=None):
        asked.append(arguments)
        if on_progress is not None:
            on_progress(3, 8)  # (as the real child's progress lines say it)
        while release is not None and not release.is_set():
            await asyncio.sleep(0.02)
        return outcome or Outcome(200, RENTED)

    monkeypatch.setattr(predictions, "_run", run)
    return asked


def poll(client: TestClient, location: str, seconds: float = 120.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        answer = client.get(location)
        if answer.status_code != 202:
            return answer
        time.sleep(0.2)
    raise AssertionError(f"{location} still running after {seconds} s: {answer.json()}")


# -- the HTTP, the child canned ----------------------------------------------------------------------


def test_a_plan_ready_within_the_wait_is_answered_at_once(service, monkeypatch):
    asked = canned(monkeypatch)
    with client_of(service) as client:
        answer = client.post("/v1/plan", json={"model": "gpt2", "gpu": "h100,l4", "gpus": "1,2", "tokens": "10M"})
        assert answer.status_code == 200 and answer.json() == RENTED
        assert asked == [("--model=gpt2", "--gpu=h100,l4", "--gpus=1,2", "--tokens=10M")]
        assert client.app.state.plans._jobs == {}  # (its answer was given: nothing kept)
        assert not client.app.state.predicting.locked()


def test_a_longer_plan_is_accepted_then_polled_to_its_answer_by_its_token_only(service, monkeypatch):
    release = threading.Event()
    canned(monkeypatch, release)
    with client_of(service, plan_wait_seconds=0.1) as client:
        accepted = client.post("/v1/plan", json={"model": "gpt2", "gpu": "all", "tokens": "1B"})
        assert accepted.status_code == 202, accepted.text
        body = accepted.json()
        location = accepted.headers["location"]
        assert location == body["links"]["self"] == f"/v1/plans/{body['plan']}"
        assert body["links"]["page"] == f"/plans/{body['plan']}" and body["state"] == "running"
        assert accepted.headers["retry-after"] == str(PLAN_RETRY_SECONDS)
        assert client.app.state.predicting.locked()  # the job holds its slot while it runs
        running = client.get(location)
        assert running.status_code == 202 and running.json()["elapsed_seconds"] >= 0.0
        assert running.json()["progress"] == {"traced": 3, "of": 8}
        assert "location" not in running.headers and running.headers["retry-after"] == str(PLAN_RETRY_SECONDS)
        # Another token's read, and no token's: as for a plan that does not exist.
        theirs = client.get(location, headers=as_other(service))
        unknown = client.get("/v1/plans/no-such-plan")
        assert theirs.status_code == unknown.status_code == 404
        assert theirs.json()["error"].replace(body["plan"][:40], "ID") == unknown.json()["error"].replace(
            "no-such-plan", "ID"
        )
        assert client.get(location, headers={"Authorization": ""}).status_code == 401
        release.set()
        done = poll(client, location)
        assert done.status_code == 200 and done.json() == RENTED
        assert client.get(location).json() == RENTED  # (read again while it is kept)
        assert not client.app.state.predicting.locked()


def test_a_refused_plan_reads_as_its_refusal(service, monkeypatch):
    release = threading.Event()
    canned(monkeypatch, release, Outcome.refused(422, "--gpu 'h1000': no such card"))
    with client_of(service, plan_wait_seconds=0.05) as client:
        accepted = client.post("/v1/plan", json={"model": "gpt2", "gpu": "h100,a100"})
        assert accepted.status_code == 202
        release.set()
        refused = poll(client, accepted.headers["location"])
    assert refused.status_code == 422 and refused.json() == {"error": "--gpu 'h1000': no such card"}


def test_a_request_the_command_line_refuses_starts_no_plan(service, monkeypatch):
    asked = canned(monkeypatch)
    with client_of(service, plan_wait_seconds=0.05) as client:
        answer = client.post("/v1/plan", json={"model": "gpt2", "gpu": "h100", "gpu_count": "2"})
        assert answer.status_code == 422 and "unknown field 'gpu_count'" in answer.json()["error"]
        remote = client.post("/v1/plan", json={"model": "gpt2", "gpu": "h100", "trust_remote_code": True})
        assert remote.status_code == 403
        assert client.app.state.plans._jobs == {} and asked == []


# -- the jobs: stopped when nobody asks, kept a while, a bounded number ------------------------------


def test_a_job_nobody_asks_about_is_stopped_and_frees_its_slot():
    released = []

    async def scenario():
        jobs = PlanJobs(idle_seconds=0.3, tick_seconds=0.05)
        job = jobs.start("asker", {}, lambda job: asyncio.sleep(60, Outcome(200, {})), lambda: released.append(1))
        kept = jobs.start(
            "asker", {}, lambda job: asyncio.sleep(0.8, Outcome(200, {"ok": True})), lambda: released.append(2)
        )
        for _ in range(10):  # asked about every 0.1 s: goes on to its end
            await asyncio.sleep(0.1)
            jobs.get(kept.id, "asker")
        await asyncio.wait_for(job.done.wait(), 5)
        await asyncio.wait_for(kept.done.wait(), 5)
        return job, kept

    job, kept = asyncio.run(scenario())
    assert job.outcome.status == 410 and "nobody asked" in job.outcome.document["error"]
    assert kept.outcome == Outcome(200, {"ok": True})
    assert sorted(released) == [1, 2]  # each slot freed once


def test_ended_answers_are_kept_a_while_and_a_bounded_number():
    now = [0.0]

    async def scenario():
        jobs = PlanJobs(kept=2, kept_seconds=100.0, clock=lambda: now[0])
        ended = []
        for index in range(3):
            job = jobs.start("asker", {}, lambda job: asyncio.sleep(0, Outcome(200, {"n": index})), lambda: None)
            await job.done.wait()
            now[0] += 1.0
            ended.append(job)
        with pytest.raises(LookupError):
            jobs.get(ended[0].id, "asker")  # the oldest of three, past the two kept
        assert jobs.get(ended[2].id, "asker").outcome.document == {"n": 2}
        with pytest.raises(LookupError):
            jobs.get(ended[2].id, "other")  # another token's
        now[0] += 101.0
        with pytest.raises(LookupError):
            jobs.get(ended[2].id, "asker")  # past its time

    asyncio.run(scenario())


# -- the real child ------------------------------------------------------------------------------------

SMALL = {  # two cards at two counts, a space of one configuration: a few seconds
    "model": "tiny",
    "gpu": "h100,l4",
    "gpus": "1,2",
    "tokens": "10M",
    "micro_batches": "1,2",
    "block_sizes": "32",
    "effective_batch": 2,
    "precisions": "fp32",
    "checkpointing": "off",
    "attention": "sdpa",
}


@pytest.mark.slow  # (a real `autotune plan` child: about 10 s)
def test_a_real_plan_is_accepted_then_polled_to_its_document(service):
    with client_of(service, plan_wait_seconds=0.2) as client:
        accepted = client.post("/v1/plan", json=SMALL)
        assert accepted.status_code == 202, accepted.text
        assert client.get(accepted.headers["location"], headers=as_other(service)).status_code == 404
        done = poll(client, accepted.headers["location"])
    assert done.status_code == 200, done.text
    document = done.json()
    assert sorted((o["card"], o["gpus"]) for o in document["options"]) == [
        ("h100", 1),
        ("h100", 2),
        ("l4", 1),
        ("l4", 2),
    ]
    assert document["tokens"] == 10_000_000 and document["fastest"] is not None
    assert all(o["tokens_per_s"] > 0 for o in document["options"] if o["fits"])


@pytest.mark.slow  # (a real child, stopped after a few seconds)
def test_a_real_plan_nobody_asks_about_is_stopped_and_frees_its_slot(service):
    root = service[2]
    with client_of(service, plan_wait_seconds=0.2, plan_idle_seconds=2.0) as client:
        accepted = client.post("/v1/plan", json=LONG_PLAN)
        assert accepted.status_code == 202, accepted.text
        location = accepted.headers["location"]
        # Asked about until its child is tracing (its trace children up, its first traces counted: its
        # progress lines read as they come), then left alone.
        deadline = time.monotonic() + 60
        started: set[int] = set()
        progress = None
        while time.monotonic() < deadline:
            running = client.get(location)
            assert running.status_code == 202
            progress = running.json()["progress"]
            plans = {pid for pid in processes_named(str(root / "tiny")) if pid != os.getpid()}
            below = set().union(*(descendants(pid) for pid in plans)) if plans else set()
            if plans and below and progress is not None:
                started = plans | below
                break
            time.sleep(0.3)
        assert started, f"the plan's child never started tracing (progress {progress})"
        assert 1 <= progress["traced"] < progress["of"]
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in started if alive(pid)]  # the child and its trace children, gone
        assert not client.app.state.predicting.locked()  # its slot freed
        stopped = client.get(location)
        assert stopped.status_code == 410 and "nobody asked" in stopped.json()["error"]
