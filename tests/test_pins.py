"""User pins: the engineer fixes some units' options (a pins file, --pin), the solver completes the rest;
the plan's decisions written as pins reproduce it; every bad pin is a usage error that names it."""

import json

import pytest

import autoplan
from autoplan.cli.main import main
from autoplan.errors import UsageError
from autoplan.models.resolve import resolve_model
from autoplan.pins import Pattern, PinsInfeasibleError, load_pins, parse_decision, pins_of_plan, range_text

TINY = ["--model", "gpt2-tiny", "--gpus", "2", "--seq-len", "64", "--mem", "20MB",  # a mixed plan: see below
        "--fit-to", "allocated"]  # live bytes alone: 20 MB is below what a GPU's caching allocator needs
FIELDS = ("module", "sharding", "checkpoint", "offload")


@pytest.fixture(scope="module")
def gpt2_tiny():
    return autoplan.trace("gpt2-tiny", seq_len=64)


def _decisions(plan_file):
    data = json.loads(plan_file.read_text())
    return [tuple(unit[f] for f in FIELDS) for unit in data["units"]], data


def _search(tmp_path, *args, out="plan.json"):
    return main(["search", *args, "-o", str(tmp_path / out)])


def test_decisions_as_labels_fields_and_mappings():
    assert parse_decision("shard+ckpt").fixed == {"sharding": "shard", "checkpoint": "full", "offload": False}
    assert parse_decision("replicate").fixed == {"sharding": "replicate", "checkpoint": "none", "offload": False}
    assert parse_decision("replicate+sel+offload").text() == "replicate+sel+offload"
    assert parse_decision("ckpt").fixed == {"checkpoint": "full"}
    assert parse_decision("checkpoint=full").fixed == {"checkpoint": "full"}
    assert parse_decision("sharding=shard,offload=false").fixed == {"sharding": "shard", "offload": False}
    assert parse_decision({"checkpoint": "selective", "offload": True}).fixed == {"checkpoint": "selective",
                                                                                 "offload": True}
    for bad in ("fsdp", "ckpt+shard", "offload=maybe", {"shards": "shard"}, "checkpoint=most"):
        with pytest.raises(UsageError):
            parse_decision(bad)


@pytest.mark.parametrize("model,pattern,expected", [
    ("gpt2", "transformer.h.*", [f"transformer.h.{i}" for i in range(12)]),
    ("gpt2", "transformer.h.0-11", [f"transformer.h.{i}" for i in range(12)]),
    ("gpt2", "transformer.h.3-5,9", ["transformer.h.3", "transformer.h.4", "transformer.h.5", "transformer.h.9"]),
    ("gpt2", "transformer.h.1-9/4", ["transformer.h.1", "transformer.h.5", "transformer.h.9"]),  # every 4th
    ("gpt2", "transformer.h.0-11/2.mlp", [f"transformer.h.{i}.mlp" for i in range(0, 12, 2)]),
    ("gpt2", "**.mlp", [f"transformer.h.{i}.mlp" for i in range(12)]),
    ("gpt2", "transformer.h.1*.attn", ["transformer.h.1.attn", "transformer.h.10.attn", "transformer.h.11.attn"]),
    ("gpt2", "<root>", [""]),
    ("llama-tiny", "layers.*.attn", ["layers.0.attn", "layers.1.attn"]),
    ("llama-tiny", "layers.**.w1", ["layers.0.mlp.w1", "layers.1.mlp.w1"]),
    ("llama-tiny", "**", None),  # every module but the root
])
def test_wildcards_and_ranges_on_gpt2_and_llama_module_trees(model, pattern, expected):
    paths = [name for name, _ in resolve_model(model).module.named_modules()]
    matched = [p for p in paths if Pattern(pattern).matches(p)]
    assert matched == (expected if expected is not None else paths[1:])


def test_emitted_pins_reproduce_the_plan_exactly_and_edits_free_units(tmp_path):
    assert _search(tmp_path, *TINY, "--emit-pins", str(tmp_path / "pins.yaml"),
                   out="free.json") == 0
    free, free_data = _decisions(tmp_path / "free.json")
    assert len({d[1:] for d in free}) > 1, "the case should mix decisions"
    pins = load_pins(tmp_path / "pins.yaml")
    assert len(pins) == len(free) and free_data["pins"] == []
    assert _search(tmp_path, *TINY, "--pins", str(tmp_path / "pins.yaml"), out="again.json") == 0
    again, again_data = _decisions(tmp_path / "again.json")
    assert again == free
    assert again_data["training"] == free_data["training"] and again_data["predicted"] == free_data["predicted"]
    assert [p["pattern"] for p in again_data["pins"]] == [p.pattern.text for p in pins]
    # the same as JSON; and with a line deleted, the solver chooses there again (here: as before)
    assert _search(tmp_path, *TINY, "--emit-pins", str(tmp_path / "pins.json"), out="free2.json") == 0
    data = json.loads((tmp_path / "pins.json").read_text())
    assert _decisions(tmp_path / "free2.json")[0] == free
    del data["pins"]["transformer.h.1"]
    (tmp_path / "edited.json").write_text(json.dumps(data))
    assert _search(tmp_path, *TINY, "--pins", str(tmp_path / "edited.json"), out="edited_plan.json") == 0
    assert _decisions(tmp_path / "edited_plan.json")[0] == free


