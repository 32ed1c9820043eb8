"""Pipelined plans refused before any rank trains, and the pieces a pipelined run is built from: the
stages cut from the model (their own submodules at their own paths), the mesh's pipeline dimension."""

import pytest
from planmaker import make_plan, pipelined

from autoplan.cli.main import main
from autoplan.errors import PlanFileError
from autoplan.models.zoo import build_model, get_config
from autoplan.run.apply import check_plan
from autoplan.run.fake_world import FakeWorldOptions, run_fake_world
from autoplan.run.stage_module import StageModule, stage_parts
from cost_models.mesh import Mesh

LLAMA = {"tok_embeddings": "shard", "layers.0": "shard", "layers.1": "shard", "lm_head": "shard"}
TWO_STAGES = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]]


def llama_plan(stages=TWO_STAGES, **kwargs):
    return pipelined(make_plan("llama-tiny", LLAMA, world_size=4, grad_accum_steps=2), stages, **kwargs)


def llama():
    return build_model(get_config("llama-tiny"))


def test_a_stage_holds_the_models_own_modules_at_their_own_paths():
    model = llama()
    plan = llama_plan([["layers"], ["lm_head"]])  # a block list stands for its blocks
    parts = stage_parts(model, plan.pipeline)
    # the embedding and the final norm, left out, go to the first and the last stage
    assert parts == [["tok_embeddings", "layers.0", "layers.1"], ["norm", "lm_head"]]
    first, last = StageModule(model, parts[0], 0, 1), StageModule(model, parts[1], 1, 1)
    assert first.get_submodule("layers.1") is model.get_submodule("layers.1")
    assert {name for name, _ in first.named_parameters()} | {name for name, _ in last.named_parameters()} == {
        name for name, _ in model.named_parameters()}
    assert not {name for name, _ in first.named_parameters()} & {name for name, _ in last.named_parameters()}
    assert [name for name, _ in first.named_buffers()] == ["inv_freq"]  # the root's rotary tables
    # a module around parts stands for those no stage names itself (GPT-2's "transformer", as the search writes
    # it for the root's ops: the position embedding in the first stage, the final norm in the last)
    config = get_config("gpt2-tiny", tie_embeddings=False)
    gpt2 = pipelined(make_plan(config, {}, world_size=4, grad_accum_steps=2),
                     [["transformer.wte", "transformer", "transformer.h.0"],
                      ["<root>", "transformer.h.1", "transformer", "lm_head"]])
    assert stage_parts(build_model(config), gpt2.pipeline) == [
        ["transformer.wte", "transformer.wpe", "transformer.h.0"], ["transformer.h.1", "transformer.ln_f", "lm_head"]]


@pytest.mark.parametrize("stages,message", [
    ([["tok_embeddings", "layers.0"], ["layers.7", "lm_head"]], "stage 1 names module 'layers.7', which the model"),
    ([["tok_embeddings", "layers.0.attn"], ["layers.1"]], "names 'layers.0.attn', inside one of the model's parts"),
    ([["tok_embeddings"], ["layers.1", "lm_head"]], "block(s) layers.0 are in no pipeline stage"),
    ([["tok_embeddings", "layers.1"], ["layers.0", "lm_head"]], "a run of the model's parts in forward order"),
    ([["tok_embeddings", "layers.0", "layers.1"], ["layers.1", "lm_head"]], "stages 0 and 1 both hold layers.1"),
])
def test_stages_that_do_not_cut_the_model_are_refused(stages, message):
    with pytest.raises(PlanFileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_plan(llama(), llama_plan(stages))


def test_tied_weights_across_stages_are_refused():
    plan = pipelined(make_plan("gpt2-tiny", {"transformer.h.0": "shard"}, world_size=4, grad_accum_steps=2),
                     [["transformer.wte", "transformer.wpe", "transformer.h.0"], ["transformer.h.1", "lm_head"]])
    with pytest.raises(PlanFileError, match="one tied weight, held by pipeline stages 0 and 1.*tie_embeddings=false"):
        check_plan(build_model(get_config("gpt2-tiny")), plan)


def test_a_schedule_torch_cannot_run_at_the_micro_batch_count_is_refused():
    plan = llama_plan(microbatches=1)
    with pytest.raises(PlanFileError, match=r"torch's Schedule1F1B cannot run 1 micro-batch\(es\) on 2 pipeline ranks"):
        check_plan(llama(), plan)
    looped = pipelined(make_plan(get_config("llama-tiny", n_layers=4), {}, world_size=4, grad_accum_steps=5),
                       [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]],
                       schedule="interleaved_1f1b")
    with pytest.raises(PlanFileError, match="ScheduleInterleaved1F1B cannot run 5 micro-batch"):
        check_plan(build_model(get_config("llama-tiny", n_layers=4)), looped)


