"""The service's door against a hostile client, in process (FastAPI's TestClient over a real SQLite
store), table-driven: requests a browser can be tricked into sending (another site's page, a name
rebound to this address, a form's text/plain body), paths a client names on every route that reads
one, and a study's name taken over with other settings. Each case is refused with the service's one
shape (a status and {"error": "one line"}) and writes nothing; without its check each was answered.
The Slurm job script's values are checked where the flags are read (test_launchers.py covers the
script itself)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from autotune.service.app import ServiceConfig, create_app
from autotune.service.guard import allowed_hosts
from autotune.service.submissions import ServicePolicy
from autotune.store import open_store
from tests.helpers.cli import assert_usage_error, invoke
from tests.helpers.models import write_model_dir
from tests.helpers.store import FakeModel, make_study

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}
HOST = {"host": "localhost:8000"}
JSON = {**HOST, "content-type": "application/json"}
ORIGIN = "http://localhost:8000"


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    """A service on loopback (its hosts as `serve` derives them), a model root with a tiny GPT-2,
    a token, and a data file outside the root."""
    base = tmp_path_factory.mktemp("doors")
    root = base / "models"
    write_model_dir(root / "tiny", **TINY)
    outside = base / "secret.csv"
    outside.write_text("password,salary\nhunter2,1\n")
    db = f"sqlite:///{base / 'service.db'}"
    with open_store(db) as store:
        token = store.tokens.create("ci")
        make_study(store, "taken", model=FakeModel("gpt2"), budget=8 * 2**30)
    config = ServiceConfig(db=db, policy=ServicePolicy(model_root=root), allowed_hosts=allowed_hosts("127.0.0.1"))
    with TestClient(create_app(config), base_url=ORIGIN) as client:
        client.token, client.db, client.root, client.outside = token, db, root, outside  # type: ignore[attr-defined]
        yield client


def bearer(client) -> dict[str, str]:
    return {**HOST, "Authorization": f"Bearer {client.token}"}


def searches(client) -> int:
    with open_store(client.db) as store:
        return len(store.queue.all())


def authed(client) -> dict[str, str]:
    return {**bearer(client), "content-type": "application/json"}


def refused(answer, status: int, needle: str) -> None:
    assert answer.status_code == status, (answer.status_code, answer.text)
    body = answer.json()
    assert list(body) == ["error"] and needle in body["error"] and "\n" not in body["error"], body


SEARCH = {"model": "tiny", "gpu_budget": "200MiB", "device": "cpu", "micro_batches": [1], "block_sizes": "32"}


# -- requests a browser can be made to send --------------------------------------------------------


CROSS_SITE = [
    # (how the request looks, status, what the refusal says)
    ({"host": "evil.example:8000"}, 421, "does not answer to the host 'evil.example:8000'"),
    ({"origin": "http://evil.example"}, 403, "from the page of 'http://evil.example'"),
    ({"origin": "http://localhost:9999"}, 403, "from the page of 'http://localhost:9999'"),  # another port
    ({"sec-fetch-site": "same-site"}, 403, "another site's page (same-site)"),  # a sibling subdomain
    ({"sec-fetch-site": "cross-site"}, 403, "another site's page (cross-site)"),
]


@pytest.mark.parametrize(("headers", "status", "needle"), CROSS_SITE, ids=[n for _, _, n in CROSS_SITE])
def test_a_cookie_write_from_another_site_or_host_is_refused(door, headers, status, needle):
    door.cookies.set("autotune_token", door.token)
    try:
        before = searches(door)
        answer = door.post("/v1/searches", json=SEARCH, headers={**HOST, **headers})
        refused(answer, status, needle)
        assert searches(door) == before
        refused(door.post("/plan", data={"model": "tiny"}, headers={**HOST, **headers}), status, needle)
    finally:
        door.cookies.clear()


def test_a_cookie_write_from_the_services_own_page_goes_through(door):
    door.cookies.set("autotune_token", door.token)
    try:
        answer = door.post(
            "/v1/searches/nothing/cancel", headers={**HOST, "origin": ORIGIN, "sec-fetch-site": "same-origin"}
        )
        assert answer.status_code == 404  # (through the guard: no such search)
    finally:
        door.cookies.clear()


@pytest.mark.parametrize(
    ("content_type", "body"),
    [("text/plain", '{"model": "tiny", "gpu_budget": "200MiB"}'), ("application/x-www-form-urlencoded", "model=tiny")],
)
def test_the_api_takes_json_only_as_json(door, content_type, body):
    before = searches(door)
    answer = door.post("/v1/searches", content=body, headers={**bearer(door), "content-type": content_type})
    refused(answer, 415, "must be JSON, sent as Content-Type: application/json")
    assert searches(door) == before


def test_reads_answer_only_to_the_services_hosts(door):
    refused(door.get("/healthz", headers={"host": "rebound.example"}), 421, "does not answer to the host")
    assert door.get("/healthz", headers=HOST).json() == {"status": "ok", "database": "sqlite"}


# -- paths a client names ------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["/v1/plan", "/v1/searches"])
@pytest.mark.parametrize("field", ["dataset", "tokenizer"])
def test_every_route_holds_every_named_path_to_the_model_root(door, route, field):
    body = {"model": "tiny", "gpu": "a100", "gpu_budget": "200MiB"} if route == "/v1/plan" else dict(SEARCH)
    body[field] = str(door.outside)
    answer = door.post(route, json=body, headers=bearer(door))
    refused(answer, 403, f"{field} {str(door.outside)[:80]!r} names a path on the server")
    assert "salary" not in answer.text and "hunter2" not in answer.text


# -- a study's name ------------------------------------------------------------------------------------


def test_a_submission_cannot_take_over_a_studys_name_with_other_settings(door):
    before = searches(door)
    answer = door.post("/v1/searches", json={**SEARCH, "study": "taken"}, headers=bearer(door))
    refused(answer, 409, "study 'taken' already exists with model 'gpt2'")
    assert searches(door) == before
    with open_store(door.db) as store:
        assert store.study("taken").status == "running"  # (as make_study left it: not queued)


# -- answers in the contract's one shape ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("send", "status", "needle"),
    [
        (lambda c: c.post("/v1/searches", content="[" * 30_000 + "]" * 30_000, headers=authed(c)), 422, "nests deeper"),
        (lambda c: c.post("/v1/plan", content='{"model": "\\ud800"}', headers=authed(c)), 422, "lone UTF-16"),
        (lambda c: c.get("/v1/no-such-route", headers=HOST), 404, "Not Found"),
        (lambda c: c.delete("/v1/searches", headers=HOST), 405, "Method Not Allowed"),
    ],
    ids=["deep JSON", "lone surrogate", "no route", "no method"],
)
def test_what_used_to_be_a_500_or_another_shape_is_one_line(door, send, status, needle):
    refused(send(door), status, needle)


def test_only_the_submitting_token_cancels_and_an_ended_search_stays_as_it_ended(door):
    answer = door.post("/v1/searches", json={**SEARCH, "study": "mine"}, headers=bearer(door))
    assert answer.status_code == 201, answer.text
    with open_store(door.db) as store:
        other = store.tokens.create("someone-else")
    refused(
        door.post("/v1/searches/mine/cancel", headers={**HOST, "Authorization": f"Bearer {other}"}),
        403,
        "submitted with the token 'ci'; only that token may cancel it",
    )
    assert door.post("/v1/searches/mine/cancel", headers=bearer(door)).json()["state"] == "cancelled"
    with open_store(door.db) as store:
        ended = store.queue.get("mine")
    again = door.post("/v1/searches/mine/cancel", headers=bearer(door))
    assert again.status_code == 202
    with open_store(door.db) as store:
        assert store.queue.get("mine") == ended  # (its reason and time as the first cancel left them)


# -- the command line's doors: refused before anything is made -------------------------------------


@pytest.mark.parametrize(
    "command",
    [["worker", "--queue", "--device", "cpu"], ["serve", "--port", "18091"]],
    ids=["worker --queue", "serve"],
)
def test_a_db_in_a_directory_that_does_not_exist_is_refused_not_made(tmp_path, hermetic_home, command):
    missing = tmp_path / "typo" / "service.db"
    assert_usage_error(invoke(*command, "--db", str(missing)), f"the directory {missing.parent} does not exist")
    assert not missing.parent.exists()


def test_serve_beyond_loopback_without_a_token_creates_no_database(tmp_path, hermetic_home):
    db = tmp_path / "service.db"
    assert_usage_error(
        invoke("serve", "--host", "0.0.0.0", "--port", "18092", "--db", str(db)), "no token exists to guard it"
    )
    assert not db.exists()


def test_a_revoked_tokens_open_event_stream_ends(tmp_path):
    """It streamed on for 87 s, to its search's end, before."""
    db = f"sqlite:///{tmp_path / 'streams.db'}"
    with open_store(db) as store:
        token = store.tokens.create("reader")
        make_study(store, "running", model=FakeModel("gpt2"))  # (running: its stream stays open)
    config = ServiceConfig(db=db, poll_seconds=0.05, token_recheck_seconds=0.2)
    with TestClient(create_app(config)) as client:
        headers = {"Authorization": f"Bearer {token}"}
        with client.stream("GET", "/v1/searches/running/events", headers=headers) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("retry:")
            with open_store(db) as store:
                store.tokens.revoke("reader")
            started = time.monotonic()
            for line in lines:
                if line.startswith("event: error"):
                    break
                assert time.monotonic() - started < 10, "the stream went on"
            assert "no longer live" in next(lines)
