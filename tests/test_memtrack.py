"""The live-tensor memory tracker counts known allocations exactly."""

import pytest
import torch

from autoplan.run.memtrack import LiveTensorTracker, MemoryLimitExceeded


def test_counts_live_storages_and_peak():
    with LiveTensorTracker() as tracker:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.zeros(250, dtype=torch.float64)  # 2000 bytes
        assert tracker.live_bytes == 6000
        view = a[10:]  # a view shares its base's storage: nothing new
        del a
        assert tracker.live_bytes == 6000
        del view
        assert tracker.live_bytes == 2000
        c = torch.ones(100, dtype=torch.int8)
        assert tracker.live_bytes == 2100
        assert tracker.peak_bytes == 6000
        tracker.reset_peak()
        assert tracker.peak_bytes == 2100
        del b, c
    assert tracker.live_bytes == 0


def test_follows_storage_resize_as_fsdp_does():
    # FSDP2 frees and re-allocates gathered parameters with UntypedStorage.resize_.
    with LiveTensorTracker() as tracker:
        t = torch.empty(1000)
        t.untyped_storage().resize_(0)
        assert tracker.live_bytes == 0
        t.untyped_storage().resize_(8000)
        assert tracker.live_bytes == 8000
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # unwrapped on exit


def test_counts_parameters_gradients_and_optimizer_states():
    with LiveTensorTracker() as tracker:
        linear = torch.nn.Linear(100, 100)  # 40_400 bytes of parameters
        optimizer = torch.optim.Adam(linear.parameters())
        assert tracker.live_bytes == 40_400
        x = torch.randn(8, 100)
        linear(x).sum().backward()
        optimizer.step()
        del x
        # parameters + gradients + two Adam states, and one 4-byte step counter per parameter
        assert tracker.live_bytes == 4 * 40_400 + 2 * 4
        optimizer.zero_grad(set_to_none=True)
        assert tracker.live_bytes == 3 * 40_400 + 2 * 4


def test_tracks_tensors_made_before_it_started():
    weights = torch.empty(500)
    with LiveTensorTracker() as tracker:
        tracker.track(weights)
        assert tracker.live_bytes == 2000
        weights.mul_(2)  # seen again: counted once
        assert tracker.live_bytes == 2000


def test_limit_raises_like_out_of_memory():
    with pytest.raises(MemoryLimitExceeded, match="over the limit of 10000 bytes") as info:
        with LiveTensorTracker(limit_bytes=10_000):
            a = torch.empty(2000)  # 8000 bytes
            b = torch.empty(2000)  # 16000 > 10000
    assert info.value.live_bytes == 16_000


def test_cuda_peaks_span_the_phases_whose_statistics_were_reset(monkeypatch):
    """peak_and_reset resets torch's CUDA peak statistics at each phase's end; the run's max allocated and
    reserved are the largest over all phases, not torch's figures since the last reset."""
    from autoplan.run.memtrack import RankMemory

    stats = {"allocated": 0, "reserved": 0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: stats.update(allocated=0, reserved=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stats["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: stats["reserved"])
    memory = RankMemory(torch.device("cuda", 0), None)
    stats.update(allocated=900, reserved=1000)  # the forward
    assert memory.peak_and_reset() == 900
    stats.update(allocated=300, reserved=950)  # the optimizer step
    assert memory.peak_and_reset() == 300
    stats.update(allocated=100, reserved=940)
    assert memory.cuda_peaks() == (900, 1000)


def test_sees_inside_dtensor_ops_but_not_their_sharding_propagation():
    """A DTensor op runs on local tensors inside DTensor's dispatch: their temporaries are real (loss_parallel's
    backward holds three fp32 logits shards inside one op) and are counted. DTensor first runs the op on fake tensors
    of the global shape to learn the output's shape: those allocate nothing and are not counted (the shape below is
    this test's own, so no earlier propagation of it is cached)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        local = torch.randn(61, 37)  # fp32: 9028 bytes a shard; the global [61, 148] is four times that
        x = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
        with LiveTensorTracker() as tracker:
            tracker.track(x)
            start = tracker.live_bytes
            y = x * 2
            assert tracker.peak_bytes - start == local.nbytes  # the local product alone, no global fake tensor
            assert tracker.live_bytes - start == local.nbytes
            del y
            logits = x.detach().requires_grad_()
            labels = torch.randint(0, 148, (61,))
            with loss_parallel():
                loss = F.cross_entropy(logits, labels)
                start = tracker.live_bytes
                tracker.reset_peak()
                loss.backward()
            assert tracker.peak_bytes - start >= 3 * local.nbytes  # zeros_like, exp and their sum at once
        restored = ShardingPropagator._propagate_tensor_meta_non_cached  # the tracker's wrapper removed on exit
        assert restored.__name__ == "_propagate_tensor_meta_non_cached"
    finally:
        dist.destroy_process_group()
