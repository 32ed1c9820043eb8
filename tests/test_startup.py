"""The command line answers before it imports what it does not need: `autoplan --help` imports neither
torch nor the solver, `models` and `profiles` neither torch nor the solver; `import autoplan` imports the API's
modules only when a name is first used, and every public name still resolves."""

import json
import subprocess
import sys

import pytest

import autoplan
from autoplan.cli import main as cli_main

HEAVY = ("torch", "ortools", "pydantic", "networkx", "transformers")


def _imported_after(code: str) -> dict[str, bool]:
    probe = code + "\nimport sys\nprint(' '.join(str(name in sys.modules) for name in %r))" % (HEAVY,)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return dict(zip(HEAVY, (flag == "True" for flag in done.stdout.split()[-len(HEAVY):])))


def _cli(*argv: str) -> str:
    return (f"from autoplan.cli.main import main\ntry:\n    main({list(argv)!r})\nexcept SystemExit:\n    pass\n"
            "import sys; sys.stdout.flush()")


def test_help_imports_neither_torch_nor_the_solver():
    assert not any(_imported_after(_cli("--help")).values())
    assert not any(_imported_after("import autoplan").values())


@pytest.mark.parametrize("argv", [("models",), ("profiles",), ("search", "--help"), ("estimate", "--help")])
def test_commands_that_solve_nothing_do_not_import_the_solver(argv):
    imported = _imported_after(_cli(*argv))
    assert not imported["ortools"]
    if argv in (("profiles",), ("models",)):  # `models` counts parameters from the configs
        assert not imported["torch"]


def test_the_overview_lists_every_subcommand_with_its_own_help():
    full = cli_main.build_parser()
    helps = {action.dest: action.help for action in full._subparsers._group_actions[0]._choices_actions}
    assert helps == {name: help_text for name, (_module, help_text) in cli_main.COMMANDS.items()}


def test_a_misspelt_command_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(["serach"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'serach'" in capsys.readouterr().err


def test_every_public_name_resolves_lazily():
    for name in autoplan.__all__:
        assert getattr(autoplan, name) is not None, name
    assert set(autoplan.__all__) <= set(dir(autoplan))
    from autoplan import Plan, search

    assert callable(search) and Plan.__name__ == "Plan"
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        autoplan.nonexistent  # noqa: B018


def test_a_command_that_exits_without_teardown_still_flushes_its_output_and_exit_code(tmp_path):
    # search, estimate, models, profiles, explain and diff end with os._exit (the interpreter's teardown after torch
    # costs 0.6 s): what they print and write must all be there, and the exit code be theirs
    plan = tmp_path / "plan.json"
    args = ["--model", "gpt2-tiny", "--gpus", "2", "--seq-len", "32", "--fit-to", "allocated", "-o", str(plan)]
    done = subprocess.run([sys.executable, "-m", "autoplan", "search", *args, "--mem", "40MB", "--json"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(plan.read_text())
    done = subprocess.run([sys.executable, "-m", "autoplan", "search", *args, "--mem", "100KB"],
                          capture_output=True, text=True)
    assert done.returncode == 3 and "autoplan search: error: no plan for gpt2-tiny fits" in done.stderr
    assert cli_main.QUICK_EXIT == {"search", "estimate", "models", "profiles", "explain", "diff"}  # not apply, profile


def test_explaining_and_comparing_plans_imports_no_solver(tmp_path):
    # explain, diff and estimate --plan cost plans without solving: ortools (and the pandas it imports) stay out
    plan = tmp_path / "plan.json"
    autoplan.search("gpt2-tiny", "40MB", gpus=2, seq_len=32, profile="cpu-gloo-2").save(plan)
    for argv in (("explain", str(plan)), ("diff", str(plan), str(plan)), ("estimate", "--plan", str(plan))):
        assert not _imported_after(_cli(*argv))["ortools"], argv


def test_a_search_imports_no_networkx(tmp_path):
    # a trace's graph is kept as its nodes and edges (cost_models.records.GraphEdges): tracing, the trace cache's
    # write and read, and the expansion of repeated blocks read those; networkx is imported where a graph is asked for
    argv = ["search", "--model", "gpt2-tiny", "--gpus", "2", "--seq-len", "32", "--mem", "40MB", "-o",
            str(tmp_path / "plan.json")]
    for switch in ("off", "on", "on"):  # traced; traced and written to the cache; read from it
        env = f"import os\nos.environ.update(AUTOPLAN_TRACE_CACHE={switch!r}, AUTOPLAN_CACHE_DIR={str(tmp_path)!r})\n"
        imported = _imported_after(env + _cli(*argv))
        assert imported["torch"] and imported["ortools"] and not imported["networkx"], switch
    assert len(list((tmp_path / "traces").glob("*.json"))) == 1


def test_a_trace_imports_no_dynamo_and_leaves_torch_as_it_was():
    """torch's Python meta kernels import torch._dynamo on their first call; a trace runs them as themselves
    (autoplan.tracing.meta_kernels) and takes its mark off them afterwards."""
    probe = ("import os, sys\nos.environ['AUTOPLAN_TRACE_CACHE'] = 'off'\nimport autoplan, torch._compile\n"
             "autoplan.trace('gpt2-tiny', seq_len=16)\n"
             "from autoplan.tracing.meta_kernels import _wrapped_kernels\n"
             "marked = sum(getattr(k, '__dynamo_disable', None) is k for k in _wrapped_kernels())\n"
             "print('torch._dynamo' in sys.modules, len(_wrapped_kernels()) > 100, marked)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split()[-3:] == ["False", "True", "0"]
