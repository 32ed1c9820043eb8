"""`autoplan.apply` inside a team's script: the meshes it takes, an optimizer and an LR scheduler of the script's
own. One torchrun launch of 2 gloo ranks (apply_api_worker.py) runs every case; each test checks one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
REPO_ROOT = TESTS_DIR.parent
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
         str(TESTS_DIR / "apply_api_worker.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return json.loads(out.read_text())


def _case(results, name):
    result = results[name]
    assert "error" not in result, result.get("error")
    return result


def test_the_plans_mesh_record_lays_out_hybrid_units_by_its_nodes(results):
    result = _case(results, "mesh_record")
    assert result["losses"] == pytest.approx(result["reference"], rel=1e-5)
    assert result["hybrid_local_fraction"] == 1.0  # 2 nodes of 1 GPU: replicated across the nodes


def test_a_dimension_of_the_scripts_own_runs_a_copy_of_the_plan_on_each_slice(results):
    result = _case(results, "outer_dimension")
    assert result["losses"] == pytest.approx(result["reference"], rel=1e-5)
    assert result["mesh_dims"] == ["replicate", "shard"]  # the replicated unit's 2-D mesh of the "dp" slice


def test_the_scripts_optimizer_and_schedule_train_the_sharded_model(results):
    result = _case(results, "named_dp_with_factories")
    assert result["optimizer"] == "SGD" and result["sharded"]
    assert result["losses"] == pytest.approx(result["reference"], rel=1e-5)
    assert result["lr_after"] == pytest.approx(0.05 * 0.5 ** 3)
    assert any("costed for adamw" in w and "SGD" in w for w in result["warnings"])


@pytest.mark.parametrize("case, message", [
    ("lr_and_factory", "UsageError: `lr` is the plan's optimizer's"),
    ("factory_not_an_optimizer", "returned str, not a torch.optim.Optimizer"),
    ("unnamed_2d", "must name its data-parallel dimension \"dp\""),
    ("tp_dimension_without_tp_plan", "PlanFileError: the mesh's \"tp\" dimension has 2 ranks"),
    ("record_of_other_degrees", "PlanFileError: the mesh record has tensor-parallel degree 2"),
])
def test_what_apply_refuses(results, case, message):
    refused = _case(results, "refusals")[case]
    assert refused is not None and message in refused
