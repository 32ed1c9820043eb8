"""The mesh search's progress lines on stderr (autoplan.solve.mesh_search), once a search has taken its delay
(mesh_search.PROGRESS_DELAY_S): a quick search prints nothing."""

from __future__ import annotations

import sys
import time

from cost_models.mesh import Mesh

__all__ = ["MeshProgress"]


class MeshProgress:
    """Lines on stderr once the search has taken `delay_s`: per micro-batch this process searches (which
    mesh and its shape, the micro-batch, what it gave, the best so far), and per mesh searched (its best
    micro-batch, the best plan so far). A search of one mesh shows its micro-batches too."""

    def __init__(self, meshes: int, delay_s: float):
        self.meshes, self.delay_s, self.start = meshes, delay_s, time.perf_counter()

    def sweeping(self, index: int, mesh: Mesh):
        """The sweep's progress hook for the `index`-th mesh (autoplan.solve.sweep)."""
        shape = (f"{mesh.pp} pipeline x " if mesh.pp > 1 else "") + f"{mesh.dp} data-parallel" + \
            (f" x {mesh.cp} context-parallel" if mesh.cp > 1 else "") + \
            (f" x {mesh.tp} tensor-parallel" if mesh.tp > 1 else "") + (" +sp" if mesh.sequence_parallel else "") + \
            (f", experts {mesh.ep}-way" if mesh.ep > 1 else "")

        def step_done(step, best: float | None) -> None:
            elapsed = time.perf_counter() - self.start
            if elapsed < self.delay_s:
                return
            found = (f"{step.throughput_samples_s:,.1f} samples/s" if step.throughput_samples_s is not None
                     else step.status.lower().replace("_", " "))
            so_far = f"; best so far {best:,.1f} samples/s" if best is not None else ""
            print(f"autoplan: mesh {index + 1} of {self.meshes} ({shape}), micro-batch {step.micro_batch_size} x "
                  f"{step.grad_accum_steps} accumulation: {found}{so_far} ({elapsed:.1f} s)", file=sys.stderr,
                  flush=True)
        return step_done

    def done(self, results: list) -> None:  # the MeshResults so far
        elapsed = time.perf_counter() - self.start
        last = results[-1]
        if elapsed < self.delay_s or self.meshes == 1 or last.outcome is None and last.error is None:
            return  # quick, alone, or not searched (a layout the model does not take)
        found = (f"micro-batch {last.outcome.table.micro_batch_size}, {last.throughput:,.1f} samples/s"
                 if last.outcome is not None else last.refused or "no plan")
        fitting = [r for r in results if r.outcome is not None]
        best = max(fitting, key=lambda r: r.throughput) if fitting else None
        so_far = f"; best so far {best.label}, {best.throughput:,.1f} samples/s" if best is not None else ""
        print(f"autoplan: mesh {len(results)} of {self.meshes} ({last.label}): {found}{so_far} ({elapsed:.1f} s)",
              file=sys.stderr, flush=True)
