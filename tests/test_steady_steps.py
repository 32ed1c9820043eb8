"""A replay measures what the caching allocator needs once its cache has settled: the recorded steps' last one
repeated (cost_models/steady_steps.py) until the allocator's layout comes round again
(cost_models/allocator_replay.py), and the recording's optimizer stepping local shards
(autoplan/run/allocator_fit.py)."""

import pytest

import autoplan
from autoplan.run.allocator_fit import record_steady, record_step, replay_events, replay_plan
from cost_models.allocator_replay import run_and_min_limit
from cost_models.steady_steps import repeat_steps

# four gpt2-1.5b blocks at 2 x 1024 tokens: natively the need grows after the third step, the loss's fp32 logits
# segment taken by a smaller block one step and needed whole the next
MODEL = "gpt2-1.5b[n_layers=4]"
NATIVE = "expandable_segments:False"


@pytest.fixture(scope="module")
def plan():
    return autoplan.search(MODEL, "3GB", gpus=8, profile="h100-sxm-80gb", seq_len=1024, batch_size=2,
                           allocator_conf=NATIVE)


def canonical(events):
    """Events with each key named by the order of its allocation (keys differ from one recording to the next)."""
    names: dict = {}
    return [(event[0], names.setdefault(event[1], len(names)), *event[2:]) for event in events]


def test_a_repeated_step_is_the_step_a_longer_recording_makes(plan):
    recorded, starts = record_step(plan, steps=5)
    steps = repeat_steps(*record_step(plan), steps=5)
    assert steps.recorded == 3 and steps.recorded_end() < len(steps.events)
    assert canonical(steps.events) == canonical(recorded) and steps.starts == starts


def test_the_replay_needs_what_the_settled_cache_needs_not_what_three_steps_do(plan):
    recorded, starts = record_step(plan, steps=6)
    firsts = [start for start in starts if start >= 0]
    three = replay_events(recorded[:firsts[3]], expandable=False).needed_bytes
    six = replay_events(recorded, expandable=False).needed_bytes
    assert six > three * 1.05  # the fourth step strands what the first three did not
    assert replay_plan(plan).needed_bytes == six  # settled by the sixth step: the replay carries the steps on


def test_a_replay_that_stops_where_the_allocator_has_settled_finds_what_one_to_the_end_does(plan):
    steps = record_steady(plan)
    assert len([start for start in steps.starts if start >= 0]) == 20  # STEADY_STEPS
    for expandable in (False, True):
        settled = run_and_min_limit(steps.events, expandable=expandable, settle=steps)
        whole = run_and_min_limit(steps.events, expandable=expandable)
        assert settled[1] == whole[1] and settled[0].peak_reserved == whole[0].peak_reserved


def test_steps_that_differ_are_not_repeated():
    events = [("alloc", 1, 4 << 20, 0), ("free", 1), ("alloc", 2, 4 << 20, 0), ("free", 2),
              ("alloc", 3, 8 << 20, 0), ("free", 3)]
    steps = repeat_steps(events, [0, 2, 4], steps=10)
    assert steps.recorded is None and steps.events == events  # the third step is not the second: left as recorded
    alike = repeat_steps(events[:4] + [("alloc", 3, 4 << 20, 0), ("free", 3)], [0, 2, 4], steps=10)
    assert alike.recorded == 3 and len(alike.events) == 20


def test_the_recording_steps_the_optimizer_on_local_shards_with_the_same_allocations():
    llama = "llama-tiny[d_model=512,n_heads=8,n_kv_heads=4,ffn_hidden=1408,vocab_size=32000]"
    plan = autoplan.search(llama, "520MB", gpus=8, profile="h100-sxm-80gb", seq_len=128, batch_size=4, tp=2)
    assert plan.cluster.tp_degree == 2  # parameters sharded over a 2-D mesh
    shards, _ = record_step(plan, steps=3)
    dtensors, _ = record_step(plan, steps=3, shard_optimizer=False)
    assert canonical(shards) == canonical(dtensors)
