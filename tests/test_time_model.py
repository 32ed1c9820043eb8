"""The GPU time model's parts: a matmul's rate by its shape (tile and wave quantization), a fused attention
kernel's measured rate on the FLOPs it computes, collectives over a topology (NVSwitch, PCIe, the nodes' NICs;
ring against tree), and compute slowed by the SMs a running collective holds."""

import math

import pytest

from autoplan.profile_store import load_profile
from cost_models.comm import CommModel, topology_collective_s
from cost_models.compute import ComputeModel, attention_rate, matmul_shape_efficiency
from cost_models.profile import AttentionRate, MatmulShape, Topology
from cost_models.records import OpRecord
from cost_models.step import overlapped_s

A100 = MatmulShape(sm_count=108, full_wave_efficiency=0.88)
ONE_TILE = MatmulShape(sm_count=108, tiles=[(256, 128)], full_wave_efficiency=0.88)


def test_a_product_that_fills_its_waves_runs_at_the_full_wave_rate():
    # 64 x 64 tiles of 128x128 in 38 waves of 108
    assert matmul_shape_efficiency(8192, 8192, 8192, A100) == pytest.approx(4096 / (38 * 108))
    assert matmul_shape_efficiency(108 * 256, 128, 4096, A100) == 1.0  # exactly one wave of 256x128 tiles


def test_one_tile_too_many_costs_a_whole_wave():
    # 109 tiles of 256x128 on 108 SMs take two waves: about half the rate; smaller tiles waste less
    assert matmul_shape_efficiency(109 * 256, 128, 4096, ONE_TILE) == pytest.approx(109 / 216)
    assert matmul_shape_efficiency(109 * 256, 128, 4096, A100) == pytest.approx(218 / 324)


def test_a_product_with_few_tiles_is_split_along_k():
    # 4 output tiles alone would leave 104 SMs idle; split-K fills a wave where K is deep enough
    deep, shallow = matmul_shape_efficiency(256, 256, 8192, A100), matmul_shape_efficiency(256, 256, 128, A100)
    assert deep > 0.9 and shallow < 0.05


def _linear(m: int, k: int, n: int) -> OpRecord:
    return OpRecord("fc", "Linear", "fc", ((m, k),), "bf16", fwd_flops=2 * m * n * k, bwd_flops=4 * m * n * k,
                    fwd_bytes=2 * (m * k + k * n + m * n), bwd_bytes=4 * (m * k + k * n + m * n), is_matmul=True)


def test_a_matmuls_time_follows_its_shape_on_a_profile_that_models_it():
    profile = load_profile("a100-sxm4-80gb")
    profile = profile.model_copy(update={"matmul": ONE_TILE})
    flat = profile.model_copy(update={"matmul": None})
    shaped, plain = ComputeModel(profile, "bf16"), ComputeModel(flat, "bf16")
    big, ragged = _linear(8192, 8192, 8192), _linear(256, 8192, 109 * 128)  # 109 output tiles: two waves
    peak = profile.peak_flops["bf16"] * profile.matmul.full_wave_efficiency
    expected = big.fwd_flops / (peak * matmul_shape_efficiency(8192, 8192, 8192, profile.matmul))
    assert shaped.op_time_s(big, "fwd") == pytest.approx(expected + profile.op_overhead_s)
    # the ragged product's forward runs at about half the rate; the flat model misses it
    assert shaped.op_time_s(ragged, "fwd") > 1.8 * plain.op_time_s(ragged, "fwd")
    # its backward is two products of other shapes (M x K and N x K outputs), each at its own rate
    assert shaped.op_time_s(ragged, "bwd") < 2 * shaped.op_time_s(ragged, "fwd")


