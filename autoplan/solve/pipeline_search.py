"""What one pipelined mesh's search (autoplan.solve.pipeline) shares: the request, mesh, layout and stage cluster, and
its caches, each keyed by what its entries read.

A rank's tables depend on its kind of stage (`StageTables.key`: its units' classes, and pins' decisions), its
micro-batch and the micro-batches per step, not on which ranks of that kind it is: its tables, rows and solves are
kept per kind (what it holds beside them, per flight). Its units' paths are the rank's own: a table is handed out
with them where they are read (solves' outcomes, fixed choices, pins), and without (the first of its kind's) where
they are not, so that a rank's tensor-parallel view (`source`) is made only where its tables are built or read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autoplan.errors import InfeasibleError
from autoplan.solve.cluster import Cluster
from autoplan.solve.pipeline_outcome import PipelineOutcome
from autoplan.solve.request import PlanRequest
from autoplan.solve.stage_solve import rank_memory, rank_rows
from autoplan.solve.stages import StageTables, forward_units
from cost_models.mesh import Mesh
from cost_models.pipeline import HeldAllStep, held_all_step, pipelined_table
from cost_models.table import CostTable
from cost_models.tensor_parallel import TpLayout

__all__ = ["PipelineSearch"]


@dataclass
class PipelineSearch:
    """What one pipelined mesh's search shares (see the module docstring)."""

    request: PlanRequest
    mesh: Mesh
    layout: TpLayout | None
    cluster: Cluster
    stages: dict = field(default_factory=dict)  # chunks -> StageTables
    sources: dict = field(default_factory=dict)  # chunks -> its TableSource (made where its tables or units are read)
    tables: dict = field(default_factory=dict)  # (key, micro-batch, m) -> CostTable
    priced: dict = field(default_factory=dict)  # (key, micro-batch, m) -> `pipelined`'s table
    held: dict = field(default_factory=dict)  # (key, micro-batch, m, flight...) -> `pipelined`'s held bytes
    rank_rows: dict = field(default_factory=dict)  # (key, micro-batch, m) -> stage_solve.rank_rows
    solved: dict = field(default_factory=dict)  # (key, micro-batch, m, flight) -> (choices, status) or None
    best: PipelineOutcome | None = None
    lean: InfeasibleError | None = None
    decide: object = None  # fixed choices in place of the solves: a function of a rank's table
    over: float = 0.0  # the last rank that did not fit: its floor over the planned bytes
    beat: float | None = 0.0  # samples/s of the best plan without a pipeline (None: not known yet); `pruned`: schedules
    pruned: int = 0  # whose bound cannot beat it; `bounds`: each bound over any cut compared with `beat`
    bounds: list = field(default_factory=list)
    slot_bounds: dict = field(default_factory=dict)  # (key, micro-batch, m, holds) -> slot_bound.rank_slot_bound
    memory: dict = field(default_factory=dict)  # the same -> stage_solve.rank_memory (its rows with what it holds)
    evals: dict = field(default_factory=dict)  # the same, choices -> stage_solve.rank_evaluation's
    times: dict = field(default_factory=dict)  # (key, micro-batch, m) -> slot_bound.literal_times of its rows' table
    fastest: dict = field(default_factory=dict)  # the same -> stages.fastest_slot of its pipelined table
    holds: dict = field(default_factory=dict)  # (schedule, cuts, micro-batch, m) -> the ranks pipeline._rank_holds made
    order: list = field(init=False)  # the units a cut counts (stages.forward_units)

    def __post_init__(self):
        self.order = forward_units(self.request.tables.units)

    def starts(self, cuts: list[int]) -> list[int]:
        """Each stage's first op in the model's trace."""
        units = self.request.tables.units
        return [0] + [units[self.order[c]].first_op for c in cuts[1:]]

    def source(self, chunks: tuple[tuple[int, int], ...]):
        if chunks not in self.sources:
            self.sources[chunks] = self.stage(chunks).for_layout(self.layout)
        return self.sources[chunks]

    def stage(self, chunks: tuple[tuple[int, int], ...]) -> StageTables:
        if chunks not in self.stages:
            self.stages[chunks] = StageTables(self.request.tables, list(chunks))
        return self.stages[chunks]

    def kind(self, chunks) -> tuple:
        """Equal for ranks whose tables are equal: their units' classes (`StageTables.key`) and pinned decisions."""
        pins = self.request.pins
        key = self.stage(chunks).key
        return key if pins is None else (key, pins.decisions(self.source(chunks).units))

    def pipelined(self, chunks, micro_batch_size: int, m: int, *flight, units: bool = True):
        """`cost_models.pipeline.pipelined` of the rank's table (`flight`: its flight, drained, later, split backward's
        bytes), once per kind of stage: its table once per micro-batch, what it holds once per flight too. Not `units`:
        the table with the units of the rank of its kind first priced (where no path is read)."""
        key = (self.kind(chunks), micro_batch_size, m)
        if key not in self.priced:
            self.priced[key] = pipelined_table(self.table(chunks, micro_batch_size, m), m)
        if flight and (*key, *flight) not in self.held:  # no flight: the table alone (held_all_step reads no path)
            self.held[(*key, *flight)] = held_all_step(self.table(chunks, micro_batch_size, m, False), *flight)
        table = replace(self.priced[key], units=self.source(chunks).units) if units else self.priced[key]
        return table, self.held.get((*key, *flight))

    def rows(self, kind: tuple, chunks):
        """`stage_solve.rank_rows` of a rank's pipelined table, once per `kind` of stage, micro-batch and m."""
        if kind not in self.rank_rows:
            self.rank_rows[kind] = rank_rows(self.pipelined(chunks, *kind[1:])[0])
        return self.rank_rows[kind]

    def held_rows(self, kind: tuple, holds: tuple, chunks, held: HeldAllStep):
        """`stage_solve.rank_memory` of a rank's pipelined table with what it holds, once per kind and holds."""
        if (*kind, holds) not in self.memory:
            self.memory[(*kind, holds)] = rank_memory(self.rows(kind, chunks), held)
        return self.memory[(*kind, holds)]

    def table(self, chunks, micro_batch_size: int, microbatches: int, units: bool = True) -> CostTable:
        key = (self.kind(chunks), micro_batch_size, microbatches)
        if key not in self.tables:
            source, t, pins = self.source(chunks), self.request.training, self.request.pins
            table = source.table(micro_batch_size, microbatches, self.cluster, t.seq_len, t.dtype, t.optimizer)
            if pins is not None and self.decide is None and self.request.uniform is None:  # others overlay pins
                table = pins.restrict(replace(table, units=source.units))
            self.tables[key] = table
        return replace(self.tables[key], units=self.source(chunks).units) if units else self.tables[key]
