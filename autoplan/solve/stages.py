"""Pipeline stages: where the units are cut, and each stage's (or pipeline rank's) cost tables.

A stage is a contiguous run of the model's units in forward order (the root's own ops before the first
block go with the first stage, those after the last, the loss among them, with the last); its boundaries
balance the predicted time of one micro-batch (each unit's FLOPs at the profile's matmul rate plus its
bytes at its memory bandwidth, as one rank runs them) across the stages, and `shifted` moves a unit off a
stage that does not fit its memory into its neighbour. A rank's units are those of its stages (one, or
several for a looped schedule); `StageTables` is the model's tables restricted to them: a TableSource
the per-unit solver reads as it reads the whole model's, with the root holding only the parameters the
rank's ops use (the final norm on the last stage), and its tensor-parallel view restricted alike.

Stages of the same blocks give the same tables, so the search keys them by the units' classes
(`StageTables.key`) and prices each kind of stage once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

from autoplan.solve.cluster import Cluster
from autoplan.solve.tables import CostTables, TableSource, TensorParallelTables, _Source
from cost_models.mesh import Mesh
from cost_models.pipeline import weight_output_bytes
from cost_models.profile import DeviceProfile
from cost_models.records import LOSS_NODE, OpRecord, Unit
from cost_models.schedules import StagesPerRank
from cost_models.search_memo import memo
from cost_models.step import unit_step_s
from cost_models.table import CostTable, TableInputs, unit_classes
from cost_models.tensor_parallel import TpLayout
from cost_models.training import Training

__all__ = ["ASKED_ONLY", "StageTables", "balanced_cuts", "boundary_bytes", "fastest_slot", "forward_units",
           "rank_chunks", "shifted", "slot_bounds", "stage_boundaries", "stage_cluster", "stage_modules", "undominated",
           "unit_weights", "weight_outputs"]


def forward_units(units: list[Unit]) -> list[int]:
    """The units a pipeline cuts, in forward order: the root's direct children (a nested unit goes with its
    parent)."""
    return sorted((u for u, unit in enumerate(units) if unit.parent == ""), key=lambda u: units[u].first_op)


def unit_weights(units: list[Unit], ops: list[OpRecord], profile: DeviceProfile, compute_dtype: str) -> list[float]:
    """Per unit of `forward_units`: seconds of one micro-batch's forward and backward, roughly (FLOPs at the
    profile's matmul rate, bytes at its memory bandwidth); the root's ops count with the first and the last."""
    flop_s = (profile.peak_flops.get(compute_dtype) or min(profile.peak_flops.values())) * profile.matmul_efficiency
    byte_s = profile.mem_bandwidth_bytes_s * profile.mem_bandwidth_efficiency

    def seconds(op: OpRecord) -> float:
        return (op.fwd_flops + op.bwd_flops) / flop_s + (op.fwd_bytes + op.bwd_bytes) / byte_s + profile.op_overhead_s

    order = forward_units(units)
    weights = [sum(seconds(op) for op in ops[units[u].first_op:units[u].last_op + 1]) for u in order]
    weights[0] += sum(seconds(op) for op in ops[:units[order[0]].first_op])
    weights[-1] += sum(seconds(op) for op in ops[units[order[-1]].last_op + 1:])
    return weights


def balanced_cuts(weights: list[float], stages: int) -> list[int]:
    """Where each of `stages` contiguous runs of `weights` starts (the first at 0), the heaviest run as light
    as it can be; among equally light cuts, the earliest boundaries (deterministic)."""
    return list(_balanced_cuts(tuple(weights), stages))


@lru_cache(maxsize=64)  # every pipelined mesh of a search cuts the same weights into its stages: once per count
def _balanced_cuts(weights: tuple[float, ...], stages: int) -> tuple[int, ...]:
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the lightest heaviest run cutting the first i weights into k runs
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    start = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-15:
                    best[k][i], start[k][i] = value, j
    cuts, i = [], n
    for k in range(stages, 0, -1):
        i = start[k][i]
        cuts.append(i)
    return tuple(cuts[::-1])


def rank_chunks(row, pp: int, rank: int, starts: list[int], n_ops: int) -> tuple[list[int], tuple]:
    """The stages pipeline rank `rank` runs under `row`, and their op ranges."""
    stages = len(starts)
    if row.stages_per_rank is StagesPerRank.ONE:
        mine = [rank]
    elif row.stages_per_rank is StagesPerRank.V_SHAPE:
        mine = [rank, 2 * pp - 1 - rank]
    else:
        mine = list(range(rank, stages, pp))
    ends = starts[1:] + [n_ops]
    return mine, tuple((starts[s], ends[s] - 1) for s in mine)


def fastest_slot(table: CostTable, m: int) -> float:
    """A rank's micro-batch from its table as pipelined with `m` micro-batches, every unit at its fastest option (its
    step less its optimizer, over the micro-batches): a function of the table alone, kept per kind of stage."""
    return sum(min((step - cost.optimizer_s) / m for step, cost in zip(unit_step_s(table, u), table.costs[u]))
               for u in range(len(table.units)))


def slot_bounds(sums: list[float]) -> tuple[float, float]:
    """Lower bounds on a pipeline's slot (its slowest rank's micro-batch) from its ranks' `fastest_slot`s: the
    slowest rank's (this cut), and the ranks' mean (any cut: each unit's fastest time is its own wherever it is
    cut, and the slowest rank holds at least the mean)."""
    return max(sums), sum(sums) / len(sums)


# schedule -> the one that beats it wherever both run, under this cost model: 1F1B has GPipe's bubble with fewer
# micro-batches in flight. (Zero bubble no longer counts as beating interleaved 1F1B: it holds min(m, pp)
# micro-batches and its split backward's bytes on every rank, where interleaved 1F1B holds more on rank 0 only.)
_DOMINATED_BY = {"gpipe": "1f1b"}
# schedules offered only when asked for (`--schedule`): from which pipeline degree their memory is not all priced, and
# what it leaves out (said beside such a plan: autoplan.cli.warnings). ZB-V's drain outweighs the steady state priced
# (cost_models.pipeline.deferred) where a chunk's activations are under 2r / (pp - r) times its weight outputs'
# gradients (a llama layer's are about 2 times: every pp >= 3); checked at pp 2 only
ASKED_ONLY: dict[str, tuple[int, str]] = {"zbv": (3, (
    "near the step's end its rank r >= 1 holds pp + r stage-chunks with 2r + 1 weight passes pending (torch's own "
    "order), beyond the steady state priced (2 pp chunks, one pending)"))}


def undominated(rows: list, fixed: str | None) -> list:
    """The schedules worth solving: a dominated one only where what beats it does not run, or when asked for."""
    if fixed is not None:
        return rows
    rows = [row for row in rows if row.name not in ASKED_ONLY]
    names = {row.name for row in rows}
    return [row for row in rows if _DOMINATED_BY.get(row.name) not in names]


def shifted(cuts: list[int], stage: int, units: int) -> list[int] | None:
    """The cuts with one unit moved off `stage` into the neighbour that can take it (the later one first:
    the earlier stages hold more micro-batches in flight); None where the stage has one unit left."""
    ends = cuts[1:] + [units]
    if ends[stage] - cuts[stage] < 2:
        return None
    moved = list(cuts)
    if stage + 1 < len(cuts):
        moved[stage + 1] -= 1
    else:
        moved[stage] += 1
    return moved


def stage_modules(units: list[Unit], ops: list[OpRecord], positions: list[int]) -> list[str]:
    """The module paths a stage holds, in forward order: its units', and the root's children its root ops
    run in (the final norm)."""
    owner_paths = [u.path for u in units]
    modules: list[str] = []
    for position in positions:
        module = ops[position].module
        if not module:
            continue
        path = next((p for p in owner_paths if p and (module == p or module.startswith(p + "."))), None)
        path = path or module.split(".")[0]
        if path not in modules:
            modules.append(path)
    return modules


def stage_cluster(cluster: Cluster, mesh: Mesh) -> Cluster:
    """The cluster one pipeline stage's ranks make (whole nodes, or a part of each node), with its tensor
    degree: what their data-parallel groups span and share, their host memory."""
    stage_gpus = mesh.world_size // mesh.pp
    nodes = max(1, stage_gpus // mesh.gpus_per_node)
    sub = Mesh(nodes=nodes, gpus_per_node=min(mesh.gpus_per_node, stage_gpus), tp=mesh.tp,
               sequence_parallel=mesh.sequence_parallel)
    host = cluster.host_mem_bytes
    if host is not None and stage_gpus < mesh.gpus_per_node:
        host = host * stage_gpus // mesh.gpus_per_node
    return replace(cluster, host_mem_bytes=host).with_mesh(sub)


@dataclass
class _Trace:
    ops: list[OpRecord]


class StageTables(_Source):
    """The tables of a pipeline rank's units (`chunks`: its stages' op ranges [first, last] of the base's
    trace), from the model's `CostTables`."""

    def __init__(self, base: CostTables, chunks: list[tuple[int, int]]):
        self.base, self.chunks = base, chunks
        self.tracer = base.tracer
        self.positions = [p for first, last in chunks for p in range(first, last + 1)]
        kept = set(self.positions)
        new_index = {old: new for new, old in enumerate(self.positions)}
        self.unit_index = [u for u, unit in enumerate(base.units) if unit.is_root or unit.first_op in kept]
        ops = base.trace_1.ops
        names = {ops[p].name for p in self.positions}
        root_modules = {ops[p].module for p in self.positions}
        paths = {base.units[u].path for u in self.unit_index}
        self.units = [self._unit(base.units[u], new_index, names, root_modules, paths) for u in self.unit_index]
        self.trace_1 = _Trace([ops[p] for p in self.positions])
        self.op_ids = [base.op_ids[p] for p in self.positions]
        self._inputs: dict[int, TableInputs] = {}

    def _unit(self, unit: Unit, new_index: dict[int, int], names: set[str], modules: set[str], paths: set[str]) -> Unit:
        if not unit.is_root:
            return replace(unit, first_op=new_index[unit.first_op], last_op=new_index[unit.last_op],
                           children=[c for c in unit.children if c in paths])
        last_stage = self.chunks[-1][1] == len(self.base.trace_1.ops) - 1
        params = [p for p in unit.params if p.name.rpartition(".")[0] in modules
                  or last_stage and not _used(p.name, self.base.trace_1.ops)]
        return replace(unit, params=params, children=[c for c in unit.children if c in paths],
                       ops=[name for name in unit.ops if name in names], first_op=0, last_op=len(new_index) - 1)

    def inputs(self, micro_batch_size: int, training: Training | None = None) -> TableInputs:
        if micro_batch_size not in self._inputs:
            base = self.base.inputs(micro_batch_size)
            self._inputs[micro_batch_size] = TableInputs(
                units=self.units, ops=[base.ops[p] for p in self.positions],
                keep={mode: [values[u] for u in self.unit_index] for mode, values in base.keep.items()},
                backward_keep={mode: [values[u] for u in self.unit_index] for mode, values in base.backward_keep.items()},
                kept_saved=base.kept_saved, op_ids=self.op_ids)
        return self._inputs[micro_batch_size]

    def for_layout(self, layout: TpLayout | None) -> TableSource:
        """These tables under a tensor-parallel layout, restricted to the rank's modules."""
        if layout is None or layout.degree == 1:
            return self
        return TensorParallelTables(self, _restricted(layout, self.units, self.trace_1.ops), whole=layout)

    def full_units(self) -> list[Unit]:
        return self.units

    @cached_property
    def key(self) -> tuple:
        """Equal for ranks whose tables are equal: their units' classes (a model's repeated blocks are one)."""
        classes = _classes(self.base)
        root = set(next(unit for unit in self.units if unit.is_root).ops)
        root_ops = tuple(self.op_ids[i] for i, op in enumerate(self.trace_1.ops) if op.name in root)
        return tuple(classes[u] for u in self.unit_index), root_ops, len(self.chunks)


