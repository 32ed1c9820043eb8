"""What `search` and `estimate` say, beside the plan, when this machine is not the device the plan was costed
for (a CPU profile on another CPU, a GPU profile on a machine with another GPU), or when a bf16 CPU plan
would run emulated here (autoplan/machine.py). Said on stderr; the plan is written all the same."""

from __future__ import annotations

__all__ = ["device_warnings"]


def device_warnings(plan) -> list[str]:
    """The warnings for a plan (or an estimate): its profile against this machine, and its precision on this CPU."""
    from autoplan.errors import AutoplanError
    from autoplan.machine import bf16_note, device_mismatch
    from autoplan.profile_store import load_profile

    try:
        profile = load_profile(plan.cluster.profile)
    except AutoplanError:  # a plan costed with a profile this machine lacks: nothing to compare
        return []
    return [note for note in (device_mismatch(profile), bf16_note(profile, plan.training.dtype)) if note]
