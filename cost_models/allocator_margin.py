"""What torch's CUDA caching allocator needs beyond a plan's live bytes, by allocator configuration: the bound
a search plans to, and the figures a report prints.

Why: a CUDA run fails when the caching allocator cannot find or make a block, not when live tensors reach the
limit; how much more it needs depends on its configuration (`PYTORCH_CUDA_ALLOC_CONF`). With expandable
segments (torchtitan's default, and what `autoplan apply` runs CUDA ranks with unless told otherwise) each
stream's memory is one growing segment mapped in 2 MiB / 20 MiB pages, so a step needs its live bytes, a few
partly used pages per stream and kernel workspaces; natively each request of 10 MiB or more gets a segment of its
own and blocks of one size interleave with another's, so the need is 1-19% above the live bytes depending on
the plan. Both are measured by replaying real plans' allocation sequences through the allocator's models
(cost_models.allocator, cost_models.expandable_segments; benchmarks/allocator.py, benchmarks/RESULTS.md
section 11), and bounded here. Both bounds are per time point (`PointMargin`), and a table that carries one
(`CostTable.allocator`) has solver rows of what the allocator needs (`fitted_totals`), so the search stays linear
and each plan pays for what it holds. With expandable segments the need is the live bytes x 1.0175, plus the
activations that selectively checkpointed units save times 1.85 x what the model's selective forward strands in a
simulation of its pages (`expandable_margin`: their mix of saved and recomputed blocks leaves holes in the pages,
2-3.3% of the live peak on llama2-7b plans made of them, next to nothing on gpt2-1.5b's and llama3-8b's; 0.3-1.1%
without them), plus 125 MiB; a flat `needed <= allocated x (1 + factor) + slack` (`Margin`) remains for tables
whose rows are written sparse.
Natively a flat factor wastes memory: the
excess comes from blocks that a smaller request splits and strands (a layer's saved activations in segments its
larger transients left, the optimizer's foreach temporaries in the backward's segments, a step's largest block,
the loss's fp32 logits, in its own segment that the next step cannot reuse once smaller blocks split it), so it
follows what the step holds, not its total, and which block lands in which cached segment follows the model's
tensor sizes (llama2-7b's 86 MiB MLP blocks leave segments its 64 MiB saved tensors fill in part; llama3-8b's 224
MiB ones hold three of its 64 MiB tensors and more). The native bound is per time point: each memory category's
bytes times its weight, each option's activations by its checkpoint mode's weight, from a simulation of the model's
own forward (`native_margin`: a base plus a coefficient x what its repeated blocks strand per byte they keep,
cost_models.stranding, per mode: llama2-7b's blocks without checkpointing 1.20, its selective ones 1.13, fully
checkpointed ones 1.0), the gathered parameters by 1.065, the temporaries 1.583, the parameters 1.126, the rest 1;
a model whose trace records no storages (a table beside context or expert parallelism, or a pipelined one) gets the
category weights alone (`NATIVE`: 1.566 for temporaries, 1.343 for the parameters, 1.104 for activations). Every
constant is fitted to replays of the settled cache (cost_models.steady_steps), the need once the step has repeated
until the cache's layout does.

Three figures per plan: allocated (live bytes, the memory timeline's peak), needed (the smallest limit the step
runs in; what a plan is fitted to by default) and reserved (what torch.cuda.max_memory_reserved shows with
memory to spare: the allocator keeps freed segments cached until it runs short).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from cost_models.algebra import Affine, AffineAlgebra, SparseAlgebra, summed_rows
from cost_models.allocator import FRAGMENTATION, SEGMENT_SLACK
from cost_models.allocator_conf import is_expandable
from cost_models.memory import CATEGORIES, MemCategory, MemoryPoint, total
from cost_models.options import Recompute

__all__ = ["EXPANDABLE", "EXPANDABLE_BY_SIZES", "EXPANDABLE_STRANDING", "BY_MODE", "GATHERED_STRANDING", "NATIVE",
           "NATIVE_BY_SIZES", "Margin", "PointMargin", "allocated_within", "expandable_margin", "fitted_matrix",
           "fitted_totals", "margin_of", "native_margin", "needed_bytes", "needed_of_parts", "needed_of_points",
           "point_margin", "reserved_bytes", "selective_bytes", "SELECTIVE_RECOMPUTE"]



@dataclass(frozen=True)
class Margin:
    """needed <= allocated x (1 + factor) + slack; reserved (with memory to spare) <= allocated x reserved."""

    factor: float
    slack: int  # bytes: partly used pages and segments, and the kernel workspaces a replay cannot see
    reserved: float


# Expandable segments: replays of rank 0's step (benchmarks/allocator.py: uniform llama2-7b and llama3-8b plans at
# 4096-8192 tokens, 15-43 GiB, 4-layer 4 GiB models, and the plans the default search makes for gpt2-1.5b,
# llama2-7b and llama3-8b at three limits each) need 0.02-0.79 GiB above the live peak (1.001-1.030x; plans mixing
# selective checkpointing with none the most: llama2-7b at 26.64 GiB needs 27.43 with the workspaces); factor and
# slack are the smallest pair that covers every replay, with the kernel workspaces (SEGMENT_SLACK) on top.
# Reserved with memory to spare: at most 1.41x. Native: the worst replay's 1.185x (cost_models.allocator.
# FRAGMENTATION), reserved at most 1.57x.
_MARGINS = {
    True: Margin(factor=0.025, slack=(144 << 20) + SEGMENT_SLACK, reserved=1.45),
    False: Margin(factor=FRAGMENTATION, slack=SEGMENT_SLACK, reserved=1.6),
}


def margin_of(conf: str) -> Margin:
    return _MARGINS[is_expandable(conf)]


def needed_bytes(allocated_bytes: int, conf: str) -> int:
    """The smallest limit a step with this allocated peak runs in under the configuration (an upper bound)."""
    margin = margin_of(conf)
    return math.ceil(allocated_bytes * (1 + margin.factor)) + margin.slack


def allocated_within(limit_bytes: int, conf: str) -> int:
    """The largest allocated peak whose needed bytes fit `limit_bytes` (0 where the margin alone passes it)."""
    margin = margin_of(conf)
    return max(0, math.floor((limit_bytes - margin.slack) / (1 + margin.factor)))


def reserved_bytes(allocated_bytes: int, conf: str, device_bytes: int | None = None) -> int:
    """At most what torch.cuda.max_memory_reserved shows for this allocated peak with memory to spare (never below
    what the step needs: with room, the allocator keeps what it took), and never above `device_bytes`, the device's
    memory, where given: a segment the device cannot map makes the allocator free its cached segments and retry,
    so the cache grows only while the device has room (a limit on the process caps it the same way)."""
    spare = max(needed_bytes(allocated_bytes, conf), math.ceil(allocated_bytes * margin_of(conf).reserved))
    return spare if device_bytes is None else min(spare, device_bytes)


@dataclass(frozen=True)
class PointMargin:
    """The allocator's bound at each time point: the sum over memory categories of bytes x weight, plus
    `selective` x the activations selectively checkpointed units save (all of them, at every point: an upper bound
    of those alive there), plus the slack, once."""

    weights: dict[str, float]  # MemCategory value -> bytes needed per live byte (at least 1)
    slack: int  # bytes: partly used pages and segments, and the kernel workspaces a replay cannot see
    selective: float = 0.0  # bytes needed per activation byte a selectively checkpointed unit saves
    # Recompute value -> bytes needed per activation byte of a unit with that checkpoint mode, in place of the
    # activations' weight where the timeline weighs them per option (MemoryPoint.fitted_activations); the
    # activations' weight is then the largest of them, a bound for a point that does not
    by_mode: dict[str, float] | None = None


# Natively, besides the kernel workspaces: partly used 2 MiB pages and 20 MiB segments of the small requests, which
# no weight of a large model's replays needs but a small model's does (tests/test_allocator_fit.py's llama-tiny at
# 450MB: 308 MB allocated, its replay runs from 380 MB up, 8 MB above its weighted bytes; benchmarks/RESULTS.md 11b)
NATIVE_SLACK = 16 << 20
# Native, per time point, the bound of a table whose trace records no storages (no simulation of its model's own
# stranding): the smallest weights (a linear programme over the replays, each replay's peak point made to reach its
# needed limit x 1.01) that bound every settled native replay kept (cost_models.steady_steps; benchmarks/allocator.py:
# the grid's uniform and tensor-parallel plans, the default search's plans of every round and the default plans of
# the two held-out models, llama-1b and gpt2: 52; and the GPU kit's 29 grid plans run natively, eight steps each,
# benchmarks/allocator_steps.py --kit: 81), rounded up (`python benchmarks/allocator_weights.py --fallback`).
# The stranding follows activations (a layer's saved tensors in segments its larger transients left) and temporaries
# (the loss's fp32 logits in a segment of their own that smaller blocks then split; the optimizer's foreach
# temporaries in the backward's segments); the parameters' weight stands for the optimizer step's stranding, whose
# temporaries are as many as the parameters' shards. The weights fitted to the 52 alone (parameters 1.414,
# activations 1.099, temporaries 1.517) failed on an H200 under a kit plan (llama-1b at 2048 tokens, micro-batch 2,
# its bound 0.995 x its replay: out of memory at the logits' gradient); fitted to three steps' replays (parameters
# 1.13, activations 1.15, temporaries 1.35, gradients 1.04, gathered 1.05), up to 4% short of the settled need.
NATIVE = PointMargin({"params": 1.343, "grads": 1.0, "optimizer": 1.0, "activations": 1.104, "gathered": 1.0,
                      "temporaries": 1.566}, slack=NATIVE_SLACK + SEGMENT_SLACK)
# Expandable segments, per time point, the bound of a table whose trace records no storages: the least (factor,
# selective, slack) with every settled replay with expandable segments (the grid's 12 plans, the default plans of
# every round, those of the held-out llama-1b and gpt2: 33) at most its bound / 1.005 (a linear programme: factor
# 0.0199, selective 0.044, slack 44 MiB; `python benchmarks/allocator_weights.py --expandable --fallback`), rounded
# up. What a step needs beyond its live peak follows its selectively checkpointed units (llama2-7b all-selective
# 2.5%; plans without them 0.4-1.0%, on small models the slack). Fitted to three steps' replays (x 1.013, 5.3% of the
# selective units' activations, 40 MiB) it fell short of the settled need of llama3-8b's tensor-parallel plan and gpt2's
# at 3GB by 0.2-0.3%.
EXPANDABLE = PointMargin({category.value: 1.02 for category in CATEGORIES}, slack=(45 << 20) + SEGMENT_SLACK,
                         selective=0.045)


# Native, per time point, per model and per checkpoint mode: each option's activations weighted by its mode's base plus
# its coefficient x what the model's repeated blocks strand per byte they keep in a simulation of its forward at the
# table's micro-batch and tensor-parallel layout (cost_models.stranding.forward_stranding: llama2-7b 0.15, 0.12 at
# tensor degree 2, gpt2-1.5b 0.03-0.09 by micro-batch, llama3-8b 0, 0.02-0.06 tensor-parallel); the gathered
# parameters by 1.065, the temporaries by 1.583 (the loss's fp32 logits in a segment that smaller blocks split: from
# one step to the next, the previous step's logits segment holds a late block of this step's forward and the loss
# needs a segment of its own; the optimizer's foreach temporaries in the backward's segments), the parameters by
# 1.126 (the optimizer step's stranding, whose temporaries are as many as the parameters' shards), the rest by 1. Per
# mode because what a unit keeps decides where its blocks land: without checkpointing a block keeps every saved
# tensor, in segments the step before's blocks left (1.0 + 1.335 x the model's figure: llama2-7b 1.20); selectively
# checkpointed its matmuls' outputs amid freed transients (1.101 + 0.185 x: 1.13); fully checkpointed its input alone
# (1.0). The least constants with every native replay within its bound, each replay the need of the settled cache
# (the recorded steps carried on, cost_models.steady_steps: up to 13% above three steps' on benchmarks/allocator.py's
# grid, 5% on the default plans): a linear programme over the 28 replays of the first settled round, the grid's 12
# plans, the 9 default plans made under the bound fitted to three steps (results/allocator_default_steady_round1_
# native.json) and the 7 default plans of two models no bound had been fitted on (llama-1b, gpt2: the bound fell up
# to 4% short of them), each replay's peak point made to reach its needed limit x 1.01, rounded up. They hold every
# settled replay kept since (52 with their own plans and those of a programme over all of them, whose own llama-1b
# plan at 14GB needed more than its bound: bound/needed at least 1.004; `python benchmarks/allocator_weights.py
# --by-mode --unseen`, column native_margin). NATIVE, the same categories' weights without the simulation, is the
# bound of a table whose trace records no storages.
NATIVE_BY_SIZES = {"params": 1.126, "grads": 1.0, "optimizer": 1.0, "activations": 1.0, "gathered": 1.065,
                   "temporaries": 1.583}
GATHERED_STRANDING = 0.0  # the gathered parameters' weight: theirs + this x the model's simulated stranding
# Recompute value -> (base, coefficient of the simulated stranding) of a unit's activations in that mode
BY_MODE = {"nothing": (1.0, 1.335), "cheap": (1.101, 0.185), "alternate": (1.101, 0.185), "all": (1.0, 0.0)}


def native_margin(stranding: float | None) -> PointMargin:
    """The native per-point bound of a model whose forward strands `stranding` per live byte
    (cost_models.stranding.forward_stranding; None: unknown, NATIVE): the activations weighted per checkpoint mode
    (BY_MODE), their one weight the largest of those (a bound for a point not weighted per mode)."""
    if stranding is None:
        return NATIVE
    by_mode = {mode: base + coefficient * stranding for mode, (base, coefficient) in BY_MODE.items()}
    weights = dict(NATIVE_BY_SIZES, activations=max(by_mode.values()),
                   gathered=NATIVE_BY_SIZES["gathered"] + GATHERED_STRANDING * stranding)
    return PointMargin(weights, slack=NATIVE.slack, by_mode=by_mode)


# Expandable segments, per time point and per model: the live bytes x 1.0175, plus EXPANDABLE_STRANDING x what the
# model's selectively checkpointed forward strands per live byte in a simulation with expandable segments at the
# table's micro-batch and tensor-parallel layout (cost_models.stranding.forward_stranding(..., expandable=True):
# llama2-7b 0.045 at micro-batch 1, llama3-8b 0.013-0.019, gpt2-1.5b 0.007) x the activations selective units
# save, plus 125 MiB and the kernel workspaces. The least (factor, coefficient, slack) with every replay of
# benchmarks/allocator.py made with expandable segments (the grid's 12 plans and the default plans of two rounds:
# 26), each the need of the settled cache (cost_models.steady_steps: gpt2-1.5b's default plan at 8GB needs 1.2% more
# from its 21st step than at its third), at most its bound / 1.005 (a linear programme: factor 0.0172, coefficient
# 1.849, slack 124 MiB; `python benchmarks/allocator_weights.py --expandable`), rounded up. EXPANDABLE (4.5% of every
# model's selective activations) is the bound of a table whose trace records no storages.
EXPANDABLE_STRANDING = 1.85
EXPANDABLE_BY_SIZES = PointMargin({category.value: 1.0175 for category in CATEGORIES},
                                  slack=(125 << 20) + SEGMENT_SLACK)


def expandable_margin(stranding: float | None) -> PointMargin:
    """The expandable segments' per-point bound of a model whose selective blocks strand `stranding` per byte they
    keep (None: unknown, EXPANDABLE)."""
    if stranding is None:
        return EXPANDABLE
    return replace(EXPANDABLE_BY_SIZES, selective=EXPANDABLE_STRANDING * stranding)


def point_margin(conf: str, stranding: float | None = None) -> PointMargin:
    """The per-point bound for a configuration, of a model that strands `stranding` under it (cost_models.stranding;
    None: the bound that needs no simulation)."""
    return expandable_margin(stranding) if is_expandable(conf) else native_margin(stranding)


def selective_bytes(table, alg):
    """The activations the selectively checkpointed units of `table` save, as an expression of `alg` (a number for
    one plan under NumericAlgebra, a dense row over the option literals under AffineAlgebra)."""
    values = [[cost.activation_bytes if option.recompute in SELECTIVE_RECOMPUTE else 0
               for option, cost in zip(options, costs)] for options, costs in zip(table.options, table.costs)]
    if isinstance(alg, AffineAlgebra) and not isinstance(alg, SparseAlgebra) and any(map(any, values)):
        return alg.pick_sum(values)  # the units' rows side by side: the same integers as their sum
    expr = 0
    for unit, unit_values in enumerate(values):
        if any(unit_values):
            expr = expr + alg.pick(unit, unit_values)
    return expr


SELECTIVE_RECOMPUTE = (Recompute.CHEAP, Recompute.ALTERNATE)  # what `selective_bytes` counts


def _weighted(parts: dict, margin: PointMargin, fitted_activations=None):
    """A point's parts (memory category -> bytes or expression) summed with the margin's weights; the activations
    weighted per checkpoint mode (`fitted_activations`) where the margin and the point have them."""
    expr = 0
    for category in CATEGORIES:
        weight = margin.weights[category.value]
        if category is MemCategory.ACTIVATIONS and margin.by_mode and fitted_activations is not None:
            expr = expr + fitted_activations
        else:
            expr = expr + (parts[category] if weight == 1 else parts[category] * weight)
    return expr


def fitted_totals(table, points: list[MemoryPoint], alg) -> list:
    """Each point's bytes as the plan is fitted to them: its total, or where `table` carries the allocator's
    margin (`table.allocator`), what the allocator needs there less the slack, rounded up to whole bytes (numbers,
    or dense affine rows of `alg`: a table whose rows are written sparse carries no margin)."""
    margin = table.allocator
    if margin is None:
        return [total(point) for point in points]
    if isinstance(alg, AffineAlgebra) and not isinstance(alg, SparseAlgebra):
        coef, const = fitted_matrix(table, points, alg)
        return [Affine(row, c) for row, c in zip(coef, const.tolist())]
    totals = [0] * len(points)
    for objects, weights in _steps(table, points, alg):  # `_weighted` + selective, a category at a time for all points
        if isinstance(weights, list):
            totals = [t + (o if w is None else o * w) for t, o, w in zip(totals, objects, weights)]
        else:
            totals = [t + o for t, o in zip(totals, objects)] if weights is None else \
                [t + o * weights for t, o in zip(totals, objects)]
    for expr in totals:
        if not isinstance(expr, (int, float)):
            raise TypeError(f"the allocator's margin needs dense rows, got {type(expr).__name__}")
    return [math.ceil(expr) for expr in totals]


def fitted_matrix(table, points: list[MemoryPoint], alg) -> tuple[np.ndarray, np.ndarray]:
    """`fitted_totals` of dense affine rows as one int64 matrix (a row per point) and the points' constants, with fewer
    operations (`algebra.summed_rows`: the same IEEE operations per entry) and no list of rows to stack."""
    return summed_rows(_steps(table, points, alg), alg.size, ceil=table.allocator is not None)


def _steps(table, points: list[MemoryPoint], alg) -> list[tuple[list, object]]:
    """`_weighted` of every point, then its selective activations, as `algebra.summed_rows` steps: per category, the
    points' parts and their weight (None where it is 1; the activations per mode where `_weighted` takes them). Without
    a margin, `total`'s: the categories in order, unweighted."""
    margin, steps = table.allocator, []
    if margin is None:
        return [([point.parts[category] for point in points], None) for category in CATEGORIES]
    for category in CATEGORIES:
        weight = None if margin.weights[category.value] == 1 else margin.weights[category.value]
        parts = [point.parts[category] for point in points]
        if category is MemCategory.ACTIVATIONS and margin.by_mode:
            fitted = [point.fitted_activations for point in points]
            steps.append(([p if f is None else f for p, f in zip(parts, fitted)],
                          [weight if f is None else None for f in fitted]))
        else:
            steps.append((parts, weight))
    selective = selective_bytes(table, alg) * margin.selective if margin.selective else 0
    return steps + [([selective] * len(points), None)]


def needed_of_points(points: list[MemoryPoint], conf: str, selective: int = 0,
                     margin: PointMargin | None = None) -> int:
    """What one plan's step needs under `conf`, from its numeric timeline and the activations its selectively
    checkpointed units save (`selective_bytes`): the per-point bound's highest point plus the slack. `margin`:
    the bound its table carries (`CostTable.allocator`; None: `point_margin(conf)`)."""
    return needed_of_parts([{c.value: point.parts[c] for c in CATEGORIES} for point in points], conf, selective,
                           margin, [point.fitted_activations for point in points])


def needed_of_parts(parts: list[dict], conf: str, selective: int = 0, margin: PointMargin | None = None,
                    fitted: list | None = None) -> int:
    """As `needed_of_points`, from each point's bytes by memory category (a plan file's timeline breakdowns,
    keyed by the categories' values: "params", ...), its selective units' activation bytes and, where known, each
    point's activations weighted per checkpoint mode (`fitted`; else the activations' one weight)."""
    margin = margin or point_margin(conf)
    fitted = fitted or [None] * len(parts)
    return (math.ceil(max(_weighted({c: p[c.value] for c in CATEGORIES}, margin, f) for p, f in zip(parts, fitted))
                      + selective * margin.selective) + margin.slack)
