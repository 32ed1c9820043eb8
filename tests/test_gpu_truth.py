"""The GPU kit (benchmarks/gpu_truth.py) on this machine's CPU, so that its first run on a GPU is not its
first run: the quick kit end to end (a one-process profile, the fake-world memory grid, a one-rank
training run) writes one results file whose numbers are there and plausible; the time budget, the
stage names and the missing-package path fail or stop cleanly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_truth  # noqa: E402
from gpu_truth_report import format_results  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_pythonpath(monkeypatch):
    """The kit puts the repository (and carried wheels) on PYTHONPATH for the commands it starts."""
    if "PYTHONPATH" in os.environ:
        monkeypatch.setenv("PYTHONPATH", os.environ["PYTHONPATH"])
    else:
        monkeypatch.delenv("PYTHONPATH", raising=False)


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_cpu_kit_writes_every_stage_into_one_results_file(tmp_path):
    out = tmp_path / "truth"
    # A budget this test never reaches, however busy the machine (under load the quick profile alone took most
    # of 5 minutes, and the grid's rows were then skipped); the timeout only guards against a hang.
    # test_an_exhausted_budget_skips_work_and_still_writes_the_results checks what a budget does.
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_truth.py"), "--device", "cpu", "--quick",
                           "--out", str(out), "--budget-min", "600"], capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "gpu_truth.json").read_text())
    text = (out / "gpu_truth.txt").read_text()
    assert results["runs"][0]["device"] == "cpu"
    assert set(results["stages"]) == {"profile", "grid", "compute", "checkpoint"}

    profile = results["stages"]["profile"]
    assert profile["status"] == "ok" and profile["links_from"] == "cpu-gloo-2"
    measured = json.loads(Path(profile["path"]).read_text())  # the kit's copy; a CPU run leaves profiles/ alone
    assert measured["source"] == "measured" and measured["host_link"]["overlaps_compute"] is False
    from autoplan.machine import cpu_identity  # the device it was measured on, as search and apply compare it
    assert measured["identity"]["name"] == cpu_identity().name
    assert measured["identity"]["cpu_features"] == cpu_identity().cpu_features
    assert not (REPO / "profiles" / Path(profile["path"]).name).exists()

    grid = results["stages"]["grid"]
    assert grid["profile"] == profile["path"] and len(grid["rows"]) == 7  # 2 micro-batches x 3 plans, a TP plan
    [tp] = [row for row in grid["rows"] if row["plan"] == "all-shard@tp2"]  # tensor degree 2, sequence-parallel
    assert plans_tp(out, tp) == (2, True)
    uniform = [row for row in grid["rows"] if row["plan"] != "autoplan"]
    assert all(row["status"] == "ok" for row in uniform), [row.get("note") for row in uniform]
    for row in uniform:  # all-shard plans: FSDP2's memory is what the model predicts, on the fake world too
        assert abs(row["mem_error"]) < 0.25, row
        assert row["measured_compute_s"] > 0 and row["predicted_compute_s"] > 0
        assert set(row["measured_phase_s"]) == set(row["predicted_phase_s"]) == {"forward", "backward", "optimizer"}
        assert row["cuda_max_allocated_bytes"] is None  # no CUDA here: the live-tensor peak only
    plans = json.loads((out / "plans.json").read_text())
    for row in grid["rows"]:  # each plan kept beside the results (one file), to replay its allocations later
        if "predicted" in row:
            assert plans[row["plan_key"]]["predicted"]["peak_mem_bytes"] == row["predicted"]["peak_mem_bytes"]
    # every stage ran inside its share of the budget, and says so
    for stage in ("profile", "grid", "compute", "checkpoint"):
        assert results["stages"][stage]["stage_wall_s"] <= results["stages"][stage]["allowance_s"] + 5
    assert len([p for p in out.iterdir() if p.is_file()]) <= 8  # what the device tool returns of $OUT

    [run] = results["stages"]["compute"]["rows"]
    assert run["status"] == "ok" and run["measured_step_s"] > 0 and run["measured_peak_bytes"] > 0
    assert abs(run["mem_error"]) < 0.25

    assert results["summary"]["grid"]["runs"] >= 4 and results["summary"]["compute"]["runs"] == 1
    # a block under each checkpoint mode, measured beside the step model's figure on the kit's profile
    checkpoint = results["stages"]["checkpoint"]
    assert checkpoint["model"] == "llama-tiny" and checkpoint["profile"] == profile["path"]
    assert [row["mode"] for row in checkpoint["rows"]] == ["none", "selective", "full"]
    assert all(row["status"] == "ok" and row["predicted_block_s"] > 0 for row in checkpoint["rows"]), checkpoint
    assert results["summary"]["grid"]["phase_compute_error"]["backward"]["n"] >= 4  # where a time miss is
    for heading in ("== profile: ok", "== fake-world memory grid", "== single-GPU runs",
                    "== a block under each checkpoint mode", "summary, grid"):
        assert heading in text
    assert text.strip() == format_results(results).strip()  # the text is the results file's, printed


def plans_tp(out: Path, row: dict) -> tuple[int, bool]:
    """The tensor degree and sequence parallelism of the plan the kit saved for `row`."""
    cluster = json.loads((out / "plans.json").read_text())[row["plan_key"]]["cluster"]
    return cluster["tp_degree"], cluster["sequence_parallel"]


def test_an_exhausted_budget_skips_work_and_still_writes_the_results(tmp_path, capsys):
    assert gpu_truth.main(["--device", "cpu", "--stages", "grid,compute", "--budget-min", "0", "--out",
                           str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_truth.json").read_text())
    rows = results["stages"]["grid"]["rows"] + results["stages"]["compute"]["rows"]
    assert rows and all(row["status"] == "skipped: out of time" for row in rows)
    assert results["summary"]["grid"]["runs"] == 0 and "not run" in (tmp_path / "gpu_truth.txt").read_text()


def test_resume_adds_stages_to_an_earlier_results_file(tmp_path):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"kind": "autoplan gpu truth", "runs": [], "stages": {"profile": {
        "status": "failed", "command": "autoplan profile ...", "stderr_tail": "no GPU"}}}))
    assert gpu_truth.main(["--device", "cpu", "--stages", "compute", "--budget-min", "0", "--resume", str(earlier),
                           "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_truth.json").read_text())
    assert results["stages"]["profile"]["status"] == "failed" and "compute" in results["stages"]
    assert results["stages"]["compute"]["profile"] == "cpu-gloo-2"  # no measured profile: the shipped one


@pytest.mark.parametrize("argv, message", [
    (["--stages", "grid,nonsense"], "unknown stage(s) nonsense"),
    (["--resume", "/no/such/file.json"], "no such file"),
])
def test_usage_errors(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_truth.main(["--device", "cpu", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_missing_packages_without_wheels_say_how_to_bring_them(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ortools" else real(name, *a))
    monkeypatch.setattr(gpu_truth, "WHEELS", tmp_path / "no-wheels")
    with pytest.raises(SystemExit, match="--fetch-wheels"):
        gpu_truth.ensure_packages()
