"""A pipeline rank's fastest micro-batch within its memory limit, bounded from below without a solve.

A pipelined schedule is pruned where its makespan cannot beat the best plan found (autoplan.solve.pipeline). With
every unit at its fastest option that bound ignores memory, and on a large model the ranks' memory decides: the
405B-class Llama on 32 x 8 H100s has pipelined plans of 14-16 samples/s whose memory-blind bounds are 18-21, above
the 18.1 of the best plan without a pipeline, so each was solved rank by rank only to lose.

A rank's micro-batch time is a sum over its units of the option each takes (cost_models.step), and a plan fits
where every memory point's row (stage_solve's rows with what the rank holds all step) is within the limit. For any
one row r and multiplier lam >= 0, every plan that fits has

    sum_u t[u, o_u] >= sum_u t[u, o_u] + lam (a_r . x + c_r - limit)
                    >= sum_u min_o (t[u, o] + lam a_r[u, o]) - lam (limit - c_r)

(the Lagrangian relaxation of that row), so the largest right-hand side over the rows and a search over lam bounds the
rank's time from below. It is taken only where a plan of the rank is shown to fit (the relaxed plan repaired until
every row fits, checked in integers): then the rank's solve finds one and the search keeps the cut it bounds (a
rank that does not fit moves the cut, and the bound says nothing of other cuts).
"""

from __future__ import annotations

import numpy as np

from cost_models.step import micro_batch_s
from cost_models.table import CostTable

__all__ = ["literal_times", "rank_slot_bound", "slot_lower_bound"]

SEARCH_STEPS = 30  # ternary-search steps on each row's multiplier: the bracket shrinks to (2/3)^30, about 5e-6


def literal_times(table: CostTable) -> np.ndarray:
    """Per literal of `table` (its options, unit by unit), the option's micro-batch time: what `rank_slot_bound`
    minimises (a function of the table alone: a caller may keep it for every rank of one kind of stage)."""
    return np.array([micro_batch_s(c, u == table.root, table.overlap_enabled, table.comm_sm_fraction)
                     for u, costs in enumerate(table.costs) for c in costs])


def rank_slot_bound(table: CostTable, offsets, memory, limit: int, times: np.ndarray | None = None) -> float | None:
    """A lower bound on the micro-batch time of any plan of the rank's `table` (its searched options, literals between
    `offsets`) whose memory rows (`memory`: stage_solve's, dense) are within `limit`; None where no plan is known to
    fit (nothing is then bounded) or the rows are not held dense. `times`: the table's `literal_times`, if kept."""
    if not memory.dense:
        return None
    times = literal_times(table) if times is None else times
    rows, room = memory.rows_at(list(range(memory.points))), limit - memory.const
    host = np.array([cost.host_bytes for costs in table.costs for cost in costs], dtype=np.int64)
    if table.host_limit_bytes is not None and host.any():  # the solver's host constraint (solver.AffineModel), a row
        rows, room = np.vstack([rows, host]), np.append(room, table.host_limit_bytes)
    return slot_lower_bound(times, offsets, rows, room)


def slot_lower_bound(times: np.ndarray, offsets, rows: np.ndarray, room: np.ndarray) -> float | None:
    """The least sum of `times` (per literal; one literal per unit, units' literals between `offsets`) over the plans
    x with rows @ x <= room (integer rows: the memory points' bytes, `room` the limit less each point's constant),
    bounded from below; None where no such plan is found."""
    starts = np.asarray(offsets[:-1])
    fastest = _argmin_per_unit(times, starts)
    blind = float(times[fastest].sum())
    # a row the fastest plan is within cannot raise the bound (its relaxation is at most that plan's time there)
    over = rows[:, fastest].sum(axis=1) > room
    if not over.any():
        return blind  # the fastest plan fits
    if (np.minimum.reduceat(rows, starts, axis=1).sum(axis=1) > room).any():
        return None  # a row no plan is within (each unit at its least there): nothing fits, no search shows one
    real, full = rows.astype(np.float64), room.astype(np.float64)
    lam, values = _best_multipliers(times, starts, real[over], full[over])
    k = int(np.argmax(values))
    # a plan that fits: the binding row's relaxed plan, else the leanest (each unit's smallest share of the rooms),
    # each repaired until every row fits
    share = (real / np.maximum(full, 1.0)[:, None]).max(axis=0)
    for start in (times + lam[k] * real[np.flatnonzero(over)[k]], share):
        plan = _repaired(_argmin_per_unit(start, starts), times, starts, real, full)
        x = np.zeros(len(times), dtype=np.int64)
        x[plan or []] = 1
        if plan is not None and ((rows @ x) <= room).all():  # checked in integers, as the solver's rows
            return max(blind, float(values[k]))
    return None


