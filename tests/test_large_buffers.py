"""FSDP2's copies and the CPU's freshly mapped memory in the step time (cost_models/large_buffers.py),
and the profiler's measurements behind them (autoplan/profiling/device.py)."""

import math
import subprocess
import sys

import pytest
import torch

from autoplan.profile_store import load_profile
from autoplan.profiling import device
from autoplan.profiling.timing import Repeats
from cost_models.large_buffers import buffer_s, gather_copy_s, optimizer_first_touch_s, reduce_copy_s
from cost_models.options import OPTIMIZERS, PRECISIONS
from cost_models.records import ParamInfo, Unit

# a CPU profile measured with glibc's default malloc, which maps large blocks fresh (0.28 ms per MB to touch);
# `autoplan profile` now measures as apply's ranks run, with freed memory kept mapped: its first touch is 0
CPU = load_profile("cpu-gloo-2").model_copy(update={"first_touch_s_per_byte": 2.77e-10})
GPU = load_profile("a100-sxm4-80gb")
BF16 = PRECISIONS["bf16-mixed"]
EMBEDDING = Unit(path="", params=[ParamInfo("wte.weight", (50257, 768))])  # gpt2's tied embedding
SMALL = Unit(path="h.0", params=[ParamInfo("w", (96, 96))])
FEW = Repeats(1, 3, 3, 0.0)


def test_large_buffers_pay_their_first_touch_small_ones_only_bandwidth():
    threshold = CPU.first_touch_min_bytes
    below, above = buffer_s(threshold - 1, CPU), buffer_s(threshold, CPU)
    assert above - below > 0.9 * threshold * CPU.first_touch_s_per_byte
    assert 0 < below < threshold * CPU.first_touch_s_per_byte


def test_gpu_profiles_charge_the_compute_streams_copies_at_hbm_bandwidth_and_no_first_touch():
    bandwidth = GPU.mem_bandwidth_bytes_s * GPU.mem_bandwidth_efficiency
    for unit in (EMBEDDING, SMALL):
        padded = sum(math.ceil(p.shape[0] / 8) * 8 * math.prod(p.shape[1:]) for p in unit.params)
        # the all-gather's copy-out (bf16, read and written); the gradients (bf16) into the fp32 reduction input
        assert gather_copy_s(unit, 8, BF16, GPU) == pytest.approx(2 * 2 * padded / bandwidth)
        assert reduce_copy_s(unit, 8, 1, BF16, GPU) == pytest.approx((2 + 4) * padded / bandwidth)
        assert optimizer_first_touch_s(unit, 8, BF16, OPTIMIZERS["adamw"], GPU) == 0.0


def test_a_real_vocabulary_costs_tens_of_milliseconds_a_tiny_unit_almost_nothing():
    gather, reduce = gather_copy_s(EMBEDDING, 2, BF16, CPU), reduce_copy_s(EMBEDDING, 2, 1, BF16, CPU)
    assert 0.02 < gather < 0.2 and 0.05 < reduce < 0.3
    assert gather_copy_s(SMALL, 2, BF16, CPU) + reduce_copy_s(SMALL, 2, 1, BF16, CPU) < 1e-4
    # AdamW's two fp32 temporaries of the 77 MB shard are mapped fresh; a 36 KB tensor's are not
    shard_bytes = 25129 * 768 * 4
    assert optimizer_first_touch_s(EMBEDDING, 2, BF16, OPTIMIZERS["adamw"], CPU) == 2 * shard_bytes * \
        CPU.first_touch_s_per_byte
    assert optimizer_first_touch_s(SMALL, 2, BF16, OPTIMIZERS["adamw"], CPU) == 0.0
    # without a shard group nothing is reduced on a single rank
    assert reduce_copy_s(EMBEDDING, 1, 1, BF16, CPU) == 0.0


def _first_touch_in_a_child(kept: bool) -> float:
    """device.first_touch_s_per_byte measured in a new process, with glibc's default malloc or with freed
    memory kept mapped (the setting lasts for the process it is made in: pytest's may have made it)."""
    code = ("import torch; from autoplan.profiling import device; from autoplan.profiling.timing import Repeats; "
            "from autoplan.run.host_memory import keep_freed_memory; "
            f"{'keep_freed_memory(); ' if kept else ''}"
            "print(device.first_touch_s_per_byte(torch.device('cpu'), Repeats(1, 3, 3, 0.0)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_profiler_measures_first_touch_and_a_per_rank_optimizer_rate():
    cpu = torch.device("cpu")
    # glibc maps the 128 MB buffer fresh each time: page faults (0.16-0.28 ms per MB here); a profile measured
    # with freed memory kept mapped records 0 instead (tests/test_profile_run.py)
    assert _first_touch_in_a_child(False) > 5e-11
    # per rank, with two ranks' optimizers stepping at once: at least 100 MB/s of state on any CPU
    assert device.adamw_bytes_s(cpu, FEW, 2) > 1e8


def test_gloo_gathers_a_large_unit_into_a_buffer_of_its_own():
    """Above the mmap threshold gloo's flat all-gather output is one more fresh buffer; below it the
    collective's fit holds it (the heap reuses it), and without a shard group there is no all-gather."""
    gathered = EMBEDDING.params[0].shape[0] * 768 * BF16.compute_bytes  # 2 x 25,129 rows of 768 (padded)
    assert gathered + 768 * BF16.compute_bytes >= CPU.first_touch_min_bytes
    one_buffer = buffer_s(25129 * 2 * 768 * BF16.compute_bytes, CPU)
    copy_in = buffer_s(25129 * 768 * BF16.compute_bytes, CPU)
    # copy-in, FSDP2's all-gather output, gloo's, the copy-out into the unsharded parameter
    assert abs(gather_copy_s(EMBEDDING, 2, BF16, CPU) - (copy_in + 3 * one_buffer)) < 1e-12
    small = gather_copy_s(SMALL, 2, BF16, CPU)
    assert abs(small - (buffer_s(48 * 96 * 2, CPU) + 2 * buffer_s(96 * 96 * 2, CPU))) < 1e-12
