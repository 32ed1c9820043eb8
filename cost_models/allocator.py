"""CUDA's caching allocator: what a plan reserves beyond what it allocates, and what makes a run fail.

Why: a CUDA run does not fail when its live tensors reach the device's size but when torch's caching
allocator (c10/cuda/CUDACachingAllocator.cpp) cannot find or make a block. It rounds every request, carves
requests out of segments it got from cudaMalloc, keeps freed blocks cached per stream, and splits and merges
blocks inside a segment, so `max_memory_reserved` runs above `max_memory_allocated`. autoplan's memory model
predicts live bytes (allocated); this module gives the reserved figure beside it.

Two parts:
- `CachingAllocator`: a small, faithful model of the native allocator's block logic (no expandable segments,
  no CUDA graphs, no garbage-collection threshold), to replay a step's allocations and frees:
  * a request is rounded up to a multiple of 512 bytes (at least 512);
  * rounded requests of at most 1 MiB come from the small pool, carved out of 2 MiB segments; larger ones
    from the large pool: under 10 MiB out of 20 MiB segments, from 10 MiB on out of a segment of their size
    rounded up to 2 MiB;
  * a free block is found best-fit (the smallest cached block of the same pool and stream that is large
    enough, lowest address among equals); blocks are cached per stream and never serve another stream;
  * a found or new block is split when what remains is at least 512 bytes (small pool) or more than 1 MiB
    (large pool), the remainder cached; a freed block merges with free neighbours of its segment;
  * `max_split_size`: blocks at least that large are never split, and serve only requests at least that
    large within 20 MiB of their size;
  * when the limit (`set_per_process_memory_fraction`, or the device) would be passed by a new segment,
    the allocator frees every cached segment that holds no allocated block and tries again; if that fails
    too, the run fails (torch.cuda.OutOfMemoryError).
  cost_models.allocator_replay runs a recorded event sequence through it (or through the expandable
  segments' variant, cost_models.expandable_segments) and finds the smallest limit a sequence runs in without
  an out-of-memory error: what the plan's limit has to cover.
- `reserved_bound`: the plan-level figure from the cost model's allocated peak, fitted on such replays of
  real plans (benchmarks/allocator.py; the evidence is in benchmarks/RESULTS.md, "CUDA caching allocator").
"""

from __future__ import annotations

import copy
import math
from bisect import bisect_left, insort

__all__ = ["CachingAllocator", "OutOfMemory", "round_size", "segment_size", "reserved_bound", "FRAGMENTATION",
           "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE"]

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to 1 MiB come from the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: the small pool's segments
LARGE_BUFFER = 20 << 20  # kLargeBuffer: segments for large requests under 10 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: requests from 10 MiB on get their own segment, rounded to 2 MiB
_EXACT = 1 << 53  # up to here round_size's float division is exact: rounding in integers gives the same size

# The plan-level allowance: the smallest limit a plan's step runs in is at most (1 + FRAGMENTATION) x its
# allocated peak + SEGMENT_SLACK. From the replays of benchmarks/allocator.py (llama2-7b / llama3-8b, rank 0 of 8,
# H100 profile): needed / predicted allocated 1.008-1.185 (llama3-8b all-shard + full checkpointing at micro-batch
# 2 x 8192 tokens the worst, selective 1.12, the rest 1.01-1.09); the factor covers the worst, and the slack the
# cuBLAS workspaces and kernel scratch that fake tensors do not allocate (a few MiB per handle and stream).
FRAGMENTATION = 0.19
SEGMENT_SLACK = 64 << 20


def round_size(nbytes: int) -> int:
    """The block size a request of `nbytes` gets (round_size, without roundup_power2_divisions)."""
    if nbytes.__class__ is int and MIN_BLOCK < nbytes <= _EXACT:  # in integers: the float division's result, exactly
        return (nbytes + MIN_BLOCK - 1) & -MIN_BLOCK
    if nbytes < 0:
        raise ValueError(f"a request of {nbytes} bytes: sizes are at least 0")
    return max(MIN_BLOCK, MIN_BLOCK * math.ceil(nbytes / MIN_BLOCK))


def segment_size(rounded: int) -> int:
    """The cudaMalloc size for a rounded request no cached block can serve (get_allocation_size)."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(rounded / ROUND_LARGE)


class OutOfMemory(RuntimeError):
    """The model's torch.cuda.OutOfMemoryError: no cached block fits and no new segment fits the limit."""

    def __init__(self, nbytes: int, reserved: int, allocated: int, limit: int):
        super().__init__(f"could not allocate {nbytes} bytes: {reserved} reserved ({allocated} allocated) "
                         f"of a {limit}-byte limit")
        self.nbytes = nbytes


