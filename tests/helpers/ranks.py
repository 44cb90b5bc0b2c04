"""A multi-rank probe's peaks against the estimate of its rank (tests/estimate/test_ranks.py,
tests/probe/test_ranks.py)."""

from __future__ import annotations


def assert_rank_predicted(estimate, probe, largest_unit: int, what: object = None) -> None:
    """Every rank of `probe` (a 2-rank CPU probe of even shards) holds what `estimate` predicts for
    a rank, to the byte. One exception, a race in the CPU probe itself: gloo reduce-scatters a copy
    of the input that its worker thread frees, sometimes after the rank's main thread has gone on
    (seen in about one run of three, on one rank or on both): one unit's gradients more, at most
    `largest_unit` bytes (the largest unit's: the output head, vocabulary x width in fp32 with its
    norm)."""
    predicted = (estimate.peak_bytes, estimate.reserved_bytes)
    ranks = sorted((peaks["allocated"], peaks["reserved"]) for peaks in probe.rank_peaks)
    for held in ranks:
        extra = held[0] - predicted[0]
        assert extra == 0 or 0 < extra <= largest_unit, (what, ranks, predicted)
    if ranks[0][0] == predicted[0]:
        assert predicted == ranks[0], (what, ranks)
    assert estimate.per_rank and set(estimate.rank_peaks) == {"0"}  # (even shards: one rank traced)
    assert sum(estimate.breakdown.values()) == estimate.peak_bytes
