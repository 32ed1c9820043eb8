"""The run report of `autoplan apply` (autoplan/run/report.py): its schema and its file, without a launch.

The ranks' results are made by hand here; tests/test_apply_run.py writes real reports from torchrun runs.
"""

import json
import math
from pathlib import Path

import pytest
from planmaker import make_plan

from autoplan.errors import AutoplanError
from autoplan.run.launch import LaunchResult, RankFailure
from autoplan.run.report import (
    REPORT_SCHEMA_VERSION,
    RunReport,
    build_report,
    format_report,
    load_report,
    run_report_json_schema,
)
from autoplan.run.worker import RankResult, RunSpec

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "autoplan" / "run" / "run_report_schema.json"


def rank_result(rank: int, steps: int = 3, loss: float = 2.5) -> RankResult:
    return RankResult(
        rank=rank, status="ok", phase="done", steps_done=steps, losses=[loss - 0.1 * i for i in range(steps)],
        step_times_s=[0.2 + 0.01 * (i + rank) for i in range(steps)], untracked_step_times_s=[],
        peak_mem_bytes_by_step=[1_000_000 + 1000 * (i + rank) for i in range(steps)],
        phase_peak_bytes_by_step=[{"forward": 900_000 + rank, "backward": 1_000_000 + rank, "optimizer": 800_000}
                                  for _ in range(steps)],
        peak_mem_bytes=1_100_000 + rank, peak_rss_bytes=50_000_000, mem_source="live tensor bytes (test)",
    )


def a_report(tmp_path, ranks=None, returncode: int = 0, failures=None, interrupted=None, local_ranks=None,
             **labels) -> RunReport:
    plan_path = tmp_path / "plan.json"
    plan = make_plan("gpt2-tiny", {"transformer.h.0": "shard"})
    plan.save(plan_path)
    spec = RunSpec(plan_path=str(plan_path), run_dir=str(tmp_path), device="cpu", steps=2, warmup_steps=1,
                   dry_run=False)
    ranks = ranks if ranks is not None else {0: rank_result(0), 1: rank_result(1)}
    launched = LaunchResult(returncode, ranks, failures or {}, local_ranks=local_ranks, interrupted=interrupted)
    return build_report(plan, str(plan_path), spec, 2, launched, **labels)


def test_checked_in_json_schema_matches_the_code():
    checked_in = json.loads(SCHEMA_PATH.read_text())
    assert checked_in == run_report_json_schema(), \
        "regenerate: python -m autoplan.run.report > autoplan/run/run_report_schema.json"


def test_schema_version_comes_first_and_unknown_fields_are_refused():
    schema = run_report_json_schema()
    assert list(schema["properties"])[0] == "schema_version"
    assert schema["additionalProperties"] is False
    assert all(d.get("additionalProperties") is False for d in schema["$defs"].values())


def test_report_round_trips_through_its_file(tmp_path):
    report = a_report(tmp_path)
    assert report.status == "ok" and report.schema_version == REPORT_SCHEMA_VERSION
    assert report.measured.step_time_s == pytest.approx(0.225)  # median of the timed steps, slowest rank
    assert report.measured.peak_mem_bytes == 1_100_001
    assert report.measured.phase_peak_bytes.backward == 1_000_001
    path = tmp_path / "r.json"
    report.save(path)
    data = json.loads(path.read_text())
    assert next(iter(data)) == "schema_version"
    # the keys scripts read
    assert data["measured"]["peak_mem_bytes_per_rank"] == {"0": 1_100_000, "1": 1_100_001}
    assert {"status", "world_size", "dry_run", "global_batch_size", "predicted", "failures"} <= set(data)
    assert load_report(path) == report
    assert "peak memory per rank" in format_report(load_report(path))


def test_a_nan_loss_survives_the_round_trip(tmp_path):
    report = a_report(tmp_path, ranks={0: rank_result(0, loss=math.nan), 1: rank_result(1, loss=math.nan)})
    report.save(tmp_path / "r.json")
    assert math.isnan(load_report(tmp_path / "r.json").measured.losses[0])


def test_a_failed_run_reports_what_it_measured(tmp_path):
    dead = rank_result(1, steps=1)  # out of memory in its second step
    dead.status, dead.phase, dead.error, dead.peak_mem_bytes = "oom", "training", "over the limit", 2_000_000
    report = a_report(tmp_path, ranks={0: rank_result(0, steps=1), 1: dead}, returncode=1,
                      failures={1: RankFailure(exitcode=1, signal=None)})
    assert report.status == "failed" and "rank 1 ran out of memory" in report.failures[0]
    report.save(tmp_path / "r.json")
    assert load_report(tmp_path / "r.json").measured.peak_mem_bytes == 2_000_000


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(schema_version=REPORT_SCHEMA_VERSION + 1), "newer than this autoplan reads"),
    (lambda d: d.pop("schema_version"), "not an autoplan run report"),
    (lambda d: d.update(extra_field=1), "corrupt or incomplete"),
    (lambda d: d["measured"].pop("losses"), "corrupt or incomplete"),
])
def test_load_refuses_what_it_cannot_trust(tmp_path, change, message):
    path = tmp_path / "r.json"
    data = json.loads(a_report(tmp_path).to_json())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(AutoplanError, match=message):
        load_report(path)
    path.write_text("{not json")
    with pytest.raises(AutoplanError, match="not valid JSON"):
        load_report(path)


def test_the_report_names_the_model_that_ran(tmp_path):
    report = a_report(tmp_path, model="gpt2-tiny", model_note="the plan names its model 'llama-tiny', but ...")
    assert report.model == "gpt2-tiny" and "llama-tiny" in report.model_note
    assert "note: the plan names its model 'llama-tiny'" in format_report(report)


