"""The caching-allocator model (cost_models/allocator.py) on hand-made sequences, and the plan's reserved figure."""

from __future__ import annotations

import json

import pytest

import autoplan
from autoplan.errors import UsageError
from autoplan.plan.report import format_plan
from autoplan.plan.schema import Plan
from cost_models.allocator import (
    CachingAllocator,
    OutOfMemory,
    reserved_bound,
    round_size,
    segment_size,
)
from cost_models.allocator_conf import ALLOC_CONF_ENVS
from cost_models.allocator_margin import (
    expandable_margin,
    needed_bytes,
    needed_of_parts,
    reserved_bytes,
)
from cost_models.allocator_replay import min_limit, replay, stranded

MiB = 1 << 20


def test_requests_are_rounded_to_512_bytes_and_segments_by_pool():
    assert [round_size(n) for n in (0, 1, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    assert segment_size(round_size(MiB)) == 2 * MiB  # the small pool's 2 MiB segments
    assert segment_size(round_size(MiB + 1)) == 20 * MiB  # 1-10 MiB: carved out of 20 MiB segments
    assert segment_size(10 * MiB) == 10 * MiB  # from 10 MiB on: its own segment, rounded to 2 MiB
    assert segment_size(round_size(11 * MiB + 1)) == 12 * MiB
    with pytest.raises(ValueError, match="at least 0"):
        round_size(-1)


def test_small_requests_share_a_2_mib_segment_and_large_ones_a_20_mib_one():
    a = CachingAllocator()
    a.malloc(600 * 1024)
    a.malloc(600 * 1024 + 1)  # rounded to 600.5 KiB, from the rest of the same segment
    assert (a.reserved, a.allocated, a.requested) == (2 * MiB, 1200 * 1024 + 512, 1200 * 1024 + 1)
    a.malloc(5 * MiB)
    a.malloc(5 * MiB)  # the 15 MiB left of the first 20 MiB segment is split again
    assert a.reserved == 22 * MiB and a.segments == 2


def test_freed_blocks_merge_and_serve_a_larger_request_of_the_same_stream_only():
    a = CachingAllocator()
    blocks = [a.malloc(5 * MiB) for _ in range(3)]  # 15 MiB of one 20 MiB segment
    for block in blocks:
        a.free(block)
    a.malloc(18 * MiB)  # the merged 20 MiB block, best fit, split (2 MiB left)
    assert a.reserved == 20 * MiB
    a.malloc(MiB + 512, stream=1)  # another stream never gets the cached 2 MiB: a new segment
    assert a.reserved == 40 * MiB
    with pytest.raises(ValueError, match="freed twice"):
        a.free(blocks[0])


def test_under_a_limit_the_cache_is_freed_before_running_out():
    events = [("alloc", "a", 12 * MiB, 0), ("free", "a"), ("alloc", "b", 14 * MiB, 0)]
    assert replay(events).peak_reserved == 26 * MiB  # the freed 12 MiB segment stays cached
    fitted = replay(events, limit=20 * MiB)
    assert fitted.peak_reserved == 14 * MiB and fitted.retries == 1
    with pytest.raises(OutOfMemory):
        replay([("alloc", "a", 12 * MiB, 0), ("alloc", "b", 14 * MiB, 0)], limit=25 * MiB)
    assert min_limit(events) == 14 * MiB


def test_fragmentation_between_live_blocks_costs_a_new_segment():
    # three 4 MiB blocks in a 20 MiB segment, the middle one freed: a 4 MiB hole and 8 MiB free at the end,
    # and a 13 MiB request fits in neither
    events = [("alloc", i, 4 * MiB, 0) for i in range(3)] + [("free", 1), ("alloc", "big", 13 * MiB, 0)]
    assert min_limit(events) == 34 * MiB  # 20 MiB segment (still split: not releasable) + 14 MiB
    with pytest.raises(ValueError, match="unknown event"):
        replay([("realloc", 0)])


def test_stranded_names_the_free_space_a_live_block_keeps_where_a_limit_just_under_the_need_fails():
    # the last step's 100 MiB block is freed; a 30 MiB block best-fits into its segment and splits it, so the next
    # 100 MiB needs a segment of its own: 70 MiB stranded in the 100 MiB segment, 16 in the 4 MiB block's 20 MiB one
    events = [("alloc", "logits", 100 * MiB, 0), ("alloc", "x", 4 * MiB, 0), ("free", "logits"),
              ("alloc", "act", 30 * MiB, 0), ("alloc", "logits2", 100 * MiB, 0)]
    need = min_limit(events)
    assert need == 220 * MiB
    assert stranded(events, need) is None  # it runs
    where = stranded(events, need - 2 * MiB)
    assert (where.event, where.request, where.stream) == (4, 100 * MiB, 0)
    assert where.by_segment == {100 * MiB: 70 * MiB, 20 * MiB: 16 * MiB} and where.total == 86 * MiB
    assert (where.reserved, where.allocated) == (120 * MiB, 34 * MiB)


def test_the_bound_is_at_least_the_allocated_peak():
    assert reserved_bound(10 * 2 ** 30) >= 10 * 2 ** 30
    with pytest.raises(ValueError):
        reserved_bound(-1)


@pytest.fixture(scope="module")
def traced():
    return autoplan.trace("gpt2-tiny", seq_len=32)


def test_a_cuda_plan_carries_what_the_allocator_needs_and_a_cpu_plan_does_not(traced, monkeypatch):
    for name in ALLOC_CONF_ENVS:
        monkeypatch.delenv(name, raising=False)
    cuda = autoplan.search(traced, "80GB", gpus=2, profile="h100-sxm-80gb")
    p = cuda.predicted
    assert cuda.cluster.allocator_conf == "expandable_segments:True" and cuda.cluster.mem_fitted_to == "needed"
    timeline = [{k.removesuffix("_bytes"): v for k, v in t.breakdown.model_dump().items()} for t in p.timeline]
    selective = sum(u.predicted.activation_bytes for u in cuda.units if u.checkpoint == "selective")
    margin = expandable_margin(0.0)  # gpt2-tiny's tensors are all under 1 MiB: none the simulation counts strands
    assert p.needed_bytes == needed_of_parts(timeline, "expandable_segments:True", selective, margin) > p.peak_mem_bytes
    assert p.needed_bytes <= needed_bytes(p.peak_mem_bytes, "expandable_segments:True")  # the flat bound: looser
    assert p.reserved_bytes == reserved_bytes(p.peak_mem_bytes, "expandable_segments:True")
    assert "needed (CUDA caching allocator, expandable_segments:True)" in format_plan(cuda)
    cpu = autoplan.search(traced, "20MB", gpus=2, profile="cpu-gloo-2")
    assert cpu.predicted.needed_bytes is None and cpu.cluster.allocator_conf is None
    assert "needed_bytes" not in json.dumps(cpu.model_dump(mode="json"))
    assert "caching allocator" not in format_plan(cpu)
    older = cuda.model_dump(mode="json")
    for field in ("needed_bytes", "reserved_bytes"):
        del older["predicted"][field]  # a plan written before the fields loads, fitted to its live bytes
    del older["cluster"]["allocator_conf"], older["cluster"]["mem_fitted_to"]
    loaded = Plan.model_validate(older)
    assert loaded.predicted.needed_bytes is None and loaded.cluster.mem_fitted_to == "allocated"


# -- expandable segments (cost_models/expandable_segments.py) -----------------------------------------------


def test_expandable_segments_pack_large_requests_into_20_mib_pages():
    from cost_models.expandable_segments import ExpandableAllocator

    a = ExpandableAllocator()
    a.malloc(5 * MiB)  # one 20 MiB page mapped, 15 MiB of it free after the block
    a.malloc(30 * MiB)  # the free 15 MiB and one more page: contiguous, no second segment
    assert (a.reserved, a.allocated) == (40 * MiB, 35 * MiB)
    native = CachingAllocator()
    native.malloc(5 * MiB)
    native.malloc(30 * MiB)  # a 20 MiB segment, then one of its own
    assert native.reserved == 50 * MiB
    small = ExpandableAllocator()
    for _ in range(4):
        small.malloc(600 * 1024)  # the small pool maps 2 MiB pages
    assert small.reserved == 4 * MiB


def test_expandable_segments_unmap_whole_free_pages_under_a_limit_and_keep_partial_ones():
    whole = [("alloc", "a", 40 * MiB, 0), ("free", "a"), ("alloc", "b", 40 * MiB, 1)]
    assert replay(whole, expandable=True).peak_reserved == 80 * MiB  # each stream keeps its pages
    assert min_limit(whole, expandable=True) == 40 * MiB  # under a limit stream 0's free pages are unmapped
    partial = [("alloc", "a", 10 * MiB, 0), ("alloc", "b", 10 * MiB, 0), ("free", "a"),
               ("alloc", "c", 30 * MiB, 1)]
    # a and b share one 20 MiB page: freeing a frees no whole page, so stream 1's 40 MiB come on top
    assert min_limit(partial, expandable=True) == 60 * MiB
    # natively a had a segment of its own (10 MiB and more), which the limit frees
    assert min_limit(partial) == 40 * MiB
    with pytest.raises(OutOfMemory):
        replay(partial, 58 * MiB, expandable=True)


def test_expandable_segments_merge_freed_blocks_and_count_requests_like_the_native_allocator():
    from cost_models.expandable_segments import ExpandableAllocator

    a = ExpandableAllocator()
    blocks = [a.malloc(6 * MiB + 1) for _ in range(3)]  # rounded to 512 B each, packed one after another
    assert a.allocated == 3 * (6 * MiB + 512) and a.requested == 3 * (6 * MiB + 1) and a.reserved == 20 * MiB
    for block in blocks:
        a.free(block)
    a.malloc(18 * MiB)  # the three merged with the page's free tail: no new page
    assert a.reserved == 20 * MiB and a.segments == 1
    with pytest.raises(ValueError, match="freed twice"):
        a.free(blocks[0])


def test_two_differing_allocator_configurations_in_the_environment_are_refused(traced, monkeypatch):
    """PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF both name torch's allocator configuration, and torch releases
    differ in which they apply: set both, differing in what the model reads, and no plan is made for either."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    with pytest.raises(UsageError, match="are both set and differ.*or give --allocator-conf"):
        autoplan.search(traced, "80GB", gpus=2, profile="h100-sxm-80gb")
    plan = autoplan.search(traced, "80GB", gpus=2, profile="h100-sxm-80gb", allocator_conf="expandable_segments:False")
    assert plan.cluster.allocator_conf == "expandable_segments:False"  # the flag decides
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True,garbage_collection_threshold:0.8")
    assert autoplan.search(traced, "80GB", gpus=2, profile="h100-sxm-80gb").cluster.allocator_conf == (
        "expandable_segments:True")  # alike in what the model reads: PYTORCH_CUDA_ALLOC_CONF, read first
