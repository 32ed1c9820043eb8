"""The calibration steps (calibration.py) fitted against the sum of their parts.

Per phase, a non-negative least-squares fit of relative errors over the plans without selective
checkpointing (calibration.py's docstring has the model: compute and recompute scales, a cost per
unit and per collective call); then the per-op cost of torch's selective checkpoint from each
selectively checkpointed step against its twin without checkpointing, so that what the first fit
misses on every plan of a sharding does not pass into it. A separate module from the experiment
because it runs without ranks or a device: `benchmarks/refit_profile.py` refits a measured profile's
recorded steps on a machine without its GPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from autoplan.profiling.calibration import (
    CALIBRATION_DEPTHS,
    CALIBRATION_DTYPE,
    CALIBRATION_OPTIMIZER,
    CALIBRATION_SEQ_LEN,
    calibration_cases,
    calibration_model,
    case_key,
)
from cost_models.options import PRECISIONS

__all__ = ["MIN_SCALE", "MAX_SCALE", "PhaseFit", "fit_phase", "fit_selective", "fit_calibration"]

# how much slower (or faster) than alone ops can run inside a step: a fitted scale outside is not the ops'
MIN_SCALE, MAX_SCALE = 0.25, 4.0


@dataclass(frozen=True)
class PhaseFit:
    compute_scale: float
    unit_s: float
    collective_s: float
    max_rel_err: float  # of the fit on the calibration cases
    recompute_scale: float | None = None  # backward only (None: no checkpointed case to fit it on)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |x c - y| over c >= 0, exactly, by trying every subset of columns (there are at most four)."""
    best, best_residual = np.zeros(x.shape[1]), float(np.sum(y ** 2))
    for size in range(1, x.shape[1] + 1):
        for columns in itertools.combinations(range(x.shape[1]), size):
            coef, *_ = np.linalg.lstsq(x[:, columns], y, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(x.shape[1])
            full[list(columns)] = coef
            residual = float(np.sum((x @ full - y) ** 2))
            if residual < best_residual:
                best, best_residual = full, residual
    return best


def fit_phase(ops_s: list[float], units: list[int], calls: list[int], residual_s: list[float],
              recompute_s: list[float] | None = None) -> PhaseFit:
    """residual = compute_scale * ops [+ recompute_scale * recompute] + unit_s * units + collective_s * calls,
    every coefficient >= 0, fitted on relative errors (each case weighs the same, short steps as much
    as long ones). A scale outside [MIN_SCALE, MAX_SCALE] is not physical (0: ops that do not lengthen the
    step at all; 0.06: what one H200 fitted to a small model whose steps were bound by the CPU issuing
    them, not by its kernels): such a scale is then fixed at 1 and the rest refitted."""
    scales = [ops_s] + ([recompute_s] if recompute_s is not None and any(recompute_s) else [])
    x = np.array([*scales, units, calls], dtype=float).T
    y = np.array(residual_s, dtype=float)
    weight = 1.0 / np.maximum(y, 1e-12)
    fixed: dict[int, float] = {}  # scale column -> its value held at 1
    while True:
        free = [c for c in range(x.shape[1]) if c not in fixed]
        target = y - sum((x[:, c] * value for c, value in fixed.items()), np.zeros_like(y))
        coef = np.zeros(x.shape[1])
        coef[free] = _nonnegative_lstsq(x[:, free] * weight[:, None], target * weight)
        coef[list(fixed)] = list(fixed.values())
        unphysical = [c for c in range(len(scales)) if c not in fixed and not MIN_SCALE <= coef[c] <= MAX_SCALE]
        if not unphysical:
            break
        fixed[unphysical[0]] = 1.0
    max_rel_err = float(np.max(np.abs(x @ coef - y) * weight))
    return PhaseFit(float(coef[0]), float(coef[-2]), float(coef[-1]), max_rel_err,
                    float(coef[1]) if len(scales) > 1 else None)


def fit_selective(fit: PhaseFit, pairs: list[tuple[dict, dict]], phase: str) -> float:
    """The per-op cost of torch's selective checkpoint in one phase, >= 0: what each selectively checkpointed
    case (`pairs`: each with its twin, the same plan without checkpointing; fit_calibration's case records) takes
    beyond its twin and beyond the difference `fit` (fitted on the other cases) gives the two, per working op,
    least squares of relative errors. Against its twin rather than the fit alone, so that what the fit misses on
    every plan of that sharding (its collectives) does not pass into the per-op cost; the two differ only in the
    recompute, at the fit's recompute scale."""
    def parts(case: dict) -> float:
        recompute = (fit.recompute_scale or fit.compute_scale) * case["ops_recompute_s"] if phase == "bwd" else 0.0
        return (fit.compute_scale * case[f"ops_{phase}_s"] + recompute + fit.unit_s * case["units"]
                + fit.collective_s * case[f"calls_{phase}"])

    def took(case: dict) -> float:
        return case["measured"][phase] - case[f"comm_{phase}_s"]

    weighted = [((took(sel) - took(twin)) - (parts(sel) - parts(twin)), sel["selective_ops"], took(sel) ** -2)
                for sel, twin in pairs]
    return max(0.0, sum(w * beyond * n for beyond, n, w in weighted) / sum(w * n * n for _, n, w in weighted))


def _recompute_s(table, unit: int, choice: int) -> float:
    """What the (uncalibrated) table charges the unit's backward for re-running forward ops under its option: its
    backward less that of the same option without checkpointing (full: every forward op; selective: those not kept)."""
    option = table.options[unit][choice]
    if not option.mode.checkpoints:
        return 0.0
    bare = next(i for i, o in enumerate(table.options[unit])
                if o.sharding == option.sharding and o.offload == option.offload and not o.mode.checkpoints)
    return table.costs[unit][choice].bwd_s - table.costs[unit][bare].bwd_s


def _case_parts(table, choices: list[int]) -> dict:
    """A calibration plan's parts as the uncalibrated table prices them, summed over its units."""
    chosen = [table.costs[u][c] for u, c in enumerate(choices)]
    recompute = sum(_recompute_s(table, u, c) for u, c in enumerate(choices))
    return {"units": len(chosen), "ops_fwd_s": sum(c.fwd_s for c in chosen),
            "ops_bwd_s": sum(c.bwd_s for c in chosen) - recompute, "ops_recompute_s": recompute,
            "selective_ops": sum(c.selective_ops for c in chosen),
            "comm_fwd_s": sum(c.comm_fwd_s for c in chosen), "comm_bwd_s": sum(c.comm_bwd_s for c in chosen),
            "calls_fwd": sum(c.collectives_fwd for c in chosen), "calls_bwd": sum(c.collectives_bwd for c in chosen)}


def fit_calibration(profile, measured: dict[str, dict[str, float]], world_size: int) -> dict:
    """Fit the forward and backward phases of the measured calibration steps against `profile`'s own
    prediction of their parts (the profile must not be calibrated yet: scale 1, no per-unit, per-call or
    per-op cost). A case `measured` lacks is left out (a profile measured before the selective case: its
    per-op cost is then 0, not measured). Returns the fitted numbers and, for the record, each case's parts
    and measurement."""
    from autoplan.api.traced import TracedModel
    from autoplan.solve.cluster import Cluster
    from cost_models.evaluate import uniform_choices
    from cost_models.mesh import Mesh

    device_type = profile.device_type
    seq_len = CALIBRATION_SEQ_LEN[device_type]
    cluster = Cluster(Mesh(nodes=1, gpus_per_node=world_size), profile, profile.name, False)
    compute_dtype = PRECISIONS[CALIBRATION_DTYPE].compute_dtype
    traced = {depth: TracedModel(calibration_model(depth, device_type), seq_len=seq_len).cache(compute_dtype, "block")
              for depth in CALIBRATION_DEPTHS}
    cases = []
    for strategy, checkpoint, depth, micro_batch in calibration_cases(device_type):
        key = case_key(strategy, checkpoint, depth, micro_batch)
        if key not in measured:
            continue
        table = traced[depth].table(micro_batch, 1, cluster, seq_len, CALIBRATION_DTYPE, CALIBRATION_OPTIMIZER)
        cases.append({"strategy": strategy, "checkpoint": checkpoint, "depth": depth, "micro_batch": micro_batch,
                      **_case_parts(table, uniform_choices(table, strategy, checkpoint)), "measured": measured[key]})
    plain = [c for c in cases if c["checkpoint"] != "selective"]
    twins = {(c["strategy"], c["depth"], c["micro_batch"]): c for c in plain if c["checkpoint"] == "none"}
    pairs = [(c, twins[c["strategy"], c["depth"], c["micro_batch"]]) for c in cases
             if c["checkpoint"] == "selective" and (c["strategy"], c["depth"], c["micro_batch"]) in twins]
    fits, selective = {}, {}
    for phase in ("fwd", "bwd"):
        fits[phase] = fit_phase([c[f"ops_{phase}_s"] for c in plain], [c["units"] for c in plain],
                                [c[f"calls_{phase}"] for c in plain],
                                [c["measured"][phase] - c[f"comm_{phase}_s"] for c in plain],
                                recompute_s=[c["ops_recompute_s"] for c in plain] if phase == "bwd" else None)
        selective[phase] = fit_selective(fits[phase], pairs, phase) if pairs else 0.0
    return {
        "compute_fwd_scale": fits["fwd"].compute_scale, "compute_bwd_scale": fits["bwd"].compute_scale,
        "compute_recompute_scale": fits["bwd"].recompute_scale,
        "unit_fwd_s": fits["fwd"].unit_s, "unit_bwd_s": fits["bwd"].unit_s,
        "collective_fwd_s": fits["fwd"].collective_s, "collective_bwd_s": fits["bwd"].collective_s,
        "selective_fwd_s_per_op": selective["fwd"], "selective_bwd_s_per_op": selective["bwd"],
        "fit_max_rel_err": {phase: fit.max_rel_err for phase, fit in fits.items()},
        "cases": cases,
    }