def weight_outputs(source_of, chunks, micro_batch_size: int, training, pending: int = 0) -> tuple | None:
    """What cost_models.pipeline.split_backward reads for a rank of `source_of(chunks)` (its TableSource, asked for
    only here): its `pending` deferred chunks, the first op of its later stage and of its stages that split their
    backward (not the model's first stage: that one runs no input-gradient pass), per op its weight output's gradient
    bytes. None: no split backward, or the later stage is the first."""
    if not pending or chunks[-1][0] == 0:
        return None
    source, t = source_of(chunks), Training(training.seq_len, training.dtype, training.optimizer)
    # read for every schedule, rank and flight: once per source (a rank's, never changed) and micro-batch
    weights = memo(("weight outputs", id(source), micro_batch_size, t.seq_len, t.dtype, t.optimizer),
                   lambda: weight_output_bytes(_ops(source, micro_batch_size, t)), held=(source,))
    later = len(weights) - (chunks[-1][1] - chunks[-1][0] + 1)
    return pending, later, later if chunks[0][0] == 0 else 0, weights


def _ops(source, micro_batch_size: int, training: Training) -> list[OpRecord]:
    """A rank's ops as its inputs hold them: of a tensor-parallel view, its `split_ops`, without the rest of its inputs
    (what a unit keeps: read only where its tables are built)."""
    if type(source) is TensorParallelTables:
        return source.split_ops(micro_batch_size)
    return source.inputs(micro_batch_size, training).ops


