"""`autoplan apply` as a measured training run: real torchrun launches, 2 gloo ranks on the CPU."""

import json
import math
import os
import re
import tempfile
from pathlib import Path

import pytest
from planmaker import make_plan

from autoplan.cli.main import main
from autoplan.models.factory import load_factory
from autoplan.models.zoo import build_model
from autoplan.run.report import load_report

TESTS_DIR = Path(__file__).parent
pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test launches torchrun (~5 s each)


@pytest.fixture(autouse=True)
def ranks_import_test_factories(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))


@pytest.fixture
def own_tmpdir(tmp_path, monkeypatch):
    """A TMPDIR of the test's own (this process's and the launcher's), to see what a run leaves there."""
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def alpaca_file(path: Path) -> Path:
    records = [
        {"instruction": f"Give an example of the number {i}.", "input": "", "output": f"{i} is a number " * 5}
        for i in range(20)
    ]
    path.write_text(json.dumps(records))
    return path


def test_run_reports_predicted_beside_measured(tmp_path, capfd, own_tmpdir):
    plan_path, report_path = tmp_path / "plan.json", tmp_path / "r.json"
    # model.name edited to another zoo name: the config (gpt2-tiny's) is what runs, and names the run
    plan = make_plan("gpt2-tiny", {"transformer.h.0": "shard+ckpt", "transformer.h.1": "replicate"},
                     grad_accum_steps=2, name="llama-tiny")
    plan.cluster.profile = "cpu-gloo-2"  # a profile of this kind of device: the run estimates its time
    plan.save(plan_path)
    code = main(["apply", str(plan_path), "--steps", "2", "--warmup", "1", "--report", str(report_path),
                 "--data", str(alpaca_file(tmp_path / "alpaca.json"))])
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "predicted" in out and "measured" in out and "peak memory per rank" in out
    # said before the run: what runs (1 warm-up, 2 measured for memory, 2 untracked timed) and an estimate
    assert "5 steps in all" in out and "estimate: about" in out
    assert "warning: the plan names its model 'llama-tiny'" in out
    assert out.index("5 steps in all") < out.index("[autoplan apply] step 1/3")
    assert "rank 0: loss" in out and "loss by step, mean over the 2 rank(s)" in out

    report = json.loads(report_path.read_text())
    assert report["model"] == "gpt2-tiny" and "llama-tiny" in report["model_note"]
    assert report["status"] == "ok" and report["world_size"] == 2 and not report["dry_run"]
    assert report["global_batch_size"] == 2 * 2 * 2
    measured = report["measured"]
    assert len(measured["losses"]) == 3 and all(math.isfinite(loss) for loss in measured["losses"])
    assert measured["step_time_s"] > 0 and report["predicted"]["step_time_s"] == pytest.approx(0.1)
    assert measured["peak_mem_bytes"] == max(measured["peak_mem_bytes_per_rank"].values())
    assert [p.name for p in own_tmpdir.iterdir() if not p.name.startswith("torchinductor_")] == []  # no run
    # directory, no torchelastic_* log folder (torchinductor_USER is torch's compile cache, one for all runs)
    # Persistent state alone is parameters + gradients + two AdamW states: 16 bytes per parameter,
    # the blocks' share halved by sharding on 2 ranks, minus the replicated block 1 (held in full).
    n_params = sum(p.numel() for p in build_model("gpt2-tiny").parameters())
    assert 16 * n_params / 2 < measured["peak_mem_bytes"] < 16 * n_params * 3
    assert "live tensor" in measured["peak_mem_source"]
    assert load_report(report_path).measured.losses == measured["losses"]  # the file is a valid RunReport


def test_offloaded_and_selectively_checkpointed_units_run_with_host_memory_reported(tmp_path, capfd):
    plan_path, report_path = tmp_path / "plan.json", tmp_path / "r.json"
    plan = make_plan("gpt2-tiny", {"transformer.h.0": "shard+offload", "transformer.h.1": "shard+sel"})
    block = sum(p.numel() for p in build_model("gpt2-tiny").transformer.h[0].parameters())
    plan.predicted.host_mem_bytes = 16 * block // 2  # parameters, gradients, two AdamW states; sharded over 2
    plan.save(plan_path)
    code = main(["apply", str(plan_path), "--steps", "1", "--warmup", "1", "--report", str(report_path)])
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "host memory per rank" in out and "the host is the device" in out
    measured = load_report(report_path).measured
    # the measured host storages: the shards (no padding: every dim 0 here is even) plus AdamW's step counters
    n_tensors = len(list(build_model("gpt2-tiny").transformer.h[0].parameters()))
    assert measured.host_mem_bytes == 16 * block // 2 + 4 * n_tensors
    assert set(measured.host_mem_bytes_per_rank) == {"0", "1"}
    assert all(math.isfinite(loss) for loss in measured.losses)