def test_a_module_that_is_not_a_unit_becomes_one_and_the_plan_estimates(tmp_path):
    # FSDP alone (--tp 1): estimate does not cost tensor-parallel plans
    args = ["--model", "llama-tiny", "--gpus", "2", "--seq-len", "64", "--mem", "40MB", "--tp", "1", "--fit-to", "allocated"]
    assert _search(tmp_path, *args, "--pin", "layers.*.mlp=shard+ckpt", "--emit-pins", str(tmp_path / "p.yaml")) == 0
    decisions, data = _decisions(tmp_path / "plan.json")
    assert ("layers.0.mlp", "shard", "full", False) in decisions and ("layers.1.mlp", "shard", "full", False) in decisions
    assert data["pins"] == [{"pattern": "layers.*.mlp", "decision": "shard+ckpt"}]
    est = autoplan.estimate(plan=str(tmp_path / "plan.json"))
    assert est.predicted.peak_mem_bytes == data["predicted"]["peak_mem_bytes"]
    assert _search(tmp_path, *args, "--pins", str(tmp_path / "p.yaml"), out="again.json") == 0
    assert _decisions(tmp_path / "again.json")[0] == decisions


def test_a_pin_forcing_a_slower_option_is_no_faster_and_never_over_the_limit(gpt2_tiny):
    free = autoplan.search(gpt2_tiny, "20MB", gpus=2, fit_to="allocated")
    for pin in ("transformer.h.*=shard+ckpt+offload", "<root>=shard+offload", "transformer.h.0=replicate+sel"):
        pinned = autoplan.search(gpt2_tiny, "20MB", gpus=2, pin=[pin], fit_to="allocated")
        assert pinned.predicted.step_time_s >= free.predicted.step_time_s * (1 - 1e-3)
        assert pinned.predicted.peak_mem_bytes <= 20e6 * (1 - pinned.cluster.mem_headroom)
        pattern, decision = pin.split("=")
        pinned_units = [u for u in pinned.units if Pattern(pattern).matches(u.module)]
        assert pinned_units and all(u.label.replace(" ", "") == decision for u in pinned_units)


def test_estimate_takes_pins_over_its_strategy(gpt2_tiny):
    kw = dict(gpus=2, batch_size=4)
    pinned = autoplan.estimate(gpt2_tiny, "shard", pin=["**=replicate", "<root>=replicate"], **kw)
    uniform = autoplan.estimate(gpt2_tiny, "replicate", **kw)
    assert pinned.predicted.step_time_s == uniform.predicted.step_time_s
    assert pinned.predicted.peak_mem_bytes == uniform.predicted.peak_mem_bytes
    assert "2 pins" in pinned.strategy


BAD = [
    (["--pin", "transformer.h.7=shard"], "`transformer.h.7: shard` (from --pin) matches no module of gpt2-tiny; "
                                         "nearest module paths: transformer.h.1"),
    (["--pin", "<root>=shard+ckpt"], "shard+ckpt is not an option for unit <root>: the root is never checkpointed"),
    (["--pin", "transformer.h.*=shard", "--pin", "transformer.h.1=replicate"],
     "pins `transformer.h.*: shard` (from --pin) and `transformer.h.1: replicate` (from --pin) disagree on unit "
     "transformer.h.1"),
    (["--pin", "transformer.h.0=hybrid"], "hybrid needs two or more nodes"),
    (["--pin", "lm_head=fsdp"], "'fsdp' is not understood"),
    (["--pin", "transformer.h"], "give PATTERN=DECISION"),
    (["--pin", "transformer.h=shard"], "transformer.h is a ModuleList"),
    (["--pin", "transformer.wte=shard"], "tied weights"),
    (["--pin", "transformer..h=shard"], "empty path component"),
    (["--pin", "transformer.h.5-2=shard"], "runs backwards"),
    (["--pin", "transformer.h.0-1/0=shard"], "the step is at least 1"),
    (["--pins", "missing.yaml"], "missing.yaml does not exist"),
]
FILES = [
    ("pins:\n  transformer.h.*: shard\nextra: 1\n", "unknown key(s) 'extra'"),
    ("pins:\n  transformer.h.0: shard\n  transformer.h.0: replicate\n", "'transformer.h.0' appears twice"),
    ("pins: [transformer.h.0\n", "is not valid YAML"),
    ('{"pins": {"transformer.h.0": {"sharding": "shard", "ckpt": true}}}', "unknown field 'ckpt'"),
    ("pins:\n  - transformer.h.0\n", "must map module-path patterns to decisions"),
]