def boundary_bytes(base: CostTables, first: int, last: int, micro_batch_size: int) -> int:
    """What a stage of the base's ops [first, last] sends on: its last op's output (before the loss)."""
    ops = base.inputs(micro_batch_size).ops
    return next((ops[p].out_bytes for p in range(last, first - 1, -1) if ops[p].name != LOSS_NODE), 0)


def stage_boundaries(base: CostTables, layout: TpLayout | None, starts: list[int], micro_batch_size: int) -> list[int]:
    """Per stage (`starts`: each one's first op), its last op's output per micro-batch: what one of its ranks sends
    on (1/t of it where tensor parallelism splits the sequence), the last stage's the logits (1/t: its head
    vocabulary-parallel)."""
    ends = starts[1:] + [len(base.trace_1.ops)]
    tp = layout.degree if layout is not None else 1
    split = tp if layout is not None and layout.sequence_parallel else 1
    return [boundary_bytes(base, a, b - 1, micro_batch_size) // (split if b < ends[-1] else tp)
            for a, b in zip(starts, ends)]


def _used(name: str, ops: list[OpRecord]) -> bool:
    module = name.rpartition(".")[0]
    return any(op.module == module for op in ops)


def _classes(base: CostTables) -> list[int]:
    """The base's unit classes, found once per tables object and kept on it (a cache keyed by `id` handed a new
    object the classes of a freed one that had had its address: a test's pipelined search failed so, by chance)."""
    found = base.__dict__.get("_unit_classes")
    if found is None:
        found = base.__dict__["_unit_classes"] = unit_classes(base.inputs(1))
    return found


