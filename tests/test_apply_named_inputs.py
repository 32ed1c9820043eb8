"""`autoplan apply` of models whose forward takes named inputs (the `--inputs` spec the plan records: T5's
input and decoder ids, ViT's pixel values): each rank makes its micro-batches from the spec
(autoplan.run.named_inputs) and trains with the planner's loss for what the model returns. On two gloo ranks a
plan trains as one process does on the same inputs (tests/hf_tp_parity_worker.py), and the CLI runs it end to
end with its report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autoplan
from autoplan.cli.main import main
from autoplan.run.report import load_report

TESTS_DIR = Path(__file__).parent
REPO_ROOT = TESTS_DIR.parent
pytestmark = [pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("transformers")

MODELS = {
    "t5": dict(model_type="t5", architectures=["T5ForConditionalGeneration"], d_model=64, d_ff=128, d_kv=16,
               num_heads=4, num_layers=2, num_decoder_layers=2, vocab_size=256, dropout_rate=0.0,
               feed_forward_proj="relu", relative_attention_num_buckets=32, decoder_start_token_id=0,
               is_encoder_decoder=True),
    "vit": dict(model_type="vit", architectures=["ViTForImageClassification"], hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8, num_channels=3,
                qkv_bias=True, id2label={"0": "a", "1": "b"}),
}


def _plan(folder: Path, name: str) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MODELS[name]))
    plan = autoplan.search(f"hf:{folder}", "1GB", gpus=2, seq_len=16 if name == "t5" else None,  # ViT: no sequence
                           profile="cpu-gloo-2", strategy="shard", batch_size=4, dtype="fp32")
    plan.save(folder / "plan.json")
    return folder / "plan.json"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("named")
    for name in MODELS:
        _plan(root / name, name)
    out = tmp_path_factory.mktemp("named_out") / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
         str(TESTS_DIR / "hf_tp_parity_worker.py"), str(root), str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(MODELS))
def test_a_plan_of_named_inputs_trains_as_one_process(results, name):
    result = results[name]
    assert "error" not in result, result.get("error")
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)
    assert result["max_param_diff"] < 5e-5
    assert len(set(result["losses"])) == len(result["losses"])  # each step's inputs are new


def test_apply_runs_t5_from_the_plan_s_inputs(tmp_path, capfd):
    plan_path, report_path = _plan(tmp_path / "t5", "t5"), tmp_path / "r.json"
    code = main(["apply", str(plan_path), "--model", f"hf:{plan_path.parent}", "--steps", "2", "--warmup", "1",
                 "--report", str(report_path)])
    assert code == 0, capfd.readouterr().err[-3000:]
    report = load_report(report_path)
    assert report.status == "ok" and report.world_size == 2
    assert len(report.measured.losses) == 3 and all(0 < loss < 10 for loss in report.measured.losses)
