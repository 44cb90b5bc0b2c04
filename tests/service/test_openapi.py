"""The service against its own OpenAPI: schemathesis generates requests for every operation (ones
the schema allows and ones it refuses), sends them in process over ASGI, with a live token and
without one, and no answer may be a 5xx. The database holds a finished study with a pick, and
some requests name it (its page, its events, its answer in each format, `GET /v1/answers` of its
model and budget), and some submissions are ones `autotune search` takes with random flags added,
so the routes get past their first refusal rather than only answering 401, 404 and 422.

Below the property run, one regression test per 5xx (or error stream) it or a hand-written request
found: a name too long for a file, a NUL in a name, a data flag without --dataset, a Last-Event-ID
of superscript digits or past any row.

(schemathesis's own `@schema.parametrize()` over a fixture, `schemathesis.pytest.from_fixture`,
fails under pytest 9 (`'Function' object has no attribute '_nodeid'`), so each operation is a
parametrized test here and hypothesis's `@given` draws its cases inside it.)"""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from autotune.cli.results import BEST_FORMATS  # noqa: E402
from autotune.service.app import ServiceConfig, create_app  # noqa: E402
from autotune.service.routes.searches import search_body_schema  # noqa: E402
from autotune.service.submissions import ServicePolicy  # noqa: E402
from autotune.store import open_store  # noqa: E402
from tests.helpers.store import ENV, config, make_study, result  # noqa: E402

STUDY = "openapi-finished"
MODEL, BUDGET = "gpt2", "8GiB"  # the study's (tests/helpers/store.py make_study)
# Per operation and per token case: the whole run stays well under a minute (more for a deeper look:
# AUTOTUNE_OPENAPI_EXAMPLES=500).
EXAMPLES = int(os.environ.get("AUTOTUNE_OPENAPI_EXAMPLES", "25"))
# A submission `autotune search` takes (a gpt2-family name resolves without the hub).
VALID_SEARCH = {
    "model": "gpt2",
    "gpu_budget": "8GiB",
    "device": "cpu",
    "micro_batches": [1, 2],
    "block_sizes": "32",
    "effective_batch": 2,
}
# Flags that describe the data, refused without --dataset (they were a 500 once: a test below).
DATA_FIELDS = {"text_column", "target_column", "label_column", "tokenizer"}
EXTRA_FIELDS = sorted(set(search_body_schema()["properties"]) - set(VALID_SEARCH))
SCALARS = st.one_of(
    st.booleans(),
    st.integers(-3, 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=24),
    st.sampled_from(["auto", "on", "off", "lora", "fp16", "bf16", "1h", "0"]),
)
VALUES = st.one_of(SCALARS, st.lists(st.one_of(st.integers(0, 64), st.text(max_size=6)), min_size=1, max_size=4))
# The operations, read from the application's schema at collection (no database is opened for it).
OPERATIONS = sorted(
    f"{method.upper()} {path}"
    for path, methods in create_app(ServiceConfig()).openapi()["paths"].items()
    for method in methods
)


def seed(db: str) -> str:
    """A finished study with a pick, through the real Store (no torch); returns a live token."""
    with open_store(db) as store:
        study = make_study(store, STUDY)
        for micro_batch, status, speed in [(1, "ok", 800.0), (2, "ok", 1500.0), (4, "oom", None), (8, "timeout", None)]:
            store.record_probe(study.id, config(micro_batch), result(status, speed), env_fingerprint=ENV.fingerprint())
        store.set_study_status(STUDY, "finished")
        return store.tokens.create("schemathesis")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The service's schema, loaded from the app in process, and a live token."""
    db = f"sqlite:///{tmp_path_factory.mktemp('openapi') / 'service.db'}"
    token = seed(db)
    # predict_seconds: a generated body /v1/plan or /v1/estimate took would start a child; none gets
    # that far (random fields are refused in milliseconds), and one that did must still end.
    app = create_app(ServiceConfig(db=db, public_read=False, predict_seconds=120.0))
    yield schemathesis.openapi.from_asgi("/openapi.json", app), token
    from schemathesis.python.asgi import shutdown_lifespans

    shutdown_lifespans()  # (closes the app's store: schemathesis keeps each app's lifespan up until then)


def cases(operation) -> st.SearchStrategy:
    """Generated requests, allowed and refused by the schema, and some that name what is stored."""
    strategies = [operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)]
    path = operation.path
    if "{name}" in path:
        query = {"format": st.sampled_from(BEST_FORMATS)} if path.endswith("/best") else {}
        strategies.append(
            st.fixed_dictionaries(query).flatmap(
                lambda q: operation.as_strategy(path_parameters={"name": STUDY}, query=q or None)
            )
        )
    if path == "/v1/answers":
        strategies.append(
            st.tuples(st.sampled_from(BEST_FORMATS), st.sampled_from([None, "H100", "a10g"])).flatmap(
                lambda fg: operation.as_strategy(
                    query={"model": MODEL, "budget": BUDGET, "format": fg[0], **({"gpu": fg[1]} if fg[1] else {})}
                )
            )
        )
    if path == "/v1/searches" and operation.method.upper() == "POST":
        extras = st.dictionaries(st.sampled_from(EXTRA_FIELDS), VALUES, max_size=3)
        strategies.append(extras.flatmap(lambda extra: operation.as_strategy(body={**VALID_SEARCH, **extra})))
    return st.one_of(strategies)


