"""What `search` and `estimate` say, beside the plan, when this machine is not the device the plan was costed
for (a CPU profile on another CPU, a GPU profile on a machine with another GPU), when a bf16 CPU plan
would run emulated here (autoplan/machine.py), or when the plan's pipeline schedule holds more than its
memory prices (ZB-V's drain at pipeline degree 3 and more: autoplan.solve.stages). Said on stderr; the plan is
written all the same."""

from __future__ import annotations

__all__ = ["device_warnings", "schedule_note"]


def device_warnings(plan) -> list[str]:
    """The warnings for a plan (or an estimate): its profile against this machine, its precision on this CPU, and
    its pipeline schedule's memory where not all of it is priced."""
    from autoplan.errors import AutoplanError
    from autoplan.machine import bf16_note, device_mismatch
    from autoplan.profile_store import load_profile

    notes = [schedule_note(getattr(plan, "pipeline", None))]
    try:
        profile = load_profile(plan.cluster.profile)
    except AutoplanError:  # a plan costed with a profile this machine lacks: nothing to compare
        return [note for note in notes if note]
    return [note for note in (device_mismatch(profile), bf16_note(profile, plan.training.dtype), *notes) if note]


def schedule_note(pipeline) -> str | None:
    """Where a plan's pipeline (its PipelineSpec, or None) runs a schedule whose memory is not all priced at its
    degree (autoplan.solve.stages.ASKED_ONLY: ZB-V from 3 ranks): what it leaves out."""
    from autoplan.solve.stages import ASKED_ONLY

    if pipeline is None or pipeline.schedule not in ASKED_ONLY or pipeline.degree < ASKED_ONLY[pipeline.schedule][0]:
        return None
    name = "ZB-V" if pipeline.schedule == "zbv" else pipeline.schedule
    return (f"{name} on pipeline degree {pipeline.degree}: {ASKED_ONLY[pipeline.schedule][1]}, so the predicted peak "
            "of ranks 1 and up may be low; keep memory in hand, or take `schedule` zero_bubble (priced as it runs)")
