"""Why a run did not finish, one line per rank, causes before consequences: the `failures` of a run report.

A rank that dies or runs out of memory makes its peers fail in their next collective, and the launcher
then stops the rest; the report puts the rank that started it first, and says for each rank where it was
(while starting, or at which step), the predicted peak and what was measured so far. A run stopped by a
signal says so for every rank; on several nodes, a rank of another node that sent nothing is named as such.
"""

from __future__ import annotations

from autoplan.plan.schema import Plan
from autoplan.run.launch import LaunchResult
from autoplan.sizes import format_bytes

__all__ = ["failure_messages"]


def failure_messages(plan: Plan, nproc: int, launched: LaunchResult) -> list[str]:
    """One line per rank that did not finish: which rank, what happened, predicted and measured memory.

    Causes come before consequences: a rank killed by a signal first (its peers' collectives fail
    because it is gone), then ranks out of memory, ranks with an error, and last the ranks the
    launcher stopped (SIGTERM) once another had failed.
    """
    predicted_mem = format_bytes(plan.predicted.peak_mem_bytes)
    first = launched.first_failed_rank
    entries: list[tuple[int, int, str]] = []  # (order, rank, message)
    for rank in range(nproc):
        result, failure = launched.ranks.get(rank), launched.failures.get(rank)
        if result is not None and result.status == "ok":
            if failure is not None:
                entries.append((4, rank, f"rank {rank} finished and wrote its results, then exited with status "
                                         f"{failure.exitcode} ({failure.signal or 'no signal'}) while shutting down"))
            continue
        where = "while starting" if result is None or result.phase == "starting" else f"at step {result.steps_done + 1}"
        measured = (f"measured peak so far {format_bytes(result.peak_mem_bytes)} ({result.mem_source})"
                    if result is not None and result.mem_source else "nothing measured")
        stopped = failure is None or (failure.signal == "SIGTERM" and first is not None and first != rank)
        if not launched.is_local(rank) and (result is None or result.status == "running"):
            said = "sent nothing to this node" if result is None else f"last reported step {result.steps_done}"
            entries.append((3, rank, f"rank {rank} ran on another node and {said}; that node's output says "
                                     "what happened to it"))
        elif launched.interrupted and (result is None or result.status == "running"):
            entries.append((3, rank, f"rank {rank} was stopped by {launched.interrupted} {where}; {measured}"))
        elif result is not None and result.status == "oom":
            entries.append((1, rank, f"rank {rank} ran out of memory {where}: {result.error}; "
                                     f"predicted peak {predicted_mem}, {measured}"))
        elif result is not None and result.status == "failed":
            entries.append((2, rank, f"rank {rank} failed {where}: {result.error}; "
                                     f"predicted peak {predicted_mem}, {measured}"))
        elif not stopped:
            how = f"was killed by {failure.signal}" if failure.signal else f"exited with status {failure.exitcode}"
            entries.append((0, rank, f"rank {rank} died {where}: it {how}; "
                                     f"predicted peak {predicted_mem}, {measured}"))
        else:
            entries.append((3, rank, f"rank {rank} was stopped by the launcher {where}, after another rank failed; "
                                     f"{measured}"))
    messages = [message for _, _, message in sorted(entries)]
    if not messages and launched.returncode != 0:
        messages.append("every rank finished and wrote its results, but the launcher exited with status "
                        f"{launched.returncode}")
    return messages
