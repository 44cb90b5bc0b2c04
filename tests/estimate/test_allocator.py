"""The CUDA caching allocator model, on hand-made allocation sequences (no torch)."""

from __future__ import annotations

import pytest

from autotune.estimate.allocator import CachingAllocatorModel, round_size, segment_size

KiB, MiB = 2**10, 2**20


def test_request_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert segment_size(512) == segment_size(1 * MiB) == 2 * MiB  # small pool
    assert segment_size(1 * MiB + 512) == segment_size(9 * MiB) == 20 * MiB  # large, under 10 MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 1) == 12 * MiB


def test_small_requests_share_one_2mib_segment():
    a = CachingAllocatorModel()
    blocks = [a.malloc(100) for _ in range(8)]
    assert a.reserved == 2 * MiB and a.segments == 1
    assert a.allocated == 8 * 512
    for b in blocks:
        a.free(b)
    assert a.allocated == 0 and a.reserved == 2 * MiB  # segments are kept, not returned


def test_large_request_splits_a_20mib_segment_and_reuses_the_rest():
    a = CachingAllocatorModel()
    first = a.malloc(3 * MiB)
    second = a.malloc(5 * MiB)
    assert a.segments == 1 and a.reserved == 20 * MiB  # the second fits in the first's remainder
    assert a.allocated == 8 * MiB
    a.free(first)
    a.free(second)
    big = a.malloc(19 * MiB)  # the freed pieces merged back into one block
    assert a.segments == 1
    assert big.size == 20 * MiB  # remainder 1 MiB is not split off: counted as allocated
    assert a.peak_allocated == 20 * MiB


def test_best_fit_picks_the_smallest_free_block_that_fits():
    a = CachingAllocatorModel()
    x = a.malloc(40 * MiB)
    y = a.malloc(12 * MiB)
    a.free(x)
    a.free(y)
    c = a.malloc(11 * MiB)
    assert c.addr == y.addr and a.reserved == 52 * MiB


def test_fragmentation_makes_reserved_exceed_the_peak_allocated():
    a = CachingAllocatorModel()
    hold = []
    for _ in range(4):  # interleave long- and short-lived 12 MiB blocks in their own segments
        hold.append(a.malloc(12 * MiB))
        a.free(a.malloc(12 * MiB))
    a.malloc(24 * MiB)  # no free block of 24 MiB exists: a new segment
    assert a.peak_allocated == 72 * MiB
    assert a.peak_reserved == 84 * MiB > a.peak_allocated


def test_double_free_is_a_bug():
    a = CachingAllocatorModel()
    b = a.malloc(1 * KiB)
    a.free(b)
    with pytest.raises(ValueError):
        a.free(b)
