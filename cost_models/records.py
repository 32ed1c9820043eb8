"""What the cost models read about a model: its traced ops and its FSDP units.

These records are produced by `autoplan.tracing` (the tracers and the unit builder) and consumed by
the cost models; they live here, below both, so that `cost_models` needs nothing from `autoplan`.
Byte and FLOP counts are per rank and per micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["LOSS_NODE", "GraphEdges", "OpRecord", "ModelTrace", "ParamInfo", "Unit", "extrapolate_ops"]

LOSS_NODE = "loss"  # the loss computed after the model's output; belongs to the root module ""


@dataclass
class OpRecord:
    """One fx node's cost at a given micro-batch size; bytes and FLOPs are per rank, per micro-batch."""

    name: str  # fx node name, unique in the graph
    kind: str  # op kind: module class ("Linear") or function name ("gelu", "scaled_dot_product_attention")
    module: str  # path of the innermost module the op runs in ("" is the root)
    input_shapes: tuple[tuple[int, ...], ...]
    dtype: str
    out_bytes: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_bytes: int = 0  # bytes read + written by the forward's aten ops
    bwd_bytes: int = 0
    saved_bytes: int = 0  # bytes first saved for backward by this op (excluding parameters)
    fwd_max_alloc_bytes: int = 0  # largest single tensor the forward allocates (a transient)
    fwd_transient_bytes: int = 0  # held while the op runs beyond saved activations (see fill_forward_transients)
    # the backward's own storages (gradients and temporaries; not parameter gradients) alive when this
    # op's backward starts, and at most while it runs, and the parameter gradients it computes
    bwd_in_bytes: int = 0
    bwd_live_bytes: int = 0
    param_grad_bytes: int = 0
    is_matmul: bool = False  # dominated by matmul-like aten ops (for the compute model's fits)
    # what besides input shapes decides the work: a module's configuration (Linear's out_features),
    # a function's constant arguments (is_causal, a slice); "" when there is none
    variant: str = ""
    # an attention call: the kernel priced and what it was asked ("flash: causal, K/V 8 of 32 heads"); ""
    attention: str = ""
    # aten ops it ran that no FLOP formula prices ("aten.foo,custom.bar"), and a guess of their FLOPs
    unpriced: str = ""
    unpriced_flops: int = 0

    @property
    def key(self) -> str:
        """Identity of the op's work for measured timings: kind, input shapes, dtype, variant."""
        shapes = ";".join("x".join(map(str, shape)) for shape in self.input_shapes)
        return f"{self.kind}[{shapes}]{self.dtype}{self.variant}"


@dataclass
class ModelTrace:
    """The traced operator graph (networkx, nodes carry an OpRecord under 'op') in execution order. `graph` may be
    given as a function that builds it, called when it is first read (an expanded 3000-layer trace's graph of
    132,000 nodes is read by nothing that plans, and took a fifth of the trace to build), or as its GraphEdges,
    whose neighbours `adjacency` reads without building it."""

    graph: nx.DiGraph
    ops: list[OpRecord]
    micro_batch_size: int
    seq_len: int
    dtype: str
    # unit-boundary information: fx node name -> tensor-input storages (key, bytes) it reads
    input_storages: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # storage key -> name of the node that produced it
    storage_producer: dict[int, str] = field(default_factory=dict)
    # storages saved for backward: key -> (bytes, name of the first node that saved it)
    saved_storages: dict[int, tuple[int, str]] = field(default_factory=dict)

    def op(self, name: str) -> OpRecord:
        by_name = self.__dict__.get("_by_name")
        if by_name is None:  # the ops are not changed once traced
            by_name = self.__dict__["_by_name"] = {op.name: op for op in self.ops}
        return by_name[name]

    def adjacency(self) -> tuple[Mapping[str, Iterable[str]], Mapping[str, Iterable[str]]]:
        """Each node's predecessors and successors in the graph's order (networkx's `pred` and `succ`)."""
        graph = self.__dict__["_graph"]
        if isinstance(graph, GraphEdges):
            return graph.adjacency()[:2]
        graph = self.graph
        return graph.pred, graph.succ

    def nodes(self) -> list[tuple[str, dict]]:
        """The graph's nodes with their attributes ({"op": OpRecord} or none), in networkx's order."""
        graph = self.__dict__["_graph"]
        if isinstance(graph, GraphEdges):
            return [(name, {"op": op} if op is not None else {}) for name, op in graph.adjacency()[2].items()]
        return list(self.graph.nodes(data=True))

    def edges(self) -> list[tuple[str, str]]:
        """The graph's edges in networkx's order (each node's successors, node by node)."""
        _pred, succ = self.adjacency()
        return [(a, b) for a, ends in succ.items() for b in ends]


def _graph(trace: ModelTrace) -> nx.DiGraph:
    graph = trace.__dict__["_graph"]
    if callable(graph):  # a builder (a networkx graph is not callable)
        graph = trace.__dict__["_graph"] = graph()
    return graph