class _Block:
    __slots__ = ("addr", "size", "stream", "small", "allocated", "prev", "next", "requested", "mapped")

    def __init__(self, addr: int, size: int, stream: int, small: bool):
        self.addr, self.size, self.stream, self.small = addr, size, stream, small
        self.allocated = False
        self.mapped = True  # backed by memory (an expandable segment's unmapped range is not)
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.requested = 0

    @property
    def whole_segment(self) -> bool:
        return self.prev is None and self.next is None


class CachingAllocator:
    """The native caching allocator's block logic, in bytes; `limit` None means no limit.

    The free blocks of each pool are kept as sorted keys (stream, size, address: BlockComparatorSize) with a map
    from key to block. `demand`: the largest figure compared with the limit so far, the reserved bytes plus what a
    request would add to them (checked with a limit or not); a run under a limit of at least that has gone exactly
    as the run without one (allocator_replay.min_limit goes on from such a point)."""

    def __init__(self, limit: int | None = None, max_split_size: int | None = None):
        self.limit = limit
        self.max_split_size = max_split_size if max_split_size is not None else 1 << 62
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # pool -> sorted keys
        self._by_key: dict[tuple[int, int, int], _Block] = {}
        self._made = 0  # segments made so far: the next one's address range
        self.allocated = self.reserved = self.requested = 0
        self.peak_allocated = self.peak_reserved = self.peak_requested = 0
        self.segments = self.retries = self.demand = 0

    # -- public -------------------------------------------------------------------------------

    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._find_free(size, stream, small)
        if block is None:
            block = self._grow(size, stream, small, nbytes)
        if block.size > size:  # a block of the size asked for is never split, whatever the pool
            self._split(block, size)
        block.allocated, block.requested = True, nbytes
        allocated = self.allocated = self.allocated + block.size
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated
        requested = self.requested = self.requested + nbytes
        if requested > self.peak_requested:
            self.peak_requested = requested
        return block

    def free(self, block: _Block) -> None:
        if not block.allocated:
            raise ValueError("the block is not allocated (freed twice?)")
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        if block.prev is not None and not block.prev.allocated:
            self._merge(block, block.prev)
        if block.next is not None and not block.next.allocated:
            self._merge(block, block.next)
        self._put(block)

    def empty_cache(self) -> None:
        """Free every cached segment that holds no allocated block (release_cached_blocks)."""
        for small in (True, False):
            for key in list(self._free[small]):
                block = self._by_key[key]
                if block.whole_segment:
                    self._take(block)
                    self.reserved -= block.size
                    self.segments -= 1

    def cache_serves(self, nbytes: int, stream: int = 0) -> bool:
        """Whether a free block would serve the request: malloc would take no new memory (nor check the limit)."""
        size = round_size(nbytes)
        keys = self._free[size <= SMALL_SIZE]
        i = bisect_left(keys, (stream, size, 0))
        return i < len(keys) and keys[i][0] == stream and self._fits(size, keys[i][1])

    def fork(self, handles: dict) -> tuple[CachingAllocator, dict]:
        """A copy of the allocator's state to go on from, and `handles` (any keys -> the blocks allocated here, every
        one of them) with the copy's blocks."""
        twin = copy.copy(self)  # the counters and settings; the blocks and their lists are copied below
        twin_of: dict = {None: None}
        for block in self._blocks(handles):  # each block's fields (without __init__: a fork copies ~100 blocks)
            new = twin_of[block] = _Block.__new__(_Block)
            new.addr, new.size, new.stream, new.small = block.addr, block.size, block.stream, block.small
            new.allocated, new.mapped, new.requested = block.allocated, block.mapped, block.requested
        for block, new in twin_of.items():  # and their links
            if block is not None:
                new.prev, new.next = twin_of[block.prev], twin_of[block.next]
        self._relist(twin, twin_of)
        return twin, {key: twin_of[block] for key, block in handles.items()}

    def layout(self, handles: dict, role) -> tuple:
        """The allocator's state as what decides its next moves: its segments in address order (a new segment
        always lies above the others, and only the order of addresses breaks ties), each as its blocks' sizes,
        streams, pools, whether mapped and, where allocated, `role(key)` of the key `handles` (key -> block) holds
        it under. Two states of equal layout serve the same requests alike."""
        held = {id(block): key for key, block in handles.items()}
        segments = []
        for head in sorted((b for b in self._blocks(handles) if b.prev is None), key=lambda b: b.addr):
            blocks, block = [], head
            while block is not None:
                blocks.append((block.size, block.stream, block.small, block.mapped,
                               role(held[id(block)]) if block.allocated else None))
                block = block.next
            segments.append(tuple(blocks))
        return tuple(segments)

    # -- internals ----------------------------------------------------------------------------

    def _blocks(self, handles: dict) -> list[_Block]:
        """Every block: the allocated ones (`handles`) and the free ones."""
        return [*handles.values(), *self._by_key.values()]

    def _relist(self, twin: CachingAllocator, twin_of: dict) -> None:
        """`twin`'s free lists: this allocator's, of the blocks' copies."""
        twin._free = {small: keys.copy() for small, keys in self._free.items()}
        twin._by_key = {key: twin_of[block] for key, block in self._by_key.items()}

    def _put(self, block: _Block) -> None:
        key = (block.stream, block.size, block.addr)
        insort(self._free[block.small], key)
        self._by_key[key] = block

    def _take(self, block: _Block) -> None:
        key = (block.stream, block.size, block.addr)
        keys = self._free[block.small]
        del keys[bisect_left(keys, key)]
        del self._by_key[key]

    def _find_free(self, size: int, stream: int, small: bool) -> _Block | None:
        keys = self._free[small]
        i = bisect_left(keys, (stream, size, 0))
        if i == len(keys):
            return None
        key = keys[i]
        if key[0] != stream:
            return None
        if not self._fits(size, key[1]):
            return None
        del keys[i]
        return self._by_key.pop(key)

    def _fits(self, size: int, found: int) -> bool:
        """Whether a free block of `found` bytes may serve a request of `size` under max_split_size."""
        if size < self.max_split_size <= found:  # no oversized block for a request under max_split_size
            return False
        return size < self.max_split_size or found < size + LARGE_BUFFER

    def _grow(self, size: int, stream: int, small: bool, nbytes: int) -> _Block:
        """A new segment for a request no cached block serves (alloc_block), the cache freed first where the
        limit would be passed."""
        seg = segment_size(size)
        demand = self.reserved + seg
        if demand > self.demand:
            self.demand = demand
        if self.limit is not None and demand > self.limit:
            self.retries += 1
            self.empty_cache()  # release_cached_blocks, then alloc_block again
            if self.reserved + seg > self.limit:
                raise OutOfMemory(nbytes, self.reserved, self.allocated, self.limit)
        self.reserved += seg
        self.segments += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        # segments never touch: each gets its own address range, so blocks merge only inside one
        self._made += 1
        return _Block(self._made << 48, seg, stream, small)

    def _split(self, block: _Block, size: int) -> None:
        """Split off what the request leaves, a free block, where the pool's rule says to (should_split)."""
        remaining = block.size - size
        if not self._should_split(block, size, remaining):
            return
        rest = _Block(block.addr + size, remaining, block.stream, block.small)
        self._link_after(block, rest)
        block.size = size
        self._put(rest)

    def _should_split(self, block: _Block, size: int, remaining: int) -> bool:
        if block.small:
            return remaining >= MIN_BLOCK
        return size < self.max_split_size and remaining > SMALL_SIZE

    def _merge(self, block: _Block, neighbour: _Block | None) -> _Block:
        """`block` with a free neighbour of the same mapped state merged into it (try_merge_blocks); the
        neighbour is taken off its list. Returns `block`."""
        if neighbour is None or neighbour.allocated or neighbour.mapped != block.mapped:
            return block
        self._take_spare(neighbour)
        if neighbour is block.prev:
            block.addr, block.prev = neighbour.addr, neighbour.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
        block.size += neighbour.size
        return block

    def _take_spare(self, block: _Block) -> None:
        """A free block off the list it is kept on (natively every free block is on the free lists)."""
        self._take(block)

    @staticmethod
    def _link_after(block: _Block, new: _Block) -> None:
        new.prev, new.next = block, block.next
        if block.next is not None:
            block.next.prev = new
        block.next = new


def reserved_bound(allocated_peak_bytes: int) -> int:
    """What a plan whose predicted allocated peak is `allocated_peak_bytes` needs its limit to hold on CUDA:
    the caching allocator's rounding, per-stream caches and fragmentation, as fitted by benchmarks/allocator.py."""
    if allocated_peak_bytes < 0:
        raise ValueError(f"an allocated peak of {allocated_peak_bytes} bytes: peaks are at least 0")
    return int(math.ceil(allocated_peak_bytes * (1 + FRAGMENTATION))) + SEGMENT_SLACK