@pytest.mark.parametrize("schedule,ranks", [("zero_bubble", [0, 1, 0, 1]), ("zbv", [0, 1, 1, 0])])
def test_zero_bubble_schedules_pass_the_checks_and_their_placement_is_checked(schedule, ranks):
    """They run under FSDP2 (parity: test_pp_parity.py); a V-shaped schedule still wants its V."""
    model = build_model(get_config("llama-tiny", n_layers=4))
    stages = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]]
    plan = pipelined(make_plan(get_config("llama-tiny", n_layers=4), {}, world_size=4, grad_accum_steps=2), stages,
                     schedule=schedule, ranks=ranks)
    check_plan(model, plan)
    swapped = pipelined(make_plan(get_config("llama-tiny", n_layers=4), {}, world_size=4, grad_accum_steps=2), stages,
                        schedule=schedule, ranks=[0, 1, 1, 0] if schedule == "zero_bubble" else [0, 1, 0, 1])
    with pytest.raises(PlanFileError, match=f"stage 2 is on rank .; schedule {schedule}"):
        check_plan(model, swapped)


def test_stages_placed_otherwise_than_the_schedule_runs_them_are_refused():
    model = build_model(get_config("llama-tiny", n_layers=4))
    stages = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]]
    plan = pipelined(make_plan(get_config("llama-tiny", n_layers=4), {}, world_size=4, grad_accum_steps=2), stages,
                     schedule="interleaved_1f1b", ranks=[0, 0, 1, 1])
    with pytest.raises(PlanFileError, match="stage 1 is on rank 0; schedule interleaved_1f1b .looped. runs it on"):
        check_plan(model, plan)
    with pytest.raises(PlanFileError, match="schedule 1f1b runs one stage.s. per rank; the plan has 4 stages"):
        check_plan(model, plan.model_copy(update={"pipeline": plan.pipeline.model_copy(update={"schedule": "1f1b"})}))


def test_a_pipeline_that_does_not_match_the_world_is_refused():
    plan = llama_plan()
    other = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"pp_degree": 4})})
    with pytest.raises(PlanFileError, match="pipeline has 2 pipeline ranks, its cluster's pipeline degree is 4"):
        check_plan(llama(), other)
    unrecorded = plan.model_copy(update={"pipeline": None})
    with pytest.raises(PlanFileError, match="pipeline degree 2 but the plan records no pipeline"):
        check_plan(llama(), unrecorded)
    accum = plan.model_copy(update={"training": plan.training.model_copy(update={"grad_accum_steps": 4})})
    with pytest.raises(PlanFileError, match="runs 2 micro-batches per step, the plan's training 4 accumulation"):
        check_plan(llama(), accum)


def test_autoplan_apply_refuses_before_launching(tmp_path, capsys):
    path = tmp_path / "plan.json"
    llama_plan(microbatches=1).save(path)
    assert main(["apply", str(path), "--steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert "Schedule1F1B cannot run 1 micro-batch" in err and "launching" not in out
    llama_plan().save(path)
    assert main(["apply", str(path), "--nproc", "3"]) == 2
    assert "groups of 2 (pipeline degree 2 x tensor degree 1); 3 ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # a usage error: argparse's exit
        main(["apply", str(path), "--save", str(tmp_path / "ck")])
    assert exit_.value.code == 2 and "checkpoints (`--save`, `--resume`) of a pipelined plan" in capsys.readouterr().err


def test_the_mesh_puts_a_stages_ranks_in_one_contiguous_block():
    mesh = Mesh(nodes=2, gpus_per_node=4, tp=2, pp=2)
    assert mesh.dims == (("pp", 2), ("dp", 2), ("tp", 2))
    assert [mesh.pipeline_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [mesh.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.slow  # three fake-world runs of a few seconds each
def test_one_stage_of_a_64_rank_pipeline_runs_on_the_fake_process_group():
    plan = pipelined(make_plan("llama-tiny", LLAMA, world_size=64, nodes=8, grad_accum_steps=4, seq_len=64), TWO_STAGES)
    gpipe = plan.model_copy(update={"pipeline": plan.pipeline.model_copy(update={"schedule": "gpipe"})})
    first_1f1b = run_fake_world(plan, steps=1, options=FakeWorldOptions(rank=0))
    first_gpipe = run_fake_world(gpipe, steps=1, options=FakeWorldOptions(rank=0))
    last = run_fake_world(plan, steps=1, options=FakeWorldOptions(rank=63))
    # GPipe's first stage holds all 4 micro-batches' activations at once, 1F1B's at most 2 (the pipeline's depth)
    assert first_gpipe.measured_peak_bytes > first_1f1b.measured_peak_bytes
    assert "rank 63 of a fake 64-rank world" in last.mem_source and last.rank == 63
    assert last.measured_peak_bytes > 0 and "stage 1's busiest point" in last.predicted_peak_point