ModelTrace.graph = property(_graph, lambda trace, graph: trace.__dict__.__setitem__("_graph", graph))


class GraphEdges:
    """A trace's graph as its nodes (name, OpRecord or None) and edges, built into a networkx DiGraph when called
    (ModelTrace.graph, for a reader that wants networkx). The tracers, the cache and the expansion of repeated
    blocks read only nodes, edges and neighbours (ModelTrace.adjacency, nodes, edges), so a search imports no
    networkx (0.08 CPU-s) and builds no graph."""

    def __init__(self, nodes: Iterable[tuple[str, OpRecord | None]], edges: Iterable[tuple[str, str]]):
        self.nodes, self.edges = list(nodes), list(edges)
        self._adjacency: tuple[dict, dict, dict] | None = None

    def __call__(self) -> nx.DiGraph:
        import networkx as nx

        graph = nx.DiGraph()
        graph.add_nodes_from((name, {"op": op} if op is not None else {}) for name, op in self.nodes)
        graph.add_edges_from(self.edges)
        return graph

    def feeding(self, sink: str) -> GraphEdges:
        """This graph with an edge to `sink` from each other node that has no successor (a trace's last ops feed
        its loss)."""
        _pred, succ, ops = self.adjacency()
        return GraphEdges(self.nodes, self.edges + [(name, sink) for name in ops if name != sink and not succ[name]])

    def adjacency(self) -> tuple[dict[str, dict[str, None]], dict[str, dict[str, None]], dict[str, OpRecord | None]]:
        """Predecessors, successors and each node's op, ordered as networkx orders them: the nodes, then an edge's
        ends not among them (without an op); a node's neighbours in the order of their first edge."""
        if self._adjacency is None:
            ops = dict(self.nodes)
            pred: dict[str, dict[str, None]] = {name: {} for name in ops}
            succ: dict[str, dict[str, None]] = {name: {} for name in ops}
            for a, b in self.edges:
                for end in (a, b):
                    if end not in ops:
                        ops[end], pred[end], succ[end] = None, {}, {}
                succ[a][b] = pred[b][a] = None
            self._adjacency = pred, succ, ops
        return self._adjacency


_SCALED_FIELDS = (
    "out_bytes", "fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes", "saved_bytes",
    "fwd_max_alloc_bytes", "fwd_transient_bytes", "bwd_in_bytes", "bwd_live_bytes",
    "param_grad_bytes", "unpriced_flops",
)


def extrapolate_ops(ops_at_1: list[OpRecord], ops_at_2: list[OpRecord], micro_batch_size: int,
                    ids: list[int] | None = None) -> list[OpRecord]:
    """Op costs at any micro-batch size from traces at 1 and 2: every count here is affine in the
    batch (per-sample activations and FLOPs plus batch-independent parameter traffic). `ids`: per op, a
    number equal for ops alike in everything but name and module at both sizes (a model's repeated blocks):
    each kind is extrapolated once and copied under the other ops' names."""
    result, made = [], {}
    for index, (one, two) in enumerate(zip(ops_at_1, ops_at_2, strict=True)):
        assert one.name == two.name, "traces at different batch sizes must share one fx graph"
        kind = ids[index] if ids is not None else index
        template = made.get(kind)
        if template is None:
            made[kind] = record = _extrapolated(one, two, micro_batch_size)
        else:
            record = object.__new__(OpRecord)  # a copy; copy.copy is 10x slower on a dataclass
            record.__dict__.update(template.__dict__)
            record.name, record.module = one.name, one.module
        result.append(record)
    return result


def _extrapolated(one: OpRecord, two: OpRecord, micro_batch_size: int) -> OpRecord:
    values = {f: max(0, getattr(one, f) + (getattr(two, f) - getattr(one, f)) * (micro_batch_size - 1))
              for f in _SCALED_FIELDS}
    shapes = tuple((micro_batch_size,) + s[1:] if s and s[0] == 1 and s != t else s
                   for s, t in zip(one.input_shapes, two.input_shapes))
    # constant arguments can hold the batch size (a view's sizes); batch 2's are the nearer guess
    variant = one.variant if micro_batch_size == 1 else two.variant
    return OpRecord(one.name, one.kind, one.module, shapes, one.dtype, is_matmul=one.is_matmul, variant=variant,
                    attention=one.attention, unpriced=one.unpriced, **values)


@dataclass
class ParamInfo:
    name: str  # canonical fully-qualified name
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass
class Unit:
    """One FSDP unit. `params` are those it owns (not those of nested units)."""

    path: str  # module path; "" is the root
    params: list[ParamInfo] = field(default_factory=list)
    parent: str | None = None  # enclosing unit's path (None for the root)
    children: list[str] = field(default_factory=list)  # nested units' paths
    ops: list[str] = field(default_factory=list)  # names of traced ops owned (innermost unit)
    first_op: int = 0  # index in execution order of the first op in its subtree
    last_op: int = 0  # index of the last op in its subtree

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def is_root(self) -> bool:
        return self.path == ""

    @property
    def is_leaf(self) -> bool:
        return not self.children