def _best_multipliers(times: np.ndarray, starts: np.ndarray, rows: np.ndarray, room: np.ndarray):
    """Per row, the multiplier found by a ternary search of its (concave) relaxation, and the relaxation there."""
    spread = float(times.max() - times.min()) * len(starts) + 1e-12
    lo = np.zeros(len(room))
    hi = spread / (rows.max(axis=1) - rows.min(axis=1) + 1.0)  # beyond it the memory term outweighs any time
    # both thirds' relaxations in one evaluation of the rows stacked twice (each row's values are its own: computed
    # alone or stacked, the same operations in the same order), over the literals no other dominates
    n, room_twice = len(room), np.concatenate([room, room])
    times, starts, rows = _undominated(times, starts, rows)
    grouped = _grouped(times, starts, np.vstack([rows, rows]))
    for _ in range(SEARCH_STEPS):
        third = (hi - lo) / 3
        left, right = lo + third, hi - third
        values = relaxed_values(*grouped, room_twice, np.concatenate([left, right]))
        better = values[:n] < values[n:]
        lo, hi = np.where(better, left, lo), np.where(better, hi, right)
    lam = (lo + hi) / 2
    return lam, relaxed_values(*grouped, room_twice, np.concatenate([lam, lam]))[:n]


def relaxed_values(times: np.ndarray, rows: np.ndarray, room: np.ndarray, lam: np.ndarray) -> np.ndarray:
    """Per row r, its relaxation at multiplier lam[r]: sum_u min_o (t + lam a_r) - lam (limit - c_r), from `_grouped`'s
    times and rows (each unit's least over its options taken across them, exact as any min; summed unit by unit as
    over a row of units' least)."""
    return np.minimum.reduce(times + lam[None, :, None] * rows, axis=0).sum(axis=1) - lam * room


def _grouped(times: np.ndarray, starts: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The literals by option and unit: times (K, 1, units) and rows (K, rows, units), K the most options of a unit,
    a unit with fewer padded with an option of infinite time and no bytes (never the least at a finite multiplier)."""
    counts = np.diff(np.append(starts, len(times)))
    option = np.arange(counts.max())[:, None]
    at = np.where(option < counts[None, :], starts[None, :] + option, len(times))  # (K, units): a literal or the pad
    padded = np.hstack([rows, np.zeros((len(rows), 1), dtype=rows.dtype)])
    return np.append(times, np.inf)[at][:, None, :], np.ascontiguousarray(padded[:, at].transpose(1, 0, 2))


def _undominated(times: np.ndarray, starts: np.ndarray, rows: np.ndarray):
    """The literals (`times`, `starts`, `rows` cut to them) that no other literal of their unit dominates: as fast and
    as small in every row, not the same (of the same, the first is kept). At any multiplier >= 0 a dominated
    literal's t + lam a is at least its dominator's, in floats too (rounding is monotone): each unit's least in
    `relaxed_values` is the same over these alone, so is every relaxation, bit for bit."""
    unit_of = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(times))))
    i, j = np.nonzero(unit_of[:, None] == unit_of[None, :])  # pairs of one unit's literals
    i, j = i[i != j], j[i != j]
    below = (times[i] <= times[j]) & (rows[:, i] <= rows[:, j]).all(axis=0)
    same = (times[i] == times[j]) & (rows[:, i] == rows[:, j]).all(axis=0)
    dominated = np.zeros(len(times), dtype=bool)
    dominated[j[below & ~(same & (i > j))]] = True
    keep = np.flatnonzero(~dominated)
    return times[keep], np.flatnonzero(np.diff(unit_of[keep], prepend=-1)), rows[:, keep]


def _repaired(plan: list[int], times: np.ndarray, starts: np.ndarray, rows: np.ndarray,
              room: np.ndarray) -> list[int] | None:
    """`plan` (one literal per unit) made to fit greedily: while a row is over, the unit's option that takes most
    bytes off the row most over per second it adds. None where no change helps."""
    unit_of = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(times))))
    plan = list(plan)
    for _ in range(len(times)):
        x = np.zeros(len(times))
        x[plan] = 1
        over = rows @ x - room
        worst = int(np.argmax(over))
        if over[worst] <= 0:
            return plan
        current = np.asarray(plan)[unit_of]  # per literal, its unit's chosen literal
        saved = rows[worst][current] - rows[worst]
        cost = np.maximum(times - times[current], 0.0)
        score = np.where(saved > 0, saved / (cost + 1e-12), -np.inf)
        best = int(np.argmax(score))
        if score[best] == -np.inf:
            return None
        plan[unit_of[best]] = best
    return None


def _argmin_per_unit(values: np.ndarray, starts: np.ndarray) -> list[int]:
    """Per unit, the literal of its smallest value: the plan minimising a row's relaxation."""
    ends = list(starts[1:]) + [len(values)]
    return [int(s + np.argmin(values[s:e])) for s, e in zip(starts, ends)]
