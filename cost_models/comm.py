"""Collective time: alpha-beta per collective, group size and link scope.

Lookup order: a fit measured for this exact (collective, group size, scope); else the fit of the
nearest measured group size, rescaled by the ring algorithm's traffic factor; else the profile's
link bus bandwidth with the ring factors (NCCL's "bus bandwidth" convention):
all-gather and reduce-scatter move (n-1)/n of the buffer per rank, all-reduce 2(n-1)/n.
"""

from __future__ import annotations

from cost_models.profile import DeviceProfile


def ring_factor(collective: str, group_size: int) -> float:
    share = (group_size - 1) / group_size
    return 2 * share if collective == "all_reduce" else share


class CommModel:
    def __init__(self, profile: DeviceProfile):
        self.profile = profile

    def collective_s(self, collective: str, nbytes: float, group_size: int, scope: str) -> float:
        """Time of one collective over a full (unsharded) buffer of `nbytes`; 0 for a group of one."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        fits = [f for f in self.profile.collectives if f.collective == collective and f.scope == scope]
        if fits:
            fit = min(fits, key=lambda f: (abs(f.group_size - group_size), -f.group_size))
            rescale = ring_factor(collective, group_size) / ring_factor(collective, fit.group_size)
            return fit.alpha_s + fit.beta_s_per_byte * rescale * nbytes
        link = self.profile.links.get(scope) or self.profile.links["intra_node"]
        return link.latency_s + ring_factor(collective, group_size) * nbytes / link.bus_bandwidth_bytes_s
