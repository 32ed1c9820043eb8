"""What a search shares between its cost tables (cost_models.search_memo: each class of units priced once, a
stage's tensor-parallel ops taken from the whole model's, ...) changes no table, and is kept only while the
search runs."""

import dataclasses

import autoplan
from autoplan.api.prepare import prepare
from autoplan.models.tp_layout import recognise
from autoplan.settings import SearchSettings
from autoplan.solve.stages import StageTables, forward_units, stage_cluster
from cost_models.mesh import Mesh
from cost_models.search_memo import memo, search_scope, searching


def test_memo_keeps_only_inside_a_search():
    made = []

    def make() -> int:
        made.append(len(made) + 1)
        return made[-1]

    assert (memo(("k",), make), memo(("k",), make)) == (1, 2)  # no search: made afresh
    with search_scope():
        assert (memo(("k",), make), memo(("k",), make)) == (3, 3)
        with search_scope():  # a search inside another starts empty
            assert memo(("k",), make) == 4
        assert memo(("k",), make) == 3
    assert memo(("k",), make) == 5 and not searching()


def _tables(request, layout) -> list[dict]:
    """The whole model's tables and each stage's of a two-stage cut, at two micro-batches, with and without offload."""
    base, t = request.tables, request.training
    units = forward_units(base.units)
    cut = base.units[units[len(units) // 2]].first_op
    whole = Mesh(nodes=1, gpus_per_node=4, tp=2, sequence_parallel=True)
    staged = Mesh(nodes=1, gpus_per_node=4, tp=2, pp=2, sequence_parallel=True)
    sources = [(base.for_layout(layout), request.cluster.with_mesh(whole))]
    sources += [(StageTables(base, [chunk]).for_layout(layout), stage_cluster(request.cluster, staged))
                for chunk in ((0, cut - 1), (cut, len(base.trace_1.ops) - 1))]
    return [dataclasses.asdict(source.table(size, 2, cluster, t.seq_len, t.dtype, t.optimizer, offload))
            for source, cluster in sources for size in (1, 3) for offload in (None, True)]


def test_tables_in_a_search_are_the_tables_built_alone():
    request = prepare(SearchSettings.create(None, model="llama-tiny", mem="80GB", gpus=4, seq_len=64,
                                            profile="h100-sxm-80gb"))
    layout = recognise(request.model.module, 2, True)
    alone = _tables(request, layout)
    with search_scope():
        first, again = _tables(request, layout), _tables(request, layout)  # again: every class priced already
    assert first == alone and again == alone


def test_a_search_keeps_nothing_after_it():
    autoplan.search("llama-tiny", "80GB", gpus=4, seq_len=64, profile="h100-sxm-80gb")
    assert not searching()