def _sdpa(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> OpRecord:
    flops = 4 * batch * heads * seq * seq * head_dim  # torch's FlopCounter: the full product, mask or not
    shape = (batch, heads, seq, head_dim)
    return OpRecord("attn", "scaled_dot_product_attention", "attn", (shape, shape, shape), "bf16",
                    fwd_flops=flops, bwd_flops=int(2.5 * flops), is_matmul=True,
                    variant=f"(is_causal={causal})")


def test_attention_runs_at_its_kernels_measured_rate_on_the_flops_it_computes():
    rates = [AttentionRate(head_dim=128, causal=True, seq_len=s, flops_s=r * 1e12)
             for s, r in ((2048, 155), (4096, 173), (8192, 182))]
    profile = load_profile("a100-sxm4-80gb").model_copy(update={"attention": rates})
    model = ComputeModel(profile, "bf16")
    op = _sdpa(1, 32, 4096, 128, causal=True)
    total = model.op_time_s(op, "fwd") + model.op_time_s(op, "bwd") - 2 * profile.op_overhead_s
    assert total == pytest.approx((op.fwd_flops + op.bwd_flops) / 2 / 173e12)  # a causal kernel computes half
    # between measured lengths the rate is interpolated in log2 of the length, and held beyond them
    assert attention_rate(rates, 128, int(2048 * math.sqrt(2)), True) == pytest.approx((155 + 173) / 2 * 1e12, 1e-4)
    assert attention_rate(rates, 128, 65536, True) == 182e12 and attention_rate(rates, 64, 512, True) == 155e12


NVSWITCH = Topology(intra_node="nvswitch", intra_bus_bytes_s=230e9, nics_per_node=8, nic_bytes_s=24e9,
                    base_latency_s=8.4e-6, intra_hop_latency_s=3.4e-6, inter_hop_latency_s=14e-6)


def test_a_ring_runs_at_its_slowest_link():
    size = 64 << 30  # large enough for the ring's latency not to count
    intra = topology_collective_s(NVSWITCH, "all_gather", size, 8, 8, 8)
    across = topology_collective_s(NVSWITCH, "all_gather", size, 64, 8, 8)
    assert 7 / 8 * size / intra == pytest.approx(230e9, rel=0.01)  # NVSwitch inside a node
    assert 63 / 64 * size / across == pytest.approx(192e9, rel=0.01)  # the node's 8 NICs between nodes
    # HSDP's replica groups: one rank per node, eight groups sharing the node's NICs: one NIC each
    replica = topology_collective_s(NVSWITCH, "all_reduce", size, 8, 1, 8)
    assert 2 * 7 / 8 * size / replica == pytest.approx(24e9, rel=0.02)


def test_latency_grows_with_ring_steps_and_a_tree_takes_small_all_reduces_across_many_nodes():
    small = 64 << 10
    assert (topology_collective_s(NVSWITCH, "all_gather", small, 512, 8, 8)
            > 5 * topology_collective_s(NVSWITCH, "all_gather", small, 16, 8, 8))
    ring_only = NVSWITCH.base_latency_s + 2 * (511 - 63) * 3.4e-6 + 2 * 63 * 14e-6
    tree = topology_collective_s(NVSWITCH, "all_reduce", small, 512, 8, 8)
    assert tree < ring_only  # NCCL's tree: latency logarithmic in the 64 nodes


def test_bridged_pairs_run_their_pair_over_nvlink_and_a_node_over_pcie():
    pairs = Topology(intra_node="nvlink_pairs", intra_bus_bytes_s=20e9, pair_bus_bytes_s=116e9, nics_per_node=8,
                     nic_bytes_s=46e9, base_latency_s=8.4e-6, intra_hop_latency_s=5.7e-6, inter_hop_latency_s=14e-6)
    size = 1 << 30
    assert size / 2 / topology_collective_s(pairs, "all_gather", size, 2, 2, 8) == pytest.approx(116e9, rel=0.01)
    assert 7 / 8 * size / topology_collective_s(pairs, "all_gather", size, 8, 8, 8) == pytest.approx(20e9, rel=0.01)


def test_a_measured_fit_of_the_same_group_comes_before_the_topology():
    profile = load_profile("a100-sxm4-80gb")
    [fit] = [f for f in profile.collectives if f.collective == "all_reduce" and f.group_size == 8]
    comm = CommModel(profile, gpus_per_node=8)
    assert comm.collective_s("all_reduce", 1e9, 8, "intra_node") == pytest.approx(fit.alpha_s + fit.beta_s_per_byte * 1e9)


def test_compute_runs_slower_while_a_collective_holds_some_sms():
    assert overlapped_s(10.0, 4.0, 0.25) == 11.0  # 4 s at 3/4 speed, then the rest
    assert overlapped_s(2.0, 4.0, 0.25) == 4.0  # the collective is longer: compute hides behind it
    assert overlapped_s(10.0, 4.0) == 10.0
