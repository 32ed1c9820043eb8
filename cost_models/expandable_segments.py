"""CUDA's caching allocator with expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`,
torchtitan's default and what `autoplan apply` runs CUDA ranks with): the same block logic as the native
allocator (cost_models.allocator), but memory comes from one growing segment per stream and pool instead of
one cudaMalloc per request.

As c10/cuda/CUDACachingAllocator.cpp has it (Note [Expandable Segments], try_allocate_expandable_block,
release_blocks):
- each stream gets, per pool, a segment that reserves a large virtual range and maps physical pages into it
  as needed: 2 MiB pages for the small pool, 20 MiB pages for the large pool (`PAGE`);
- a request is rounded as natively (512 B) and first served best-fit from the mapped free blocks of its pool
  and stream (among blocks that could grow the same way, the one that grows least); a block is split when
  at least 512 bytes remain, in both pools;
- when none fits, the allocator checks the limit with the request's native allocation size (a 1-10 MiB
  request counts 20 MiB, a larger one its size rounded to 2 MiB) against the memory mapped so far (torch's
  check under `set_per_process_memory_fraction`), then maps pages at the lowest address of the stream's
  segment where the request fits, using a free block just before the unmapped range where there is one
  (normally at the segment's end); pages that would take the mapped memory past the limit fail as the
  device's own memory does (cuMemCreate), so the model's limit is both the fraction and the device;
- a freed block merges with free mapped neighbours; under the limit the allocator unmaps every page of its
  free blocks that holds no allocated byte (in any stream's segment) and tries again, then fails.
So what a run needs stays near its live bytes: pages touched by live blocks, rounded per page, per stream.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from cost_models.allocator import (
    MIN_BLOCK,
    CachingAllocator,
    OutOfMemory,
    _Block,
    segment_size,
)

__all__ = ["PAGE", "ExpandableAllocator"]

PAGE = {True: 2 << 20, False: 20 << 20}  # mapping granularity: small pool 2 MiB, large pool 20 MiB
_SPAN = 1 << 44  # virtual address space a segment reserves (torch: 1 1/8 of the device's memory)
_SEGMENT_STRIDE = (20 << 20) << 24  # segments start at multiples of both pages, further apart than _SPAN


def _room(block: _Block) -> int:
    """A free block's size and the unmapped range right after it, if any: how far it could grow."""
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


class _NoPages(Exception):
    """Mapping the pages would pass the limit (the device has no more memory)."""