def _restricted(layout: TpLayout, units: list[Unit], ops: list[OpRecord]) -> TpLayout:
    """The layout's regions, embedding and head that lie in `units` (others would fall to the root), and the
    roles of the modules that run here (`ops`' modules and their ancestors): the other stages' modules would
    charge this one their DTensor dispatch (`tp_time.tp_collectives`)."""
    running = {""}
    for module in {op.module for op in ops}:
        running.update(_ancestors(module))
    paths = {u.path for u in units if not u.is_root}
    params = {p.name for u in units for p in u.params}

    def inside(path: str | None) -> bool:  # the path, or a dotted prefix of it, a unit's
        return path is not None and (not paths.isdisjoint(_ancestors(path)) or f"{path}.weight" in params)

    return replace(layout, regions=tuple(r for r in layout.regions if inside(r)),
                   roles={path: role for path, role in layout.roles.items() if path in running},
                   embedding=layout.embedding if inside(layout.embedding) else None,
                   head=layout.head if inside(layout.head) else None)


@lru_cache(maxsize=65536)  # a module path's ancestors: every stage of every pipelined mesh asks for its modules'
def _ancestors(path: str) -> frozenset[str]:
    """The path and its dotted prefixes ("a.b.c": "a.b.c", "a.b", "a")."""
    parts = path.split(".")
    return frozenset(".".join(parts[:k]) for k in range(1, len(parts) + 1))
