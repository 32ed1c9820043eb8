"""Collective time: by message size, group size and the links the group spans.

Lookup order:
1. a fit measured for this exact (collective, group size, link scope): what `autoplan profile` measured,
   or a published nccl-tests curve fitted (benchmarks/sourced_profiles.py);
2. the profile's topology (`Topology`), as NCCL itself models a collective (src/graph/tuning.cc): a
   ring over the group's ranks moves (n-1)/n of the buffer per rank for all-gather and reduce-scatter and
   2(n-1)/n for all-reduce (NCCL's "bus bandwidth" convention, nccl-tests doc/PERFORMANCE.md), at the bus
   bandwidth of the slowest link it crosses: the node's GPU links (NVSwitch, or PCIe between NVLink-bridged
   pairs), and between nodes the node's NICs (all of them for a ring over whole nodes; for HSDP's replica
   groups, one rank per node and one group per GPU of the node side by side, a 1/gpus-per-node share).
   Latency: NCCL's base latency per call, one per ring step inside a node and one per step between nodes.
   An all-reduce across nodes may take NCCL's tree instead (latency logarithmic in the nodes, the same
   bandwidth, NCCL's 0.92 tree efficiency): the faster of the two;
3. else the nearest measured group size rescaled by the ring's traffic factor, else the profile's link
   bus bandwidth with the ring factors (older profiles).
"""

from __future__ import annotations

import math

from cost_models.profile import DeviceProfile, Topology

TREE_EFFICIENCY = 0.92  # NCCL src/graph/tuning.cc: a tree's bus bandwidth is the link's times .92


def ring_factor(collective: str, group_size: int) -> float:
    share = (group_size - 1) / group_size
    return 2 * share if collective == "all_reduce" else share


class CommModel:
    """Collectives on `profile`'s devices, in nodes of `gpus_per_node` GPUs of which a group spanning nodes
    has `ranks_per_node` in each (the data-parallel ranks of a node: fewer than its GPUs beside tensor
    parallelism, whose groups then share the node's NICs); None: the whole group in one node."""

    def __init__(self, profile: DeviceProfile, gpus_per_node: int | None = None, ranks_per_node: int | None = None):
        self.profile = profile
        self.gpus_per_node = gpus_per_node
        self.ranks_per_node = ranks_per_node or gpus_per_node

    def collective_s(self, collective: str, nbytes: float, group_size: int, scope: str,
                     ranks_per_node: int | None = None) -> float:
        """Time of one collective over a full (unsharded) buffer of `nbytes`; 0 for a group of one.
        `ranks_per_node`: how many of the group's ranks share a node (None: as many as the node has GPUs,
        or the whole group inside one node; 1 for HSDP's replica groups)."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        fits = [f for f in self.profile.collectives if f.collective == collective and f.scope == scope]
        exact = [f for f in fits if f.group_size == group_size]
        if exact:
            return exact[0].alpha_s + exact[0].beta_s_per_byte * nbytes
        topology = self.profile.topology
        if topology is not None:
            per_node = self._ranks_per_node(group_size, scope, ranks_per_node)
            return topology_collective_s(topology, collective, nbytes, group_size, per_node,
                                         self.gpus_per_node or per_node)
        if fits:
            fit = min(fits, key=lambda f: (abs(f.group_size - group_size), -f.group_size))
            rescale = ring_factor(collective, group_size) / ring_factor(collective, fit.group_size)
            return fit.alpha_s + fit.beta_s_per_byte * rescale * nbytes
        link = self.profile.links.get(scope) or self.profile.links["intra_node"]
        return link.latency_s + ring_factor(collective, group_size) * nbytes / link.bus_bandwidth_bytes_s

    def _ranks_per_node(self, group_size: int, scope: str, ranks_per_node: int | None) -> int:
        if ranks_per_node is not None:
            return max(1, min(ranks_per_node, group_size))
        if scope == "intra_node" or not self.ranks_per_node:
            return group_size
        return min(self.ranks_per_node, group_size)


def topology_collective_s(topology: Topology, collective: str, nbytes: float, group_size: int,
                          ranks_per_node: int, gpus_per_node: int) -> float:
    """NCCL's ring (and tree, for an all-reduce across nodes) over `group_size` ranks, `ranks_per_node` of
    them in each node of `gpus_per_node` GPUs (see the module docstring)."""
    nodes = max(1, math.ceil(group_size / ranks_per_node))
    bus = math.inf
    if ranks_per_node > 1:
        bus = min(bus, _intra_bus(topology, ranks_per_node))
    if nodes > 1:
        node_net = topology.nics_per_node * topology.nic_bytes_s
        groups_side_by_side = max(1, gpus_per_node // ranks_per_node)  # each group has a share of the NICs
        bus = min(bus, node_net / groups_side_by_side)
    all_reduce = collective == "all_reduce"
    steps = (2 if all_reduce else 1) * (group_size - 1)
    inter_steps = (2 if all_reduce else 1) * (nodes - 1)
    intra_hop = topology.intra_hop_latency_s
    ring = (topology.base_latency_s + (steps - inter_steps) * intra_hop + inter_steps * topology.inter_hop_latency_s
            + ring_factor(collective, group_size) * nbytes / bus)
    if not all_reduce or nodes < 2:
        return ring
    tree = (topology.base_latency_s + 2 * ((ranks_per_node - 1) * intra_hop
                                           + math.log2(nodes) * topology.inter_hop_latency_s)
            + 2 * nbytes / (TREE_EFFICIENCY * bus))
    return min(ring, tree)


def _intra_bus(topology: Topology, ranks_per_node: int) -> float:
    """The ring's bus bandwidth inside a node: a bridged pair alone runs over its NVLink bridge."""
    if topology.intra_node == "nvlink_pairs" and ranks_per_node == 2 and topology.pair_bus_bytes_s:
        return topology.pair_bus_bytes_s
    return topology.intra_bus_bytes_s
