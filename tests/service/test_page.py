"""The pages: in process (FastAPI's TestClient over a study written through the real Store) what
each page shows, that it escapes what the database holds, who may read it, and that nothing is
fetched from elsewhere; then for real, a headless Chromium on a running `autotune serve`, following
a search live to its end without a reload."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from autotune.handoff.best_config import best_in
from autotune.service.app import ServiceConfig, create_app
from autotune.service.auth import COOKIE
from autotune.service.plans import Outcome
from autotune.store import open_store
from tests.helpers.faults import GATE_ENV, fault_env
from tests.helpers.models import write_model_dir
from tests.helpers.ports import free_port
from tests.helpers.store import ENV, FakeModel, GiB, config, make_study, result

HOSTILE = "<script>alert('x')</script>\"&model"
PAGES = ("/", "/searches/s1", "/plan", "/login")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def db(tmp_path) -> str:
    """A database holding one finished study: two configs that fit, one out of memory."""
    url = f"sqlite:///{tmp_path / 'pages.db'}"
    with open_store(url) as store:
        study = make_study(store, "s1", model=FakeModel(reference=HOSTILE))
        fp = ENV.fingerprint()
        store.record_probe(study.id, config(1), result("ok", 800.0, 2 * GiB), env_fingerprint=fp)
        store.record_probe(study.id, config(2), result("ok", 1500.0, 5 * GiB), env_fingerprint=fp)
        store.record_probe(
            study.id, config(8), result("oom", None, None, error="CUDA out of memory"), env_fingerprint=fp
        )
        store.set_study_status(study.id, "finished")
    return url


def client_of(db: str, public_read: bool = True) -> TestClient:
    return TestClient(create_app(ServiceConfig(db=db, public_read=public_read)))


def make_token(db: str) -> str:
    with open_store(db) as store:
        return store.tokens.create("reader")


# -- what the pages show --------------------------------------------------------------------------


def test_the_index_lists_the_study_with_a_link_to_its_page(db):
    with client_of(db) as client:
        page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    row = re.search(r'<tr><td><a href="/searches/s1">s1</a></td>.*?</tr>', page.text)
    assert row is not None, page.text
    for shown in ("8.00 GiB", "NVIDIA H100 80GB HBM3", "finished", "3 settled", "1,500"):
        assert shown in row.group(0)


def test_the_search_page_shows_the_leaderboard_the_plot_the_pick_and_the_probes(db):
    with client_of(db) as client:
        page = client.get("/searches/s1").text
        cli_text = client.get("/v1/searches/s1/best?format=cli").text
    board = re.search(r'<div id="leaderboard">.*?</div>', page, re.S).group(0)
    ranked = re.findall(
        r'<tr data-key="[^"]+"[^>]*><td class="num">(\d)</td><td class="label">([^<]+)</td>'
        r'<td class="num">([\d,]+)</td>',
        board,
    )
    assert ranked == [
        ("1", "mb2x16 blk512 fp32 no-ckpt sdpa", "1,500"),
        ("2", "mb1x32 blk512 fp32 no-ckpt sdpa", "800"),
    ]
    assert "5.00 GiB of 7.75 GiB (65%)" in board  # needs (reserved + context) of the budget less the margin
    # The plot: one point per config that fits, the faster higher, the allowed memory to the right of both.
    svg = re.search(r"<svg.*?</svg>", page, re.S).group(0)
    points = {
        cls: (float(x), float(y))
        for cls, x, y in re.findall(r'<circle class="(point(?: best)?)" cx="([\d.]+)" cy="([\d.]+)"', svg)
    }
    assert set(points) == {"point", "point best"}
    assert points["point best"][1] < points["point"][1] and points["point best"][0] > points["point"][0]
    allowed = float(re.search(r'<line class="allowed" x1="([\d.]+)"', svg).group(1))
    budget = float(re.search(r'<line class="budget" x1="([\d.]+)"', svg).group(1))
    assert points["point best"][0] < allowed < budget
    assert "Chosen: mb2x16 blk512 fp32 no-ckpt sdpa" in page  # views' why
    # Hand-off snippets: what /best answers, each with a copy button.
    for fmt in ("trainer-args", "cli", "accelerate"):
        assert f'<pre id="handoff-{fmt}">' in page and f'data-copy="handoff-{fmt}"' in page
    assert re.search(r'<pre id="handoff-cli">(.*?)</pre>', page, re.S).group(1) == cli_text.strip()
    # Every probe settled, as the event stream numbers them, the failure said in one line.
    probes = re.findall(r'<tr data-id="(\d+)" class="status-(\w+)"', page)
    assert [status for _, status in probes] == ["ok", "ok", "oom"]
    assert 'src="/static/live.js"' in page and 'data-events="/v1/searches/s1/events"' in page


def test_the_page_counts_the_confirmation_rounds_windows_beside_the_configurations(db):
    with client_of(db) as client:
        before = client.get("/searches/s1").text
        with open_store(db) as store:
            study = store.study("s1")
            store.set_confirmation(
                study.id,
                {
                    "winner": "w",
                    "winner_label": "mb2x16 blk512 fp32 no-ckpt sdpa",
                    "runner_up": "mb1x32 blk512 fp32 no-ckpt sdpa",
                    "margin": 0.5,
                    "noise": 0.05,
                    "confirmed": True,
                    "rounds": 2,
                    "probes": 4,
                    "seconds": 3.0,
                },
            )
        page = client.get("/searches/s1").text
        view = client.get("/v1/searches/s1").json()
    assert "Confirmation" not in before
    assert "<dt>Confirmation</dt><dd>4 more windows of the contenders, measured again" in page
    assert view["progress"]["confirming"] == 4 and view["progress"]["settled"] == 3


def test_the_snippets_are_the_best_commands_text(db):
    with client_of(db) as client:
        page = client.get("/searches/s1").text
    with open_store(db) as store:
        accelerate = best_in(store, "s1").render("accelerate")
    shown = re.search(r'<pre id="handoff-accelerate">(.*?)</pre>', page, re.S).group(1)
    assert shown.replace("&quot;", '"').replace("&#x27;", "'") == accelerate


def test_pages_escape_what_the_database_holds(db):
    with client_of(db) as client:
        for path in ("/", "/searches/s1"):
            page = client.get(path).text
            assert (
                "<script>alert" not in page
                and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&quot;&amp;model" in page
            )


def test_an_unknown_search_is_one_line_not_a_traceback(db):
    with client_of(db) as client:
        page = client.get("/searches/nope")
    assert page.status_code == 404 and page.headers["content-type"].startswith("text/html")
    assert re.findall(r'<p class="error"[^>]*>(.*?)</p>', page.text) == [
        "no search or study named &#x27;nope&#x27;; submit one with POST /v1/searches, or list them with GET /v1/searches."
    ]
    assert "Traceback" not in page.text


# -- who may read -----------------------------------------------------------------------------------


def test_a_private_service_sends_a_reader_to_log_in_and_serves_them_with_the_cookie(db):
    token = make_token(db)
    with client_of(db, public_read=False) as client:
        for path in ("/", "/searches/s1"):
            sent = client.get(path, follow_redirects=False)
            assert sent.status_code == 303 and sent.headers["location"] == f"/login?next={path.replace('/', '%2F')}"
        assert 'name="token"' in client.get("/login?next=%2Fsearches%2Fs1").text
        wrong = client.post("/login", data={"token": "at_not-a-token", "next": "/"}, follow_redirects=False)
        assert wrong.status_code == 401 and "not a live token" in wrong.text and COOKIE not in client.cookies
        right = client.post("/login", data={"token": token, "next": "/searches/s1"}, follow_redirects=False)
        assert right.status_code == 303 and right.headers["location"] == "/searches/s1"
        cookie = right.headers["set-cookie"]
        assert cookie.startswith(f"{COOKIE}={token};") and "HttpOnly" in cookie and "SameSite=strict" in cookie
        assert client.get("/searches/s1").status_code == 200
        assert "<span>reader</span>" in client.get("/").text  # who is logged in, with a way out
        client.post("/logout", follow_redirects=False)
        assert client.get("/", follow_redirects=False).status_code == 303


def test_login_goes_back_only_to_this_service(db):
    token = make_token(db)
    with client_of(db) as client:
        for elsewhere in ("//evil.example/", "evil.example", "/\\evil.example"):
            sent = client.post("/login", data={"token": token, "next": elsewhere}, follow_redirects=False)
            assert sent.headers["location"] == "/"


# -- plan ------------------------------------------------------------------------------------------------

PLANNED = {
    "model": "gpt2",
    "target": "NVIDIA H100 80GB HBM3 (h100) with 8.00 GiB",
    "budget_bytes": 8 * GiB,
    "margin_bytes": GiB // 2,
    "notes": ["a <b>note</b>"],
    "candidates": [
        {
            "label": "mb1x8 blk512 bf16 no-ckpt sdpa",
            "fits": True,
            "need_bytes": 3 * GiB,
            "tokens_per_s": 41000.0,
            "why_not": None,
        },
        {
            "label": "mb8x1 blk512 fp32 no-ckpt sdpa",
            "fits": False,
            "need_bytes": 11 * GiB,
            "tokens_per_s": None,
            "why_not": "over the budget",
        },
    ],
}


def test_the_plan_form_predicts_through_v1_plans_machinery(db, monkeypatch):
    from autotune.service.routes import predictions

    asked = []

    async def run(command, arguments, config, on_progress=None):  # the child `autotune plan --json`, canned
        asked.append((command, arguments))
        return Outcome(200, PLANNED)

    monkeypatch.setattr(predictions, "_run", run)
    token = make_token(db)
    with client_of(db) as client:
        form = client.get("/plan").text
        assert all(f'name="{field}"' in form for field in ("model", "gpu", "gpu_budget"))
        refused = client.post("/plan", data={"model": "gpt2", "gpu": "h100"})
        assert refused.status_code == 401 and 'href="/login?next=%2Fplan"' in refused.text and not asked
        client.cookies.set(COOKIE, token)
        page = client.post("/plan", data={"model": "gpt2", "gpu": "h100", "gpu_budget": "8GiB"})
    assert page.status_code == 200, page.text
    assert asked == [("plan", ("--model=gpt2", "--gpu=h100", "--gpu-budget=8GiB"))]
    rows = re.findall(r'<tr class="(fits|over)"><td class="label">([^<]+)</td><td>(\w+)</td>', page.text)
    assert rows == [
        ("fits", "mb1x8 blk512 bf16 no-ckpt sdpa", "fits"),
        ("over", "mb8x1 blk512 fp32 no-ckpt sdpa", "over"),
    ]
    assert "1 of 2 candidates predicted to fit in 7.50 GiB" in page.text and "a &lt;b&gt;note&lt;/b&gt;" in page.text
    assert 'value="h100"' in page.text  # the form keeps what was asked


def test_a_plan_the_command_refuses_is_its_line_under_the_form(db, monkeypatch):
    from autotune.service.routes import predictions

    async def run(command, arguments, config, on_progress=None):
        raise AssertionError("a refused request starts no child")

    monkeypatch.setattr(predictions, "_run", run)
    with client_of(db) as client:
        client.cookies.set(COOKIE, make_token(db))
        page = client.post("/plan", data={"model": "gpt2", "gpu": "list"})
    assert page.status_code == 422
    errors = re.findall(r'<p class="error"[^>]*>(.*?)</p>', page.text)
    assert (
        len(errors) == 1 and "gpu &#x27;list&#x27;" in errors[0] and '<form method="post" action="/plan"' in page.text
    )


# Which card to rent (planner/rental_plan.py's document): two priced on the front (h100 x1 the cheapest,
# h100 x2 the fastest), one priced behind them, one without a price, one where nothing fits; a card
# name that is markup.
RENTED = {
    "model": "gpt2",
    "tokens": 100_000_000,
    "sort": "cost",
    "prices": "prices.csv",
    "speed_error": {"count": 37, "median": 0.0507, "worst": 1.478},
    "seconds": 12.0,
    "traces": 7,
    "notes": ["a <b>note</b>"],
    "cheapest": ["h100", 1],
    "fastest": ["h100", 2],
    "front": [["h100", 1], ["h100", 2]],
    "options": [
        {"card": "h100", "gpus": 1, "seconds": 3600.0, "cost": 3.29, "tokens_per_s": 27778.0, "per_gpu_hour": 3.29}
        | {"marks": ["cheapest"]},
        {"card": "h100", "gpus": 2, "seconds": 2000.0, "cost": 3.6, "tokens_per_s": 50000.0, "per_gpu_hour": 3.24}
        | {"marks": ["fastest"]},
        {"card": "a100", "gpus": 1, "seconds": 7200.0, "cost": 8.0, "tokens_per_s": 13889.0, "per_gpu_hour": 4.0},
        {"card": "<i>l4</i>", "gpus": 1, "seconds": 20000.0, "cost": None, "tokens_per_s": 5000.0},
        {
            "card": "t4",
            "gpus": 1,
            "seconds": None,
            "cost": None,
            "why_none": "nothing fits: the smallest need is 20 GiB",
        },
    ],
}
for option in RENTED["options"]:
    option.setdefault("card_name", option["card"].upper())
    option.update(fits=option["seconds"] is not None, config="mb8x1 blk512 bf16 no-ckpt sdpa", need_bytes=3 * GiB)
    option.setdefault("per_gpu_hour", None)
    option.setdefault("why_none", None)


def test_a_long_plan_s_form_goes_to_a_page_that_reads_itself_again_until_it_is_ready(db, monkeypatch):
    import asyncio
    import threading

    from autotune.service.routes import predictions

    release = threading.Event()

    async def run(command, arguments, config, on_progress=None):  # the child, canned: it answers once released
        on_progress(3, 8)  # (as the real child's progress lines say it)
        while not release.is_set():
            await asyncio.sleep(0.02)
        return Outcome(200, RENTED)

    monkeypatch.setattr(predictions, "_run", run)
    token, other = make_token(db), None
    with open_store(db) as store:
        other = store.tokens.create("other")
    asked = {"model": "gpt2", "gpu": "h100,a100,l4,t4", "gpus": "1,2", "tokens": "100M", "sort": "cost"}
    app = create_app(ServiceConfig(db=db, public_read=True, plan_wait_seconds=0.1))
    with TestClient(app) as client:
        client.cookies.set(COOKIE, token)
        sent = client.post("/plan", data=asked, follow_redirects=False)
        assert sent.status_code == 303 and re.fullmatch(r"/plans/[\w-]+", sent.headers["location"])
        page = client.get(sent.headers["location"])
        assert page.status_code == 200
        assert '<meta http-equiv="refresh" content="2">' in page.text and 'id="planning"' in page.text
        assert "traced 3 of 8" in page.text
        assert 'value="h100,a100,l4,t4"' in page.text and '<option value="cost" selected>' in page.text
        assert "plan-result" not in page.text
        # Only the token that asked sees it; without one, a way to log in.
        client.cookies.set(COOKIE, other)
        theirs = client.get(sent.headers["location"])
        assert theirs.status_code == 404 and 'id="planning"' not in theirs.text and "a100,l4,t4" not in theirs.text
        client.cookies.clear()
        anonymous = client.get(sent.headers["location"])
        assert anonymous.status_code == 401 and "/login?next=%2Fplans%2F" in anonymous.text
        client.cookies.set(COOKIE, token)
        release.set()
        deadline = time.monotonic() + 10
        while 'id="planning"' in page.text and time.monotonic() < deadline:
            time.sleep(0.05)
            page = client.get(sent.headers["location"])
    assert page.status_code == 200 and "http-equiv" not in page.text and 'id="plan-result"' in page.text
    assert 'value="h100,a100,l4,t4"' in page.text  # the form keeps what was asked


def rental_page(db, monkeypatch) -> str:
    from autotune.service.routes import predictions

    async def run(command, arguments, config, on_progress=None):
        return Outcome(200, RENTED)

    monkeypatch.setattr(predictions, "_run", run)
    with client_of(db) as client:
        client.cookies.set(COOKIE, make_token(db))
        page = client.post("/plan", data={"model": "gpt2", "gpu": "all", "gpus": "1,2", "tokens": "100M"})
    assert page.status_code == 200, page.text
    return page.text


def test_a_rental_plan_shows_its_table_with_the_speed_error_and_the_marks(db, monkeypatch):
    page = rental_page(db, monkeypatch)
    table = re.search(r'<table class="plan rentals">.*?</table>', page, re.S).group(0)
    rows = re.findall(r'<tr class="([^"]*)" data-card="([^"]*)" data-gpus="(\d+)">(.*?)</tr>', table)
    assert [(cls, card, gpus) for cls, card, gpus, _ in rows] == [
        ("cheapest", "h100", "1"),
        ("fastest", "h100", "2"),
        ("", "a100", "1"),
        ("", "&lt;i&gt;l4&lt;/i&gt;", "1"),
        ("none", "t4", "1"),
    ]
    first = re.findall(r"<td[^>]*>(.*?)</td>", rows[0][3])
    assert first[3:7] == ["27,778 ±5%", "1h00m", "3.29", "$3.29"]
    assert '<span class="mark mark-cheapest">cheapest</span>' in first[7]
    assert "mark-fastest" in rows[1][3] and "mark-front" not in rows[1][3]
    assert re.findall(r"<td[^>]*>(.*?)</td>", rows[3][3])[6] == "no price"
    assert "nothing fits: the smallest need is 20 GiB" in rows[4][3]
    # The stated error, in the command line's words; the notes and labels escaped.
    assert "±5% median, x1.48 at worst, against 37 published GPU training throughputs" in page
    assert "a &lt;b&gt;note&lt;/b&gt;" in page and "<i>l4" not in page
    assert "<dt>Front</dt><dd>h100 ×1, h100 ×2" in page


def test_a_rental_plans_plot_is_time_against_cost_with_the_front_joined(db, monkeypatch):
    page = rental_page(db, monkeypatch)
    svg = re.search(r'<svg class="plot rentals".*?</svg>', page, re.S).group(0)
    points = {
        re.search(r"<title>([^:]+):", tip).group(1): (cls, float(x), float(y))
        for cls, x, y, tip in re.findall(
            r'<circle class="([^"]+)" cx="([\d.]+)" cy="([\d.]+)" r="\d+">(<title>.*?</title>)', svg
        )
    }
    # One point per priced card and count; the sooner to the left, the dearer higher.
    assert set(points) == {"h100 ×1", "h100 ×2", "a100 ×1"}
    assert points["h100 ×1"][0] == "rental front cheapest" and points["h100 ×2"][0] == "rental front fastest"
    assert points["a100 ×1"][0] == "rental"
    assert points["h100 ×2"][1] < points["h100 ×1"][1] < points["a100 ×1"][1]
    assert points["h100 ×1"][2] > points["h100 ×2"][2] > points["a100 ×1"][2]
    # The front joined, cheapest first; its names in its tip.
    front = re.search(r'<polyline class="front" points="([^"]+)"><title>([^<]+)</title>', svg)
    joined = [tuple(map(float, pair.split(","))) for pair in front.group(1).split()]
    assert joined == [points["h100 ×1"][1:], points["h100 ×2"][1:]]
    assert "h100 ×1, h100 ×2" in front.group(2)
    # The cheapest and the fastest named beside their points.
    labels = re.findall(r'<text class="rental-label( marked)?"[^>]*>([^<]+)</text>', svg)
    assert (" marked", "h100 ×1 (cheapest)") in labels and (" marked", "h100 ×2 (fastest)") in labels
    # The option without a price on the strip below, by time alone, its name escaped; nothing for t4.
    squares = re.findall(r'<rect class="rental unpriced" x="[\d.]+" y="([\d.]+)"[^>]*><title>([^<]+)</title>', svg)
    assert len(squares) == 1 and squares[0][1].startswith("&lt;i&gt;l4&lt;/i&gt; ×1:") and "no price" in squares[0][1]
    assert float(squares[0][0]) > max(y for _, _, y in points.values())
    assert "<i>" not in svg and "t4" not in svg


def test_the_rental_plot_says_what_it_cannot_draw():
    from autotune.service.svg import time_cost_svg
    from autotune.service.views import rental_view

    nothing = time_cost_svg(rental_view({**RENTED, "options": RENTED["options"][4:]})["rows"])
    assert "no card and count runs this space" in nothing and "<circle" not in nothing
    l4 = {**RENTED["options"][3], "marks": ["fastest"]}  # (each option carries its marks: RentalPlan.marks)
    unpriced = {**RENTED, "options": [l4, RENTED["options"][4]], "cheapest": None, "fastest": ["<i>l4</i>", 1]}
    unpriced["front"] = []
    drawn = time_cost_svg(rental_view(unpriced)["rows"])
    assert "no option has a price" in drawn and "<circle" not in drawn and "rental unpriced fastest" in drawn


# -- nothing from elsewhere ----------------------------------------------------------------------------


def test_static_assets_are_served_from_the_package(db):
    with client_of(db) as client:
        css = client.get("/static/style.css")
        js = client.get("/static/live.js")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css") and "svg.plot" in css.text
    assert js.status_code == 200 and "javascript" in js.headers["content-type"] and "EventSource" in js.text
    for page in PAGES:  # each page's assets are these
        assert set(re.findall(r'(?:src|href)="(/static/[^"]+)"', client.get(page).text)) <= {
            "/static/style.css",
            "/static/live.js",
            "/static/favicon.svg",
        }
    assert client.get("/static/favicon.svg").headers["content-type"].startswith("image/svg+xml")


def test_no_page_or_asset_reaches_outside_the_service(db):
    with client_of(db) as client:
        texts = {path: client.get(path) for path in (*PAGES, "/static/style.css", "/static/live.js")}
    for path, answer in texts.items():
        assert answer.status_code == 200, path
        assert re.search(r"https?:|(src|href|action)=\"//|url\(\s*['\"]?(https?:)?//|@import", answer.text) is None, (
            path
        )
    for path in PAGES:
        policy = texts[path].headers["content-security-policy"]
        assert "default-src 'none'" in policy and "script-src 'self'" in policy and "'unsafe-inline'" not in policy


# -- a real browser on a real service ---------------------------------------------------------------------

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}
SEARCH = {
    "model": "tiny",
    "gpu_budget": "200MiB",
    "device": "cpu",
    "micro_batches": [1, 2, 4],
    "block_sizes": "32",
    "effective_batch": 4,
    "precisions": "fp32",
    "checkpointing": "off,on",
    "attention": "sdpa",
    "warmup_steps": 2,
    "measure_steps": 2,
    "measure_seconds": 0.5,
    "predict": False,
    "confirm": False,
}


def http(url: str, body: dict | None = None, token: str | None = None) -> dict:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = json.dumps(body).encode() if body is not None else None
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=10) as answer:
        return json.loads(answer.read())


@pytest.fixture
def served(tmp_path):
    """`autotune serve` with its local CPU worker, public to read, and a token to submit with. The
    second probe of each probe process waits at its first step until the file `gate` exists
    (tests/helpers/faults): a test decides when a search goes on."""
    db = f"sqlite:///{tmp_path / 'served.db'}"
    root = tmp_path / "models"
    write_model_dir(root / "tiny", **TINY)
    token = subprocess.run(
        [sys.executable, "-m", "autotune", "token", "create", "t", "--db", db],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "autotune",
            "serve",
            "--port",
            str(port),
            "--db",
            db,
            "--public-read",
            "--local-worker",
            "--worker-device",
            "cpu",
            "--model-root",
            str(root),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env={**fault_env("gate", on_probe=2), GATE_ENV: str(tmp_path / "gate"), "PYTHONUNBUFFERED": "1"},
        cwd=tmp_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if http(f"{url}/healthz")["status"] == "ok":
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"autotune serve did not answer: {(tmp_path / 'serve.log').read_text()}")
            time.sleep(0.2)
        yield url, token, tmp_path / "serve.log", tmp_path / "gate"
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the service, its local worker and the worker's children
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.fixture
def browser():
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip(
            f"needs Chromium and its driver at {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)"
        )
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="autotune-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1100,1500",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def eventually(browser, script: str, seconds: float = 10.0):
    """What `script` returns once it is truthy (the page's last read may still be in flight)."""
    deadline = time.monotonic() + seconds
    while not (value := browser.execute_script(script)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


@pytest.mark.slow
def test_a_browser_follows_a_running_search_live_to_its_end(served, browser, tmp_path):
    url, token, log, gate = served
    search = http(f"{url}/v1/searches", SEARCH, token)
    browser.get(url + search["links"]["page"])
    browser.execute_script("window.autotuneMarker = 'loaded once';")  # gone if the page reloads
    seen = set()
    deadline = time.monotonic() + 90
    while True:
        rows = browser.execute_script("return document.querySelectorAll('#events tr[data-id]').length;")
        state = browser.execute_script("var s = document.getElementById('state'); return s && s.textContent;")
        seen.add(rows)
        if rows and not gate.exists():  # the page shows the first probe: the search goes on (it waited)
            gate.touch()
        if state in ("finished", "failed", "interrupted", "cancelled") and browser.execute_script(
            "return window.autotuneEnded === true;"
        ):
            break
        assert time.monotonic() < deadline, f"the page never showed the end (rows {sorted(seen)}):\n{log.read_text()}"
        time.sleep(0.2)
    assert state == "finished", log.read_text()
    assert browser.execute_script("return window.autotuneMarker;") == "loaded once"  # no reload
    total = search["progress"]["total"]
    # The probes arrived one by one, while the page was open.
    assert min(seen) < total and rows == total and len(seen) >= 3, sorted(seen)
    # (Read in one script each: the page redraws these parts once the search ends, and an element
    # found before a redraw and read after it is stale.)
    assert (
        eventually(browser, "var p = document.getElementById('progress'); return p && p.textContent.trim();")
        == f"{total} / {total}"
    )
    # The parts the server draws were read again: the leaderboard, the plot and the pick are there.
    assert eventually(browser, "return document.querySelectorAll('#leaderboard tr[data-key]').length;") >= 1
    assert eventually(browser, "return document.querySelectorAll('#plot svg circle.point').length;") >= 1
    assert eventually(browser, "var p = document.getElementById('handoff-cli'); return p && p.textContent;").startswith(
        "--per_device_train_batch_size"
    )
    assert eventually(
        browser,
        "var b = document.querySelector('button.copy'); "  # shown by the script
        "return b !== null && b.getClientRects().length > 0 && getComputedStyle(b).visibility !== 'hidden';",
    )
    problems = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert problems == []  # no script error, nothing missing, nothing the Content-Security-Policy refused
    shot = tmp_path / "service-page.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size < 300_000
    if os.environ.get("AUTOTUNE_SAVE_SCREENSHOT"):  # docs/service-page.png is made by this test, on request
        shutil.copyfile(shot, REPO / "docs" / "service-page.png")