@pytest.mark.slow  # (about 30 s: ten operations, two ways, 25 cases each and more)
@pytest.mark.parametrize("authorised", [True, False], ids=["token", "no-token"])
@pytest.mark.parametrize("label", OPERATIONS)
def test_no_operation_answers_with_a_server_error(service, label, authorised, caplog):
    schema, token = service
    method, path = label.split(" ", 1)
    operation = schema[path][method]
    headers = {"Authorization": f"Bearer {token}"} if authorised else {}
    statuses: list[int] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(case=cases(operation))
    def run(case):
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="autotune.service"):
            response = case.call(headers=headers)
        statuses.append(response.status_code)
        if response.status_code >= 500:
            pytest.fail(
                f"{case.method} {case.formatted_path} query={case.query} headers={case.headers} "
                f"body={case.body!r:.300}\n-> {response.status_code} {response.text[:500]}\n{caplog.text}"
            )
        case.validate_response(response, checks=[not_a_server_error], headers=headers)

    run()
    assert statuses, "no request was sent"
    if not authorised and path != "/healthz":
        assert set(statuses) == {401}, f"without a token, {label} answered {sorted(set(statuses))}"


# -- what it found --------------------------------------------------------------------------------


@pytest.fixture
def client(tmp_path):
    """The service in process (a model root set, as `autotune serve --model-root` sets it)."""
    db = f"sqlite:///{tmp_path / 'service.db'}"
    token = seed(db)
    (tmp_path / "models").mkdir()
    app = create_app(ServiceConfig(db=db, policy=ServicePolicy(model_root=tmp_path / "models")))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        test_client.headers["Authorization"] = f"Bearer {token}"
        test_client.app_under_test = app  # type: ignore[attr-defined]
        test_client.root = tmp_path / "models"  # type: ignore[attr-defined]
        yield test_client


LONG = "x" * 300  # one path component over the 255 bytes a Linux file name may have


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/searches", {**VALID_SEARCH, "model": LONG}),
        ("/v1/searches", {**VALID_SEARCH, "dataset": LONG}),
        ("/v1/searches", {**VALID_SEARCH, "dataset": "wikitext", "tokenizer": LONG}),
        pytest.param("/v1/estimate", {"model": LONG, "micro_batch": 1, "block_size": 32}, marks=pytest.mark.slow),
        pytest.param("/v1/plan", {"model": LONG, "gpu_budget": "8GiB"}, marks=pytest.mark.slow),
    ],
    ids=["search-model", "search-dataset", "search-tokenizer", "estimate-model", "plan-model"],
)
def test_a_name_too_long_for_a_file_is_refused_not_a_500(client, route, body):
    answer = client.post(route, json=body)
    assert answer.status_code < 500, answer.text


@pytest.mark.parametrize("where", ["relative", "under-root"])
def test_a_nul_in_a_model_name_is_refused_not_a_500(client, where):
    model = "tiny\x00x" if where == "relative" else f"{client.root}/tiny\x00x"
    answer = client.post("/v1/searches", json={**VALID_SEARCH, "model": model})
    assert answer.status_code in (403, 422), answer.text


@pytest.mark.parametrize("field", sorted(DATA_FIELDS))
def test_a_data_flag_without_a_dataset_is_refused(client, field):
    answer = client.post("/v1/searches", json={**VALID_SEARCH, field: "text"})
    assert answer.status_code == 422, answer.text
    assert "--dataset" in answer.json()["error"]


def asgi_get(app, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """GET `path` straight through the ASGI app, with header bytes as a client sent them (an HTTP
    client library would re-encode them): the status and the body."""
    sent: list[dict] = []

    async def receive():
        if sent:  # (the answer has begun: the client goes)
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    async def call():
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"testserver"), *headers],
            "client": ("127.0.0.1", 1),
            "server": ("testserver", 80),
        }
        try:
            await app(scope, receive, send)
        except Exception:  # (Starlette sends the 500, then raises the error on to the server)
            pass

    asyncio.run(call())
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.mark.parametrize("value", [b"\xb2", b"1\xb9"], ids=["superscript-two", "one-superscript-one"])
def test_a_last_event_id_with_a_superscript_digit_is_refused(client, value):
    token = client.headers["Authorization"].encode()
    status, body = asgi_get(
        client.app_under_test, f"/v1/searches/{STUDY}/events", [(b"authorization", token), (b"last-event-id", value)]
    )
    assert status == 422, body


def test_a_last_event_id_past_any_row_is_refused_or_streams_nothing(client):
    answer = client.get(f"/v1/searches/{STUDY}/events", headers={"Last-Event-ID": "9" * 20})
    assert answer.status_code in (200, 422), answer.text
    assert "event: error" not in answer.text, answer.text
