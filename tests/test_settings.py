"""One settings record per request: the API and the CLI share its fields, defaults, checks and help."""

import json

import pytest
from pydantic import ValidationError

import autoplan
from autoplan.cli.main import build_parser, main
from autoplan.errors import UsageError
from autoplan.settings import EstimateSettings, SearchSettings
from autoplan.settings_flags import field_flag, flag_name


def _subparser(command):
    parser = build_parser()
    return parser._subparsers._group_actions[0].choices[command]


@pytest.mark.parametrize("cls,command", [(SearchSettings, "search"), (EstimateSettings, "estimate")])
def test_every_field_is_a_flag_with_its_docstring_as_help(cls, command):
    actions = {a.dest: a for a in _subparser(command)._actions}
    for name, info in cls.model_fields.items():
        if field_flag(cls, name).api_only:
            assert name not in actions
            continue
        assert info.description, f"{cls.__name__}.{name} has no docstring"
        action = actions[name]
        assert flag_name(cls, name) in action.option_strings
        # the help is the field's docstring (parameters shown as flags), plus the default where it has one
        first_words = " ".join(info.description.split()[:3]).split("`")[0]
        assert action.help.startswith(first_words), (name, action.help)


def test_flags_not_given_leave_the_records_defaults():
    args = _subparser("search").parse_args([])
    assert not any(hasattr(args, name) for name in SearchSettings.model_fields)
    settings = SearchSettings.create()
    assert settings.headroom == 0.02 and settings.time_limit_s == 10.0 and settings.mem is None


def test_api_and_cli_share_the_memory_default(tmp_path, monkeypatch):
    """Without a limit both plan to the profile's device memory (the default A100-80GB datasheet's)."""
    monkeypatch.chdir(tmp_path)
    assert main(["search", "--model", "gpt2-tiny", "--seq-len", "32", "--gpus", "2", "-o", "cli.json"]) == 0
    cli = json.loads((tmp_path / "cli.json").read_text())
    api = autoplan.search("gpt2-tiny", seq_len=32, gpus=2).to_dict()
    assert cli["cluster"]["mem_limit_bytes"] == api["cluster"]["mem_limit_bytes"] == autoplan.load_profile("a100-sxm4-80gb").mem_bytes
    for plan in (cli, api):
        del plan["timing"]
    assert cli == api


def test_the_library_names_the_parameter_and_the_cli_the_flag(tmp_path, monkeypatch, capsys):
    with pytest.raises(UsageError, match=r"`headroom` must be a fraction"):
        autoplan.search("gpt2-tiny", "1GB", headroom=2.0)
    with pytest.raises(UsageError, match=r"`gpus` 6 does not equal `nodes` 2 x `gpus_per_node` 2"):
        autoplan.search("gpt2-tiny", "1GB", gpus=6, nodes=2, gpus_per_node=2)
    monkeypatch.chdir(tmp_path)
    assert main(["search", "--model", "gpt2-tiny", "--headroom", "2"]) == 2
    err = capsys.readouterr().err
    assert "--headroom must be a fraction" in err and "`" not in err.split("error:")[1].split("(")[0]
    assert main(["search", "--model", "gpt2-tiny", "--gpus", "6", "--nodes", "2", "--gpus-per-node", "2"]) == 2
    assert "--gpus 6 does not equal --nodes 2 x --gpus-per-node 2" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_unknown_and_mistyped_settings_are_usage_errors():
    with pytest.raises(UsageError, match=r"unknown setting `gpu`; the settings are: model, gpus"):
        autoplan.search("gpt2-tiny", "1GB", gpu=2)
    with pytest.raises(UsageError, match=r"`gpus`: .*integer"):
        autoplan.search("gpt2-tiny", "1GB", gpus="two")
    with pytest.raises(UsageError, match=r"unknown `dtype` 'fp8'; choose one of bf16-mixed, bf16-reduce, bf16, fp32"):
        SearchSettings.create(dtype="fp8")
    with pytest.raises(UsageError, match=r"`checkpoint` goes with `strategy`"):
        SearchSettings.create(checkpoint=True)


def test_a_settings_record_is_frozen_and_reusable():
    settings = SearchSettings.create(model="gpt2-tiny", mem="40MB", gpus=2, seq_len=32, fit_to="allocated")
    assert settings.mem == 40_000_000
    with pytest.raises(ValidationError):
        settings.gpus = 4
    wider = settings.replace(gpus=4)
    assert (settings.gpus, wider.gpus, wider.mem) == (2, 4, 40_000_000)
    by_record = autoplan.search(settings=settings).to_dict()
    by_keywords = autoplan.search("gpt2-tiny", "40MB", gpus=2, seq_len=32, fit_to="allocated").to_dict()
    for plan in (by_record, by_keywords):
        del plan["timing"]
    assert by_record == by_keywords
