"""The pipeline's records: the mesh's pipeline degree and the plan file's pipeline (stages, schedule)."""

import pytest
from pydantic import ValidationError

from autoplan.plan.pipeline_spec import PipelineSpec
from cost_models.mesh import Mesh, MeshError
from cost_models.schedules import SCHEDULES


def test_pipeline_stages_take_whole_nodes_or_equal_parts_of_each_node():
    mesh = Mesh(nodes=8, gpus_per_node=8, tp=8, pp=4)
    assert (mesh.dp, mesh.dp_per_node, mesh.dims) == (2, 1, (("pp", 4), ("dp", 2), ("tp", 8)))
    assert [mesh.pipeline_rank(r) for r in (0, 15, 16, 63)] == [0, 0, 1, 3]
    assert [mesh.data_rank(r) for r in (0, 8, 16, 24)] == [0, 1, 0, 1]  # stage k's rank j trains on stage 0's rows
    within = Mesh(nodes=1, gpus_per_node=4, pp=2)
    assert (within.dp, within.dp_per_node) == (2, 2)
    assert Mesh(nodes=8, gpus_per_node=8).pipeline_degrees() == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(MeshError, match="`pp` 2 does not cut"):
        Mesh(nodes=1, gpus_per_node=8, tp=8, pp=2)
    with pytest.raises(MeshError, match="`pp` 3"):
        Mesh(nodes=2, gpus_per_node=8, pp=3)
    # the pipeline degree set as the others are: the other degrees kept, a degree that does not cut refused
    assert Mesh(nodes=2, gpus_per_node=8).with_tensor(4, True).with_pipeline(2) == Mesh(
        nodes=2, gpus_per_node=8, tp=4, sequence_parallel=True, pp=2)
    with pytest.raises(MeshError, match="`pp` 2 does not cut"):
        Mesh(nodes=1, gpus_per_node=8).with_tensor(8).with_pipeline(2)


def _stage(rank, modules):
    return {"rank": rank, "modules": modules, "units": modules, "peak_mem_bytes": 1, "fwd_s": 0.1, "bwd_s": 0.2}


def test_a_pipeline_record_names_a_registered_schedule_and_puts_a_stage_on_every_rank():
    spec = PipelineSpec.model_validate({"degree": 2, "schedule": "1f1b", "microbatches": 4,
                                        "stages": [_stage(0, ["embed", "layers.0"]), _stage(1, ["layers.1", "head"])]})
    assert spec.stages_per_rank == 1 and SCHEDULES[spec.schedule].torch_class == "Schedule1F1B"
    with pytest.raises(ValidationError, match="unknown pipeline schedule 'pipedream'"):
        PipelineSpec.model_validate({**spec.model_dump(), "schedule": "pipedream"})
    with pytest.raises(ValidationError, match="not every pipeline rank"):
        PipelineSpec.model_validate({**spec.model_dump(), "stages": [_stage(0, ["a"]), _stage(0, ["b"])]})
