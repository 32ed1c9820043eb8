"""`autoplan explain` and `autoplan diff`: a plan's choices against their alternatives, and two plans compared,
all predicted with the cost model from the plan files alone."""

import json

import pytest

from autoplan.cli.main import main

# live bytes alone: 20 MB is below what a GPU's caching allocator needs, and gives plans with choices to explain
ARGS = ["--model", "gpt2-tiny", "--gpus", "2", "--seq-len", "64", "--mem", "20MB", "--batch-size", "32",
        "--fit-to", "allocated"]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    assert main(["search", *ARGS, "-o", str(folder / "free.json")]) == 0
    assert main(["search", *ARGS, "--pin", "**=shard+ckpt", "-o", str(folder / "pinned.json")]) == 0
    return folder


def _json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_explain_gives_each_groups_alternatives_and_where_the_limit_binds(plans, capsys):
    plan = json.loads((plans / "free.json").read_text())
    why = _json(capsys, "explain", str(plans / "free.json"), "--json")
    assert [u for g in why["groups"] for u in g["units"]] == [u["module"] for u in plan["units"]]
    assert why["step_time_s"] == pytest.approx(plan["predicted"]["step_time_s"], rel=1e-12)
    assert why["peak_mem_bytes"] == plan["predicted"]["peak_mem_bytes"]
    planned = plan["cluster"]["mem_limit_bytes"] * (1 - plan["cluster"]["mem_headroom"])
    bound = 0
    for group in why["groups"]:
        [chosen] = [o for o in group["options"] if o["chosen"]]
        assert chosen["fits"] and chosen["step_change_s"] == 0
        assert len(group["options"]) > 1
        for option in group["options"]:
            assert option["fits"] == (option["peak_mem_bytes"] <= planned)
            assert option["over_bytes"] == max(0, option["peak_mem_bytes"] - int(planned))
            # an optimal plan: no group is faster under another option that fits
            assert not (option["fits"] and option["step_time_s"] < chosen["step_time_s"] * (1 - 1e-3))
        if "faster options do not fit: the limit binds at" in group["why"]:
            bound += 1
    assert bound >= 1, "the case should have a unit the limit holds back"
    assert main(["explain", str(plans / "free.json")]) == 0
    text = capsys.readouterr().out
    assert "(chosen)" in text and "over at" in text


def test_explain_names_the_pins_behind_a_group(plans, capsys):
    why = _json(capsys, "explain", str(plans / "pinned.json"), "--json")
    pinned = [g for g in why["groups"] if g["units"] != [""]]
    assert pinned and all(g["pinned_by"] == ["**: shard+ckpt"] and g["why"].startswith("pinned by") for g in pinned)
    assert [g["pinned_by"] for g in why["groups"] if g["units"] == [""]] == [[]]


def test_diff_lists_the_differing_units_and_what_each_costs(plans, capsys):
    a = json.loads((plans / "free.json").read_text())
    b = json.loads((plans / "pinned.json").read_text())
    result = _json(capsys, "diff", str(plans / "free.json"), str(plans / "pinned.json"), "--json")
    differing = [u["module"] for u, v in zip(a["units"], b["units"])
                 if (u["sharding"], u["checkpoint"], u["offload"]) != (v["sharding"], v["checkpoint"], v["offload"])]
    assert differing and [u for c in result["changes"] for u in c["units"]] == differing
    assert result["settings"] == ["pins 0 -> 1"]  # same micro-batch: the differences together are plan B
    if len(result["changes"]) > 1:
        together = result["all_step_change_s"]
    else:
        together = result["changes"][0]["step_change_s"]
    assert together == pytest.approx(b["predicted"]["step_time_s"] - a["predicted"]["step_time_s"], rel=1e-9)
    assert b["predicted"]["step_time_s"] >= a["predicted"]["step_time_s"] * (1 - 1e-3)
    same = _json(capsys, "diff", str(plans / "free.json"), str(plans / "free.json"), "--json")
    assert same["changes"] == [] and same["settings"] == []
    assert main(["diff", str(plans / "free.json"), str(plans / "pinned.json")]) == 0
    assert "transformer.h" in capsys.readouterr().out


def test_diff_of_plans_of_different_models_is_a_usage_error(plans, tmp_path, capsys):
    assert main(["search", "--model", "llama-tiny", "--gpus", "2", "--seq-len", "64", "--mem", "40MB",
                 "--fit-to", "allocated", "-o", str(tmp_path / "llama.json")]) == 0
    capsys.readouterr()
    assert main(["diff", str(plans / "free.json"), str(tmp_path / "llama.json")]) == 2
    assert "different models" in capsys.readouterr().err
    assert main(["explain", str(tmp_path / "missing.json")]) == 2
