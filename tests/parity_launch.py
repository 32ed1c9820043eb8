"""One torchrun launch of a parity worker (tests/*_parity_worker.py), shared by the parity tests: the worker
runs every case of its world size on gloo and rank 0 writes their results as JSON (apply_parity_worker.finish)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
REPO_ROOT = TESTS_DIR.parent


def launch(tmp_path_factory, worker: str, nproc: int) -> dict:
    """The results of `worker` (a file in tests/) launched on `nproc` gloo ranks; the test fails with the
    launch's output where it does not finish."""
    out = tmp_path_factory.mktemp(f"{Path(worker).stem}{nproc}") / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "--max-restarts=0", str(TESTS_DIR / worker), str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return json.loads(out.read_text())


def assert_matches_reference(result: dict, case: str) -> None:
    """A case's losses and parameters against the single-process reference: within float tolerance, or bf16
    rounding's where the case name says bf16."""
    assert "error" not in result, result.get("error")
    loss_tol, param_tol = (1e-2, 2e-2) if "bf16" in case else (1e-5, 5e-5)
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=loss_tol)
    assert result["max_param_diff"] < param_tol