def test_losses_are_labelled_mean_over_ranks(tmp_path):
    table = format_report(a_report(tmp_path))
    assert "loss by step, mean over the 2 rank(s) (the global batch's loss): 2.5000" in table


def test_an_interrupted_run_says_which_signal_and_where_each_rank_was(tmp_path):
    running = rank_result(1, steps=2)
    running.status, running.phase = "running", "training"
    report = a_report(tmp_path, ranks={0: rank_result(0, steps=2), 1: running}, returncode=130,
                      interrupted="SIGINT")
    assert report.status == "interrupted" and report.interrupted_by == "SIGINT"
    assert report.failures == [
        "rank 1 was stopped by SIGINT at step 3; measured peak so far 1.10 MB (live tensor bytes (test))"]
    report.save(tmp_path / "r.json")
    assert load_report(tmp_path / "r.json").status == "interrupted"


def test_ranks_of_another_node_that_sent_nothing_are_named_as_such(tmp_path):
    report = a_report(tmp_path, ranks={0: rank_result(0), 1: None}, returncode=0, local_ranks=[0])
    assert report.status == "failed"
    assert report.failures == [
        "rank 1 ran on another node and sent nothing to this node; that node's output says what happened to it"]


def test_host_memory_of_offloaded_units_is_shown_beside_device_memory(tmp_path):
    plan_path = tmp_path / "plan.json"
    plan = make_plan("gpt2-tiny", {"transformer.h.0": "shard+offload", "transformer.h.1": "shard+sel"}, world_size=4,
                     nodes=2)
    plan.predicted.host_mem_bytes, plan.predicted.host_mem_per_node_bytes = 400_000, 800_000
    plan.save(plan_path)
    spec = RunSpec(plan_path=str(plan_path), run_dir=str(tmp_path), device="cpu", steps=2, warmup_steps=1,
                   dry_run=False)
    ranks = {rank: rank_result(rank) for rank in range(4)}
    for rank, result in ranks.items():
        result.host_state_bytes = 390_000 + 1000 * rank
    report = build_report(plan, str(plan_path), spec, 4, LaunchResult(0, ranks, {}), nodes=2)
    measured = report.measured
    assert measured.host_mem_bytes == 393_000
    assert measured.host_mem_bytes_per_rank == {"0": 390_000, "1": 391_000, "2": 392_000, "3": 393_000}
    assert measured.host_mem_per_node_bytes == 392_000 + 393_000  # node 1: ranks 2 and 3
    assert report.predicted.host_mem_bytes == 400_000
    table = format_report(report)
    rows = {line[:24].strip(): line[24:].split() for line in table.splitlines()}
    assert rows["host memory per rank"] == ["400.00", "KB", "393.00", "KB", "0.98"]
    assert rows["host memory per node"] == ["800.00", "KB", "785.00", "KB", "0.98"]
    assert "the host is the device" in table  # a CPU run: device and host are one memory
    assert RunReport.load(_saved(report, tmp_path)).measured.host_mem_per_node_bytes == 785_000


def test_a_run_without_offload_shows_no_host_rows_and_older_reports_still_load(tmp_path):
    report = a_report(tmp_path)
    assert report.measured.host_mem_bytes is None and report.predicted.host_mem_bytes == 0
    assert "host memory" not in format_report(report)
    data = json.loads(report.to_json())
    for key in ("host_mem_bytes", "host_mem_per_node_bytes"):
        del data["predicted"][key]
    for key in ("host_mem_bytes", "host_mem_bytes_per_rank", "host_mem_per_node_bytes"):
        del data["measured"][key]
    older = tmp_path / "older.json"
    older.write_text(json.dumps(data))
    assert load_report(older).measured.host_mem_bytes is None


def _saved(report: RunReport, tmp_path) -> Path:
    path = tmp_path / "report.json"
    report.save(path)
    return path


def test_predicted_phases_take_every_point_of_the_plans_timeline():
    # a unit's reduction runs in its post-backward hook, inside loss.backward(): its "reduce" point is
    # backward memory (the root's is often the step's peak, measured in the backward phase)
    import autoplan
    from autoplan.run.report import predicted_phase_peaks

    plan = autoplan.estimate("gpt2-tiny[vocab_size=16384,d_model=256]", gpus=2, profile="cpu-gloo-2", seq_len=8,
                             batch_size=1, strategy="shard")  # a large embedding, few activations
    timeline = plan.predicted.timeline
    by_kind = {kind: max(p.total_bytes for p in timeline if p.point.split(" ")[0] in kinds)
               for kind, kinds in {"forward": ("pre-fwd", "fwd"), "backward": ("bwd", "reduce"),
                                   "optimizer": ("optimizer",)}.items()}
    assert predicted_phase_peaks(plan) == by_kind
    reduce_peak = max(p.total_bytes for p in timeline if p.point.startswith("reduce"))
    assert reduce_peak > max(p.total_bytes for p in timeline if p.point.startswith("bwd"))  # else not tested


def test_a_tensor_parallel_groups_ranks_share_their_micro_batches(tmp_path):
    plan_path = tmp_path / "plan.json"
    plan = make_plan("gpt2-tiny", {"transformer.h.0": "shard"})
    plan = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"tp_degree": 2})})
    plan.save(plan_path)
    spec = RunSpec(plan_path=str(plan_path), run_dir=str(tmp_path), device="cpu", steps=2, warmup_steps=1,
                   dry_run=False)
    report = build_report(plan, str(plan_path), spec, 2, LaunchResult(0, {0: rank_result(0), 1: rank_result(1)}, {}))
    assert report.global_batch_size == plan.training.micro_batch_size  # 2 ranks, 1 data-parallel group
    assert report.measured.throughput_samples_s == pytest.approx(plan.training.micro_batch_size
                                                                 / report.measured.step_time_s)
