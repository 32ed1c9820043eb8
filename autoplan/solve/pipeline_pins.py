"""Why a pinned search found no pipelined plan: the pins, or the mesh.

Without a pipeline, a search that fits nothing with pins asks whether a plan fits without them and, if one
does, which pins cannot all hold (autoplan.solve.pins: CP-SAT assumptions over the table's model). A pipeline
rank's memory is more than its table's timeline (the micro-batches in flight, the stage's parameters gathered for
the step: autoplan.solve.stage_solve), and its cut depends on what fits, so the same question is asked of the
pipeline as searched without the pins: if it finds nothing either, the pins are not the cause; else the first of
its ranks where the pins cannot all hold is explained on that rank's model, with what it holds.
"""

from __future__ import annotations

from dataclasses import replace

from autoplan.errors import InfeasibleError, UsageError
from autoplan.solve.pipeline import search_pipeline
from autoplan.solve.request import PlanRequest
from autoplan.solve.solver import solve_min_memory
from autoplan.solve.stage_solve import held_model, searched_table
from autoplan.solve.sweep import MeshPruned

__all__ = ["best_explained", "explain_pinned_pipeline"]

NOT_THE_CAUSE = "The pins are not the cause: without them no pipelined plan fits either."


def best_explained(request: PlanRequest, results: list, best):
    """`best(results)` (mesh_search.best_result: the fastest result that fits), or the InfeasibleError it raises
    where nothing fits, explained where it is a pipelined mesh's under pins (`explain_pinned_pipeline`)."""
    try:
        return best(results)
    except InfeasibleError as exc:
        raise explain_pinned_pipeline(request, results, exc) from None


def explain_pinned_pipeline(request: PlanRequest, results: list, error: InfeasibleError) -> InfeasibleError:
    """`error`, the one a search that fits nothing raises (`mesh_search.best_result` over `results`), explained
    where it is a pipelined mesh's under pins: a PinsInfeasibleError naming the pins that cannot all hold on the
    first rank where they fail, where a pipelined plan fits without them; else `error` saying the pins are not the
    cause. Any other error is returned as it is (a mesh without a pipeline explains its own: sweep)."""
    failed = next((r for r in results if r.error is error), None)
    if request.pins is None or request.uniform is not None or failed is None or failed.mesh.pp == 1:
        return error
    mesh = failed.mesh
    try:  # on the mesh's own tensor-parallel layout (kept in its result, a worker's too)
        free, _ = search_pipeline(replace(request, pins=None), mesh, failed.layout, request.schedule)
    except (InfeasibleError, UsageError, MeshPruned):
        error.args = (_sentence(error.args[0]) + NOT_THE_CAUSE,)
        return error
    limits, pins = request.limits, request.pins
    for rank in free.ranks:
        model = held_model(rank.table, rank.held)
        searched = searched_table(rank.table)[0]  # the options the search offers: the model's literals
        restricted = pins.restrict(searched)
        lean = solve_min_memory(restricted, time_limit_s=limits.time_limit_s, affine=model(restricted))
        if lean.objective is not None and lean.objective <= limits.planned_bytes:
            continue  # the pins hold on this rank
        paths = [unit.path or "<root>" for unit in searched.units]
        where = (f"{request.model.name} on pipeline rank {rank.rank} of {mesh.pp} "
                 f"({paths[0]}{f' to {paths[-1]}' if len(paths) > 1 else ''})")
        explained = pins.explain_infeasible(searched, limits.planned_bytes, where, limits.mem_limit_bytes,
                                            limits.headroom, limits.time_limit_s, model=model)
        if explained is not None:
            return explained
    error.args = (_sentence(error.args[0]) + "Without the pins a pipelined plan fits, at stage boundaries the search "
                  "with them did not reach.",)
    return error


def _sentence(message: str) -> str:
    return message if message.endswith(". ") else message.rstrip() + (" " if message.rstrip().endswith(".") else ". ")
