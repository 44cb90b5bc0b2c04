"""What the service says about the queue, in process (TestClient over a real SQLite store): which
queue workers are connected (store/workers.py), why a queued search waits (none connected, or none
that can serve it and each one's reason), which worker holds a running search, the confirmation
round said as such while a worker holds it, each leaderboard figure with its noise, and a cancel
button only for the token that may cancel, working through the guard. Before: a search no worker
could serve stayed `queued` with no reason, the page showed no workers, no noise and no cancel, and
a confirmation round read `running N/N`."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from autotune.host.processes import owner_label
from autotune.service.app import ServiceConfig, create_app
from autotune.service.auth import COOKIE
from autotune.service.guard import allowed_hosts
from autotune.service.submissions import ServicePolicy, submission_of
from autotune.store import open_store
from autotune.store.claims import ROUND_KEY
from autotune.store.schema import QueueWorkerRow
from autotune.store.workers import ServingDevice
from autotune.vocabulary.status import SearchState, StudyStatus
from tests.helpers.models import write_model_dir
from tests.helpers.store import config, make_study, result

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}
HOST = {"host": "localhost:8000"}
ORIGIN = "http://localhost:8000"
CPU = ServingDevice("cpu", "cpu: test", None, 2)
ME = owner_label()  # (a live process on this machine: a worker of this label reads as connected)


def body(name: str, **more) -> dict:
    return {"study": name, "model": "tiny", "gpu_budget": "200MiB", "micro_batches": [1], "block_sizes": "32", **more}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    base = tmp_path_factory.mktemp("queue-status")
    root = base / "models"
    write_model_dir(root / "tiny", **TINY)
    db = f"sqlite:///{base / 'service.db'}"
    with open_store(db) as store:
        tokens = {name: store.tokens.create(name) for name in ("alice", "bob")}
    policy = ServicePolicy(model_root=root)
    config_ = ServiceConfig(db=db, policy=policy, allowed_hosts=allowed_hosts("127.0.0.1"))
    with TestClient(create_app(config_), base_url=ORIGIN) as client, open_store(db) as store:
        client.tokens, client.store, client.policy = tokens, store, policy  # type: ignore[attr-defined]
        yield client


def submit(client, name: str, who: str = "alice", **more) -> None:
    submission = submission_of(body(name, **more), client.policy)
    client.store.queue.submit(submission, submitted_by=who)


def bearer(client, who: str = "alice") -> dict[str, str]:
    return {**HOST, "Authorization": f"Bearer {client.tokens[who]}"}


def test_a_queued_search_says_why_it_waits_and_the_workers_connected_are_listed(service):
    store = service.store
    submit(service, "wants-a10g", device="cuda", gpu="A10G")
    said = service.get("/v1/searches/wants-a10g", headers=bearer(service)).json()
    assert said["state"] == SearchState.QUEUED
    assert said["waiting"].startswith("waiting for a queue worker: none is connected")

    store.workers.announce(ME, CPU)
    try:
        said = service.get("/v1/searches/wants-a10g", headers=bearer(service)).json()
        assert said["waiting"] == (
            f"no connected queue worker can serve it ({ME}: it is a cpu worker and the search asks for cuda)"
        )
        listed = service.get("/v1/workers", headers=bearer(service)).json()["workers"]
        assert [(w["label"], w["device"], w["ranks"]) for w in listed] == [(ME, "cpu", 2)]
        page = service.get("/", headers=bearer(service)).text
        assert f"<td>{ME}</td><td>cpu: test, 2 ranks</td>" in page
        assert 'title="no connected queue worker can serve it' in page  # (the list's state tip)

        # A worker gone (its process) or silent past the stale time is not connected.
        store.workers.announce("elsewhere:1", ServingDevice("cuda", "NVIDIA A10G", 24 * 2**30, 1))
        with store.db.writing() as session:
            row = session.query(QueueWorkerRow).filter_by(label="elsewhere:1").one()
            row.seen_at = row.seen_at.replace(year=2000)
        assert [w.label for w in store.workers.connected()] == [ME]
    finally:
        store.workers.leave(ME)
        store.workers.leave("elsewhere:1")


def test_the_reasons_a_worker_cannot_serve_a_search_are_each_said(service):
    submit(service, "big", device="cpu", gpu_budget="64GiB", gpus=2)
    search = service.store.queue.get("big")
    assert ServingDevice("cuda", "NVIDIA A10G", None, 1).why_not(search) == (
        "it is a cuda worker and the search asks for cpu"
    )
    assert ServingDevice("cpu", "cpu: test", 8 * 2**30, 4).why_not(search) == (
        "its device has 8.00 GiB, less than the budget of 64.00 GiB"
    )
    assert ServingDevice("cpu", "cpu: test", None, 1).why_not(search) == "it has 1 rank and the search asks for 2"
    assert ServingDevice("cpu", "cpu: test", None, 2).why_not(search) is None


def test_a_running_search_names_its_worker_and_its_confirmation_round(service):
    store = service.store
    submit(service, "confirming", device="cpu")
    store.workers.announce(ME, CPU)
    try:
        taken = store.queue.take(ME, lambda search: search.name == "confirming")
        assert taken.state == SearchState.RUNNING and taken.worker == ME
        said = service.get("/v1/searches/confirming", headers=bearer(service)).json()
        assert said["held_by"] == f"{ME} (cpu: test, 2 ranks)" and said["waiting"] is None
        assert said["progress"]["phase"] is None

        study = make_study(store, "confirming")
        store.set_study_status(study.id, StudyStatus.RUNNING)
        for micro_batch, speed, spread in ((1, 1000.0, 0.03), (2, 990.0, None)):
            store.record_probe(
                study.id, config(micro_batch), result(tokens_per_s=speed, step_spread=spread), env_fingerprint="e"
            )
        assert store.claims.take(study.id, ROUND_KEY, ME, stale_after=60) == 1
        said = service.get("/v1/searches/confirming", headers=bearer(service)).json()
        assert said["progress"]["phase"] == "confirming"
        page = service.get("/searches/confirming", headers=bearer(service)).text
        assert "confirmation round: the contenders measured again (0 windows so far)" in page
        assert f'<dd id="held-by">{ME} (cpu: test, 2 ranks)</dd>' in page
        assert '<td class="num">1,000 ±3%</td>' in page  # each figure with its noise

        store.claims.release(study.id, ROUND_KEY, ME)
        said = service.get("/v1/searches/confirming", headers=bearer(service)).json()
        assert said["progress"]["phase"] is None
    finally:
        store.workers.leave(ME)


def test_the_cancel_button_is_only_for_the_token_that_may_cancel_and_goes_through_the_guard(service):
    submit(service, "alices", device="cpu", who="alice")
    service.cookies.set(COOKIE, service.tokens["bob"])
    try:
        assert "Cancel this search" not in service.get("/searches/alices", headers=HOST).text
        refused = service.post("/searches/alices/cancel", headers={**HOST, "origin": ORIGIN})
        assert refused.status_code == 403 and "only that token may cancel it" in refused.text
        service.cookies.set(COOKIE, service.tokens["alice"])
        page = service.get("/searches/alices", headers=HOST).text
        assert 'action="/searches/alices/cancel"' in page and "Cancel this search" in page
        forged = service.post("/searches/alices/cancel", headers={**HOST, "origin": "http://evil.example"})
        assert forged.status_code == 403 and service.store.queue.get("alices").state == SearchState.QUEUED
        done = service.post("/searches/alices/cancel", headers={**HOST, "origin": ORIGIN}, follow_redirects=False)
        assert done.status_code == 303 and done.headers["location"] == "/searches/alices"
        assert service.store.queue.get("alices").state == SearchState.CANCELLED
        assert "Cancel this search" not in service.get("/searches/alices", headers=HOST).text  # (ended)
    finally:
        service.cookies.clear()
