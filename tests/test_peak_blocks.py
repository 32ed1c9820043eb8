"""What was alive at a CUDA run's peak (autoplan.run.peak_blocks), from allocator events as torch records them."""

from autoplan.run.peak_blocks import live_at_peak


def _frames(*places):
    return [{"filename": f, "line": line, "name": name} for f, line, name in places]


TORCH = ("/site-packages/torch/nn/functional.py", 10, "linear")
FSDP = ("/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_param.py", 5, "alloc_all_gather_outputs")
MODEL = ("/repo/autoplan/models/llama.py", 80, "forward")


def test_the_blocks_alive_at_the_peak_grouped_by_where_they_were_allocated():
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames(FSDP)},
        {"action": "alloc", "addr": 2, "size": 40, "frames": _frames(TORCH, MODEL)},
        {"action": "alloc", "addr": 3, "size": 40, "frames": _frames(TORCH, MODEL)},
        {"action": "free_requested", "addr": 1, "size": 100},  # a stream still uses it: allocated until completed
        {"action": "alloc", "addr": 4, "size": 30, "frames": _frames(TORCH, MODEL)},  # the peak: 210
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 99, "size": 500},  # allocated before the recording: not counted
        {"action": "alloc", "addr": 5, "size": 80, "frames": []},  # 190: below the peak
    ]
    peak = live_at_peak(events)
    assert (peak["peak_bytes"], peak["event_index"], peak["blocks"]) == (210, 4, 4)
    groups = [(g["bytes"], g["blocks"], g["block_bytes"]) for g in peak["groups"]]
    assert groups == [(100, 1, 100), (80, 2, 40), (30, 1, 30)]
    assert peak["groups"][1]["where"] == "nn/functional.py:10 linear <- models/llama.py:80 forward"
    assert live_at_peak(events, top=1)["groups"] == peak["groups"][:1]


def test_no_events_no_peak():
    assert live_at_peak([]) == {"peak_bytes": 0, "event_index": -1, "events": 0, "blocks": 0, "groups": []}