class ExpandableAllocator(CachingAllocator):
    """The caching allocator's block logic over expandable segments, in bytes; `limit` None means no limit.
    `reserved` is the memory mapped (torch's reserved_bytes)."""

    def __init__(self, limit: int | None = None):
        super().__init__(limit)
        self._unmapped: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # pool -> (stream, addr)
        self._unmapped_at: dict[tuple[int, int], _Block] = {}

    def empty_cache(self) -> None:
        """Unmap every page of a free block that holds no allocated byte (release_blocks)."""
        for small in (True, False):
            for key in list(self._free[small]):
                if key in self._by_key:
                    self._unmap(self._by_key[key])

    # -- finding and making room --------------------------------------------------------------

    def _find_free(self, size: int, stream: int, small: bool) -> _Block | None:
        """Best fit among the mapped free blocks; among a run of them, the one whose room to grow (its size
        plus an unmapped range right after it) is smallest (get_free_block)."""
        keys = self._free[small]
        i, end = bisect_left(keys, (stream, size, 0)), len(keys)
        if i == end or keys[i][0] != stream:
            return None
        by_key = self._by_key
        block = by_key[keys[i]]
        if i + 1 < end and keys[i + 1][0] == stream:  # larger blocks of the stream: one may have less room
            room = _room(block)
            while i + 1 < end and keys[i + 1][0] == stream:
                following = by_key[keys[i + 1]]
                following_room = _room(following)
                if following_room >= room:
                    break
                i, block, room = i + 1, following, following_room
        del by_key[keys[i]]
        del keys[i]
        return block

    def _grow(self, size: int, stream: int, small: bool, nbytes: int) -> _Block:
        """Map pages for the request (alloc_block, try_allocate_expandable_block), freeing the cache and
        trying again when the limit would be passed."""
        for attempt in (0, 1):
            demand = self.reserved + segment_size(size)
            if demand > self.demand:
                self.demand = demand
            if self.limit is None or demand <= self.limit:
                try:
                    return self._map_for(size, stream, small)
                except _NoPages:
                    pass
            if attempt == 0:
                self.retries += 1
                self.empty_cache()
        raise OutOfMemory(nbytes, self.reserved, self.allocated, self.limit)

    def _map_for(self, size: int, stream: int, small: bool) -> _Block:
        candidate = self._expandable_block(size, stream, small)
        if not candidate.mapped:
            candidate = self._map(candidate, min(candidate.size, size))
        while candidate.size < size:  # free -> unmapped -> ...: map into the unmapped range, merging
            candidate = self._map(candidate.next, min(size - candidate.size, candidate.next.size))
        self._take(candidate)
        return candidate

    def _expandable_block(self, size: int, stream: int, small: bool) -> _Block:
        """The lowest address of the stream's segments with room for `size` in free and unmapped blocks
        (find_expandable_block); a new segment where none has it."""
        keys = self._unmapped[small]
        for i in range(bisect_left(keys, (stream, 0)), len(keys)):
            if keys[i][0] != stream:
                break
            candidate = self._unmapped_at[keys[i]]
            if candidate.prev is not None and not candidate.prev.allocated:
                candidate = candidate.prev
            room, cursor = 0, candidate
            while room < size and cursor is not None and not cursor.allocated:
                room, cursor = room + cursor.size, cursor.next
            if room >= size:
                return candidate
        self._made += 1
        block = _Block(self._made * _SEGMENT_STRIDE, _SPAN, stream, small)
        block.mapped = False
        self.segments += 1
        self._put_unmapped(block)
        return block

    def _map(self, block: _Block, size: int) -> _Block:
        """Map the pages under the first `size` bytes of an unmapped block (page-aligned), leave the rest
        unmapped, and merge what was mapped with its free neighbours (map_block)."""
        page = PAGE[block.small]
        mapped = -(-size // page) * page
        demand = self.reserved + mapped
        if demand > self.demand:
            self.demand = demand
        if self.limit is not None and demand > self.limit:
            raise _NoPages
        self._take_unmapped(block)
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, block.stream, block.small)
            rest.mapped = False
            self._link_after(block, rest)
            block.size = mapped
            self._put_unmapped(rest)
        block.mapped = True
        self.reserved += mapped
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        merged = self._merge(self._merge(block, block.prev), block.next)
        self._put(merged)
        return merged

    def _unmap(self, block: _Block) -> None:
        """Unmap the whole pages inside a free block (unmap_block): its ends stay mapped free blocks."""
        page = PAGE[block.small]
        begin = -(-block.addr // page) * page
        end = (block.addr + block.size) // page * page
        if begin >= end:
            return
        self._take(block)
        if begin > block.addr:
            before = _Block(block.addr, begin - block.addr, block.stream, block.small)
            self._link_before(block, before)
            self._put(before)
        if end < block.addr + block.size:
            after = _Block(end, block.addr + block.size - end, block.stream, block.small)
            self._link_after(block, after)
            self._put(after)
        block.addr, block.size, block.mapped = begin, end - begin, False
        self.reserved -= end - begin
        merged = self._merge(self._merge(block, block.prev), block.next)
        if merged.prev is None and merged.next is None:  # the whole segment is unmapped: released
            self.segments -= 1
        else:
            self._put_unmapped(merged)

    # -- block lists ----------------------------------------------------------------------------

    def _blocks(self, handles: dict) -> list[_Block]:
        return [*super()._blocks(handles), *self._unmapped_at.values()]

    def _relist(self, twin: CachingAllocator, twin_of: dict) -> None:
        super()._relist(twin, twin_of)
        twin._unmapped = {small: keys.copy() for small, keys in self._unmapped.items()}
        twin._unmapped_at = {key: twin_of[block] for key, block in self._unmapped_at.items()}

    def _take_spare(self, block: _Block) -> None:
        """A free block off its list: the mapped free blocks', or the unmapped ranges'."""
        if block.mapped:
            self._take(block)
        else:
            self._take_unmapped(block)

    @staticmethod
    def _link_before(block: _Block, new: _Block) -> None:
        new.prev, new.next = block.prev, block
        if block.prev is not None:
            block.prev.next = new
        block.prev = new

    def _put_unmapped(self, block: _Block) -> None:
        key = (block.stream, block.addr)
        insort(self._unmapped[block.small], key)
        self._unmapped_at[key] = block

    def _take_unmapped(self, block: _Block) -> None:
        key = (block.stream, block.addr)
        keys = self._unmapped[block.small]
        del keys[bisect_left(keys, key)]
        del self._unmapped_at[key]

    def _should_split(self, block: _Block, size: int, remaining: int) -> bool:
        """At least MIN_BLOCK bytes left, in both pools (should_split with expandable segments)."""
        return remaining >= MIN_BLOCK
