"""A model of PyTorch's CUDA caching allocator, replayed over a traced allocation sequence.

`torch.cuda.max_memory_allocated()` counts allocator *blocks*, not requested bytes, and
`max_memory_reserved()` counts the segments obtained from `cudaMalloc`. Both follow from the order
of allocations and frees, so replaying the traced sequence through the allocator's rules predicts
them. The rules (c10/cuda/CUDACachingAllocator.cpp, default settings: no
`PYTORCH_CUDA_ALLOC_CONF`, no expandable segments, one stream):

- a request is rounded up to a multiple of 512 bytes (at least 512);
- requests up to 1 MiB come from the small pool, carved out of 2 MiB segments; larger ones from
  the large pool, carved out of 20 MiB segments when under 10 MiB, else out of a segment of
  their own size rounded up to 2 MiB;
- a request takes the smallest cached free block of its pool that is large enough (best fit,
  lowest address on ties) and splits it when the remainder is at least 512 bytes (small pool) or
  more than 1 MiB (large pool); an unsplit block is allocated whole, slack included;
- a freed block merges with free neighbours of its segment; segments are never returned
  (no `empty_cache()`, and nothing here runs out of memory, which would release cached segments).

Pure Python and no torch, so it can be unit-tested on hand-made sequences.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from autotune.vocabulary.units import CUDA_BLOCK_BYTES, round_to_block

MIN_BLOCK = CUDA_BLOCK_BYTES  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: segment for large requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: rounding of large segments


def round_size(nbytes: int) -> int:
    """Block size the allocator hands out for a request (what `memory_allocated` counts)."""
    # round_to_block leaves 0 at 0 (nothing allocated); a block handed out is never below the minimum
    return max(MIN_BLOCK, round_to_block(nbytes))


def segment_size(rounded: int) -> int:
    """Size of the `cudaMalloc` made when no cached block fits."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    small: bool
    allocated: bool = False
    prev: "_Block | None" = None
    next: "_Block | None" = None


@dataclass
class CachingAllocatorModel:
    """Replays malloc/free in order; tracks allocated and reserved bytes and their peaks."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segments: int = 0
    _free: dict = field(default_factory=lambda: {True: [], False: []})  # small? -> sorted [(size, addr, id)]
    _blocks: dict = field(default_factory=dict)  # id(block) -> block, for the free lists
    _next_addr: int = 1 << 32

    def malloc(self, nbytes: int) -> _Block | None:
        """Allocate `nbytes`; returns the block (None for 0 bytes, which CUDA does not allocate)."""
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            _, _, bid = pool.pop(i)
            block = self._blocks.pop(bid)
        else:
            seg = segment_size(size)
            block = _Block(self._next_addr, seg, small)
            self._next_addr += seg + ROUND_LARGE  # segments are not contiguous: never merge across them
            self.reserved += seg
            self.segments += 1
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_SIZE):
            rest = _Block(block.addr + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert(rest)
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block | None) -> None:
        if block is None:
            return
        if not block.allocated:
            raise ValueError("block freed twice")
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._insert(block)

    def _insert(self, block: _Block) -> None:
        self._blocks[id(block)] = block
        bisect.insort(self._free[block.small], (block.size, block.addr, id(block)))

    def _remove(self, block: _Block) -> None:
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, (block.size, block.addr, id(block)))
        if i >= len(pool) or pool[i][2] != id(block):
            raise AssertionError("free block missing from its pool")
        pool.pop(i)
        del self._blocks[id(block)]