@pytest.mark.parametrize("args,message", BAD + [(["--pins", f"file{i}"], m) for i, (_, m) in enumerate(FILES)])
def test_every_bad_pin_is_a_named_usage_error_and_writes_no_plan(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    for i, (text, _) in enumerate(FILES):
        (tmp_path / f"file{i}").write_text(text)
    (tmp_path / "plan.json").write_text("keep me")
    assert main(["search", *TINY, *args, "--emit-pins", "emitted.yaml"]) == 2
    assert message in capsys.readouterr().err
    assert (tmp_path / "plan.json").read_text() == "keep me" and not (tmp_path / "emitted.yaml").exists()


def test_infeasible_pins_are_reported_with_the_pins_to_loosen(gpt2_tiny, tmp_path, capsys):
    kw = dict(gpus=8, profile="cpu-gloo-2", batch_size=1)
    autoplan.search(gpt2_tiny, "1.8MB", pin=["transformer.h.0=replicate"], **kw)  # each alone fits
    autoplan.search(gpt2_tiny, "1.8MB", pin=["transformer.h.1=replicate"], **kw)
    with pytest.raises(PinsInfeasibleError) as caught:
        autoplan.search(gpt2_tiny, "1.8MB", pin=["transformer.h.0=replicate", "transformer.h.1=replicate"], **kw)
    error = caught.value
    assert [p.pattern.text for p in error.pins] == ["transformer.h.0", "transformer.h.1"]
    assert error.peak_without <= 1.8e6 * 0.98 < error.peak_with
    assert "cannot all hold; loosen one of them" in str(error)
    # on the command line: exit 3, the pins named as flags, nothing written
    code = main(["search", "--model", "gpt2-tiny", "--seq-len", "64", "--gpus", "8", "--profile", "cpu-gloo-2",
                 "--batch-size", "1", "--mem", "1.8MB", "--pin", "transformer.h.*=replicate", "-o",
                 str(tmp_path / "plan.json")])
    err = capsys.readouterr().err
    assert code == 3 and not (tmp_path / "plan.json").exists()
    assert "with these pins, and one does without them" in err
    assert "The pin `transformer.h.*: replicate` (from --pin) cannot hold by itself; loosen it" in err
    # a limit nothing fits even without pins: the pins are not blamed
    with pytest.raises(autoplan.InfeasibleError, match="The pins are not the cause") as caught:
        autoplan.search(gpt2_tiny, "100KB", pin=["transformer.h.*=shard"], **kw)
    assert not isinstance(caught.value, PinsInfeasibleError)


def test_plans_record_their_pins_and_older_plans_still_load(gpt2_tiny, tmp_path):
    plan = autoplan.search(gpt2_tiny, "20MB", gpus=2, pins={"transformer.h.0-1": "checkpoint=full"}, fit_to="allocated")
    assert [(p.pattern, p.decision) for p in plan.pins] == [("transformer.h.0-1", "checkpoint=full")]
    assert all(u.checkpoint == "full" for u in plan.units if u.module)
    data = plan.to_dict()
    del data["pins"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert autoplan.load_plan(tmp_path / "old.json").pins == []


@pytest.mark.parametrize("indices,text", [
    ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"), (list(range(0, 96, 2)), "0-94/2"), (list(range(1, 96, 2)), "1-95/2"),
    ([0, 2], "0,2"), ([0, 3, 6, 7, 8], "0-6/3,7-8"), ([4], "4"),
])
def test_range_text_writes_runs_and_strides_that_match_exactly_those_indices(indices, text):
    assert range_text(indices) == text
    assert [i for i in range(100) if Pattern(f"layers.{text}").matches(f"layers.{i}")] == sorted(indices)


def test_a_plan_of_96_alternating_units_prints_grouped_in_every_table(tmp_path):
    """Alternating decisions group as strides, in the plan's table, explain, diff, the emitted pins."""
    from autoplan.api.inspect import diff, explain

    model, common = "llama-tiny[n_layers=96]", dict(gpus=2, seq_len=32, tp=1, batch_size=8, profile="cpu-gloo-2")
    alternating = autoplan.search(model, "200MB", pin=["layers.0-94/2=shard+ckpt", "layers.1-95/2=shard"], **common)
    uniform = autoplan.search(model, "200MB", pin=["layers.*=shard"], **common)
    report = alternating.table()
    rows = report[report.index("-----"):report.index("peak memory")].splitlines()[1:-1]
    assert len(rows) <= 5 and any(row.startswith("layers.0-94/2 ") for row in rows), report
    assert any(row.startswith("layers.1-95/2 ") for row in rows)
    why = explain(alternating)
    assert [g.pattern for g in why.groups if g.pattern.startswith("layers")] == ["layers.0-94/2", "layers.1-95/2"]
    changed = diff(alternating, uniform)
    assert len(changed.table().splitlines()) < 10 and "layers.0-94/2" in changed.table()
    assert [pin.pattern.text for pin in pins_of_plan(alternating)][2:4] == ["layers.0-94/2", "layers.1-95/2"]