def test_factory_plan_dry_run_on_fewer_ranks(tmp_path, capfd):
    plan_path, report_path = tmp_path / "plan.json", tmp_path / "r.json"
    factory_model = build_model("gpt2-tiny")  # same structure as factory_models.tiny_gpt2
    make_plan(factory_model=factory_model, name="factory_models:tiny_gpt2",
              decisions={"transformer.h.0": "shard_keep", "transformer.h.1": "hybrid"}, nodes=2).save(plan_path)
    code = main(["apply", str(plan_path), "--model", "factory_models:tiny_gpt2", "--nproc", "1",
                 "--steps", "1", "--warmup", "1", "--report", str(report_path)])
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "DRY RUN" in out
    report = json.loads(report_path.read_text())
    assert report["dry_run"] and report["world_size"] == 1 and report["planned_world_size"] == 2
    assert len(report["measured"]["losses"]) == 2


def test_run_over_memory_limit_fails_with_a_clear_message(tmp_path, capfd):
    plan_path, report_path = tmp_path / "plan.json", tmp_path / "r.json"
    make_plan("gpt2-tiny", {"transformer.h.0": "shard"}, predicted_peak_mem_bytes=1_500_000).save(plan_path)
    code = main(["apply", str(plan_path), "--steps", "1", "--mem-limit", "1.2MB", "--report", str(report_path)])
    _, err = capfd.readouterr()
    assert code == 1
    assert "ran out of memory" in err and "over the limit of 1200000 bytes" in err
    assert "predicted peak 1.50 MB" in err and "measured peak so far" in err
    report = json.loads(report_path.read_text())
    assert report["status"] == "failed" and report["failures"]


def test_a_rank_that_dies_stops_the_run(tmp_path, capfd):
    plan_path = tmp_path / "plan.json"
    make_plan(factory_model=load_factory("factory_models:dying_gpt2", device="meta"), name="factory_models:dying_gpt2",
              decisions={"transformer.h.0": "shard"}).save(plan_path)
    code = main(["apply", str(plan_path), "--model", "factory_models:dying_gpt2", "--steps", "3", "--timeout", "60"])
    _, err = capfd.readouterr()
    assert code == 1
    failures = err[err.index("the run failed:"):].splitlines()[1:]
    assert "rank 1 died at step 2: it was killed by SIGKILL" in failures[0]
    # rank 0 either sees its collective fail on the lost peer, or is stopped by the launcher first
    assert "rank 0 failed at step 2" in failures[1] or "rank 0 was stopped by the launcher" in failures[1]


def overcommit_refuses_huge_allocations() -> bool:
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() != "1"
    except OSError:
        return True


@pytest.mark.skipif(not overcommit_refuses_huge_allocations(), reason="vm.overcommit_memory=1 grants any allocation")
def test_a_micro_batch_that_cannot_be_allocated_is_named_not_a_traceback(tmp_path, capfd, own_tmpdir):
    plan_path = tmp_path / "plan.json"
    # every rank makes the step's whole batch of token ids: 2e11 x 17 int64 = 27.2 TB, which no allocator gives
    make_plan("gpt2-tiny", {"transformer.h.0": "shard"}, micro_batch_size=10**11,
              predicted_peak_mem_bytes=1_500_000).save(plan_path)
    code = main(["apply", str(plan_path), "--steps", "1", "--warmup", "0"])
    out, err = capfd.readouterr()
    assert code == 1
    assert "warning: the plan predicts a peak of 1.50 MB per rank, plus 27.20 TB" in out  # said before the run
    failures = err[err.index("the run failed:"):]
    # both ranks make the batch: whichever the allocator refuses first is the run's failure, the other is stopped
    # (or refused too); which one comes first is a race, so neither is expected
    refused = re.findall(r"rank ([01]) ran out of memory at step 1: could not allocate 27\.20 TB \(the CPU allocator: "
                         r"not enough memory\), while making step 1's batch of token ids", failures)
    assert refused and len(set(refused)) == len(refused), failures
    assert "predicted peak 1.50 MB" in failures
    assert "Traceback" not in err and "Root Cause" not in err and "ChildFailedError" not in err
    assert [p.name for p in own_tmpdir.iterdir() if not p.name.startswith("torchinductor_")] == []  # nor a failed one
