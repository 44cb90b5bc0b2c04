"""The one ranking (autotune/results/ranking.py): fastest first, then least memory, then first measured; a
confirmation's choice among a tie ranks first over the configs it tied with, and over no other."""

from __future__ import annotations

from autotune.results.ranking import Standing, ranked


def rows(*specs: tuple[str, float | None, int | None]) -> list[Standing]:
    return [Standing(key, speed, need, order) for order, (key, speed, need) in enumerate(specs)]


def test_faster_first_then_smaller_then_earlier():
    order = ranked(
        rows(
            ("slow", 100.0, 1),
            ("fast", 300.0, 9),
            ("fast-small", 300.0, 5),
            ("fast-small-late", 300.0, 5),
            ("unmeasured", None, None),
        ),
        lambda s: s,
    )
    assert [s.key for s in order] == ["fast-small", "fast-small-late", "fast", "slow", "unmeasured"]


def test_a_tie_moves_the_chosen_config_up_over_the_configs_it_tied_with_only():
    board = rows(("a", 314.0, 900), ("b", 300.0, 800), ("c", 266.0, 500))
    assert [s.key for s in ranked(board, lambda s: s, chosen="c", tied={"a", "b"})] == ["c", "a", "b"]
    # "a" measured clearly faster and was not part of the tie: the verdict does not reach over it.
    assert [s.key for s in ranked(board, lambda s: s, chosen="c", tied={"b"})] == ["a", "b", "c"]
    # A verdict whose winner is gone (or first already) changes nothing.
    assert [s.key for s in ranked(board, lambda s: s, chosen="zz", tied={"a"})] == ["a", "b", "c"]
