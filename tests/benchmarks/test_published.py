"""The estimator's validation set (benchmarks/published) and its committed error table: the rows
load, the table covers them, and what the estimator states is the table's summary."""

from __future__ import annotations

import json

import pytest

from autotune.estimate import stated_error
from benchmarks.published import GOAL_WORST, RESULTS, load_rows, summarize

TABLE = RESULTS / "published-estimates.json"


@pytest.fixture(scope="module")
def rows():
    return load_rows()


@pytest.fixture(scope="module")
def table():
    return json.loads(TABLE.read_text())


def test_at_least_25_published_figures_each_with_its_source_and_configuration(rows):
    estimable = [r for r in rows if not r.skip]
    assert len(estimable) >= 25
    for row in rows:
        assert row.source.startswith(("https://", "http://")), row.id
        assert row.quote and row.gpu and row.stack, row.id
    assert {r.measures for r in estimable} == set(stated_error.KINDS)
    assert {r.method for r in estimable} == set(stated_error.METHODS)


def test_the_committed_table_covers_every_row_and_its_summary_is_its_rows(rows, table):
    by_id = {r["id"]: r for r in table["rows"]}
    assert set(by_id) == {r.id for r in rows}
    for row in rows:
        entry = by_id[row.id]
        assert (entry["error"] is None) == bool(row.skip or entry["failed"]), row.id
        if entry["error"] is not None:
            assert entry["error"] == pytest.approx(
                (entry["predicted_bytes"] - row.figure_bytes) / row.figure_bytes, abs=1e-4
            )
    assert not [r["id"] for r in table["rows"] if r["failed"]]


def test_every_hugging_face_stack_row_beyond_the_goal_says_why(rows, table):
    errors = {r["id"]: r["error"] for r in table["rows"]}
    beyond = [
        r.id
        for r in rows
        if r.hf_stack and errors[r.id] is not None and abs(errors[r.id]) > GOAL_WORST and not r.explained
    ]
    assert not beyond


def test_the_stated_error_is_the_committed_tables_summary(table):
    stated = {(e.kind, e.method): e for e in stated_error.load().values()}
    assert stated, "autotune/estimate/stated_error.json: run python -m benchmarks.published --stated-error"
    assert {(s["kind"], s["method"]): (s["count"], s["median"], s["worst"]) for s in table["summary_hf"]} == {
        key: (e.count, e.median, e.worst) for key, e in stated.items()
    }


def test_the_summary_counts_medians_and_worst_errors():
    from benchmarks.published import Outcome, Row

    def outcome(kind: str, method: str, error: float, hf: bool = True) -> Outcome:
        row = Row(
            id=f"{kind}-{method}-{error}",
            source="https://x",
            quote="q",
            figure="1 GiB",
            measures=kind,
            gpu="g",
            stack="s",
            model="m",
            task="causal-lm",
            method=method,
            micro_batch=1,
            block_size=8,
            precision="bf16",
            optimizer="adamw",
            hf_stack=hf,
        )
        return Outcome(row, predicted=1, error=error)

    outcomes = [
        outcome("allocated", "full", -0.02),
        outcome("allocated", "full", 0.04),
        outcome("allocated", "lora", -0.10),
        outcome("allocated", "lora", 0.5, hf=False),
    ]
    summary = {(s["kind"], s["method"]): s for s in summarize(outcomes, hf_only=True)}
    assert summary["allocated", "full"]["median"] == pytest.approx(0.03)
    assert summary["allocated", "all"]["count"] == 3 and summary["allocated", "all"]["worst"] == pytest.approx(0.10)
    assert summarize(outcomes)[-1]["worst"] == pytest.approx(0.5)
