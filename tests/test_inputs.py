"""Hostile and mistaken inputs to search and estimate: a plan that names code, limits the device cannot hold,
sequences longer than the model's positions, factories that fail, output paths that cannot be written, sizes
argparse would misread, file modes, and a factory module beside the user run by the console script."""

import importlib
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import autoplan
from autoplan.cli.main import main
from autoplan.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "gpt2-tiny", "--gpus", "2", "--seq-len", "64"]


@pytest.fixture(scope="module")
def plan_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    autoplan.search("gpt2-tiny", "40MB", gpus=2, seq_len=64, fit_to="allocated").save(path)
    return json.loads(path.read_text())


def _forbid_code_from_plans(monkeypatch):
    """Fail the test if anything imports `this` or `os` by name, calls os.getppid or loads any factory."""
    import autoplan.models.resolve

    real_import = importlib.import_module

    def guarded_import(name, *args, **kwargs):
        if name in ("this", "os"):
            pytest.fail(f"a plan file made autoplan import {name}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", guarded_import)
    monkeypatch.setattr(os, "getppid", lambda: pytest.fail("a plan file made autoplan call os.getppid"))
    monkeypatch.setattr(autoplan.models.resolve, "load_factory", lambda *a, **k: pytest.fail("loaded a factory"))


def _edited(plan_data, directory: Path, **model) -> Path:
    path = directory / "edited.json"
    path.write_text(json.dumps({**plan_data, "model": {**plan_data["model"], **model}}))
    return path


@pytest.mark.parametrize("name", ["this:s", "os:getppid"])
def test_a_plan_naming_code_is_refused_without_importing_or_calling_it(plan_data, tmp_path, monkeypatch, capsys,
                                                                        name):
    plan = _edited(plan_data, tmp_path, name=name, config=None)
    _forbid_code_from_plans(monkeypatch)
    assert main(["estimate", "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert f"model factory {name!r}" in err and "does not import code named only in a plan file" in err
    assert f"--model {name}" in err


def test_the_zen_of_python_stays_unimported_in_a_fresh_process(plan_data, tmp_path):
    plan = _edited(plan_data, tmp_path, name="this:s", config=None)
    script = ("import sys; from autoplan.cli.main import main; code = main(['estimate', '--plan', sys.argv[1]]); "
              "assert 'this' not in sys.modules; sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", script, str(plan)], capture_output=True, text=True, timeout=900,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), check=False)
    assert result.returncode == 2, result.stderr
    assert "Beautiful is better than ugly" not in result.stdout + result.stderr


def test_a_plan_with_a_config_is_built_from_it_and_labelled_by_it(plan_data, tmp_path, monkeypatch):
    """A zoo plan whose name was edited builds the stored config (never the name) and says what it built."""
    plan = _edited(plan_data, tmp_path, name="this:s")
    _forbid_code_from_plans(monkeypatch)
    result = autoplan.estimate(plan=plan)
    assert result.model.name == "gpt2-tiny" and result.model.config == plan_data["model"]["config"]
    assert "this:s" not in result.description


def test_a_limit_above_the_device_is_refused_unless_allowed(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["search", *TINY, "--mem", "200GB"]) == 2
    err = capsys.readouterr().err
    assert "200.00 GB" in err and "85.90 GB" in err and "a100-sxm4-80gb" in err and "--allow-over-device-mem" in err
    assert not (tmp_path / "plan.json").exists()
    with pytest.raises(UsageError, match="8.00 TB is more than the 85.90 GB"):
        autoplan.estimate("gpt2-tiny", "shard", gpus=2, seq_len=64, mem="8TB")

    assert main(["search", *TINY, "--mem", "200GB", "--allow-over-device-mem"]) == 0
    assert "memory limit 200.00 GB per GPU (above the device's 85.90 GB: --allow-over-device-mem)" in \
        capsys.readouterr().out
    assert main(["estimate", "--plan", "plan.json"]) == 2  # the plan's own limit is checked the same way
    assert "the plan's memory limit 200.00 GB" in capsys.readouterr().err
    assert main(["estimate", "--plan", "plan.json", "--allow-over-device-mem"]) == 0
    assert "above the 85.90 GB a a100-sxm4-80gb device has" in capsys.readouterr().out


def test_a_limit_within_the_device_writes_the_plan_as_before(tmp_path, monkeypatch):
    """The new setting is not in the plan: a plan within the device's memory is byte-identical either way."""
    monkeypatch.chdir(tmp_path)
    assert main(["search", *TINY, "--mem", "40MB", "-o", "a.json", "--fit-to", "allocated"]) == 0
    assert main(["search", *TINY, "--mem", "40MB", "--allow-over-device-mem", "-o", "b.json", "--fit-to", "allocated"]) == 0
    a, b = (json.loads((tmp_path / name).read_text()) for name in ("a.json", "b.json"))
    assert {**a, "timing": None} == {**b, "timing": None}  # the searches' wall times differ
    assert "allow" not in json.dumps(b)


@pytest.mark.parametrize("argv, numbers", [
    (["search", "--model", "gpt2", "--mem", "8GB", "--seq-len", "5000"], ("5000", "1024", "gpt2[max_seq_len=5000]")),
    (["estimate", "--model", "gpt2-tiny", "--gpus", "2", "--seq-len", "256"], ("256", "128", "position table")),
    (["search", "--model", "llama-tiny", "--mem", "1GB", "--seq-len", "129"], ("129", "128", "RoPE tables")),
])
def test_a_sequence_longer_than_the_models_positions_is_refused(tmp_path, monkeypatch, capsys, argv, numbers):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--seq-len" in err and all(n in err for n in numbers), err
    assert not (tmp_path / "plan.json").exists()


def test_a_zoo_model_from_a_factory_or_an_object_keeps_its_positions():
    sys.path.insert(0, str(REPO / "tests"))
    try:
        with pytest.raises(UsageError, match="256 is longer than the 128 positions factory_models:tiny_gpt2"):
            autoplan.search("factory_models:tiny_gpt2", "1GB", gpus=2, seq_len=256)
    finally:
        sys.path.remove(str(REPO / "tests"))
    with pytest.raises(UsageError, match="256 is longer than the 128 positions GPT2"):
        autoplan.estimate(autoplan.models.zoo.build_model("gpt2-tiny"), "shard", seq_len=256)


@pytest.mark.parametrize("factory, expected", [
    ("torch.nn:Linear", "model factory 'torch.nn:Linear' raised TypeError"),
    ("os:system", "model factory 'os:system' raised TypeError"),
    ("os:getcwd", "model factory 'os:getcwd' returned str, not a torch.nn.Module"),
])
def test_a_factory_that_fails_is_a_usage_error_naming_it(tmp_path, monkeypatch, capsys, factory, expected):
    monkeypatch.chdir(tmp_path)
    assert main(["search", "--model", factory, "--seq-len", "16", "--mem", "1GB"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()


def test_a_factory_module_that_raises_says_where(tmp_path, monkeypatch):
    (tmp_path / "broken_models.py").write_text("import torch\n\ndef build():\n    return 1 / 0\n")
    (tmp_path / "broken_import.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match=r"raised ZeroDivisionError: division by zero \(at .*broken_models.py:4\)"):
        autoplan.search("broken_models:build", "1GB", seq_len=16)
    with pytest.raises(UsageError, match=r"importing 'broken_import' failed: RuntimeError: no GPU here \(at .*:1\)"):
        autoplan.search("broken_import:build", "1GB", seq_len=16)


def _refuse_to_search(monkeypatch):
    import autoplan.api.search

    monkeypatch.setattr(autoplan.api.search, "search", lambda **_: pytest.fail("searched before checking -o"))


def test_an_output_path_that_is_a_directory_fails_before_the_search(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plans").mkdir()
    (tmp_path / "a-file").write_text("x")
    _refuse_to_search(monkeypatch)
    assert main(["search", *TINY, "--mem", "40MB", "-o", "plans"]) == 2
    assert "plans is a directory; give a file name" in capsys.readouterr().err
    assert main(["search", *TINY, "--mem", "40MB", "-o", "a-file/plan.json"]) == 2
    assert "a-file is a file, not a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "plans"] and not any((tmp_path / "plans").iterdir())


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody may write: mode 0555, and for root (who ignores modes) the immutable attribute."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False).returncode != 0:
            pytest.skip("running as root where chattr +i is not available: no directory is read-only")
    else:
        folder.chmod(0o555)
    yield folder
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


def test_an_output_path_in_a_read_only_directory_fails_before_the_search(read_only_dir, monkeypatch, capsys):
    monkeypatch.chdir(read_only_dir.parent)
    _refuse_to_search(monkeypatch)
    assert main(["search", *TINY, "--mem", "40MB", "-o", "read-only/plan.json"]) == 2
    err = capsys.readouterr().err
    assert "cannot write --out read-only/plan.json: the directory read-only takes no new file" in err
    assert main(["search", *TINY, "--mem", "40MB", "-o", "read-only/new/plan.json"]) == 2  # folders to create
    assert "the directory read-only takes no new file" in capsys.readouterr().err
    assert not any(read_only_dir.iterdir())


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_plan_files_get_the_users_umask(tmp_path, umask, plan_data):
    old = os.umask(umask)
    try:
        plan = autoplan.plan.schema.Plan.model_validate(plan_data)
        plan.save(tmp_path / "plan.json")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plan.json").stat().st_mode) == 0o666 & ~umask
    assert autoplan.load_plan(tmp_path / "plan.json") == plan


@pytest.mark.parametrize("argv, expected", [
    (["--mem", "-1GB"], "memory limit '-1GB' must be positive"),
    (["--mem=-1GB"], "memory limit '-1GB' must be positive"),
    (["--mem", "-0.5"], "memory limit '-0.5' must be positive"),
    (["--mem", "1e400"], "memory limit '1e400' is too large"),
    (["--mem", "1e300TB"], "is too large"),
])
def test_sizes_argparse_would_misread_get_their_own_message(tmp_path, monkeypatch, capsys, argv, expected):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["search", *TINY, *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "expected one argument" not in err
    with pytest.raises(UsageError, match=expected.replace("(", r"\(")):
        autoplan.estimate("gpt2-tiny", "shard", seq_len=64, mem=argv[-1].removeprefix("--mem="))


@pytest.mark.slow
def test_the_console_script_finds_a_factory_module_in_the_current_directory(tmp_path):
    script = REPO / ".venv" / "bin" / "autoplan"
    if not script.exists():
        pytest.skip("no console script in .venv (run make demo)")
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        def build():
            return nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))
    """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(script), "search", "--model", "mymodels:build", "--seq-len", "16", "--gpus", "2",
                             "--mem", "1GB"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["model"]["name"] == "mymodels:build"


CHATTY = textwrap.dedent("""
    import torch.nn as nn

    print("chatty: imported")

    class Chatty(nn.Sequential):
        def forward(self, ids):
            print("chatty: forward")
            return super().forward(ids)

    def build():
        print("chatty: building")
        return Chatty(nn.Embedding(64, 16), nn.Linear(16, 64))
""")


@pytest.mark.parametrize("command", [
    ["search", "-o", "plan.json"], ["estimate", "--strategy", "shard", "--batch-size", "2"],
])
def test_what_a_factory_prints_goes_to_stderr_not_into_json_output(run_cli, tmp_path, monkeypatch, capsys, command):
    (tmp_path / "chatty.py").write_text(CHATTY)
    result = run_cli(*command, "--model", "chatty:build", "--seq-len", "16", "--gpus", "2", "--mem", "1GB", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # the JSON alone
    assert data["model"]["name"] == "chatty:build"
    assert all(f"chatty: {what}" in result.stderr for what in ("imported", "building", "forward"))
    if command[0] == "search":  # explain and diff rebuild the factory's model too (here, in this process)
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path))
        for argv in (["explain", "plan.json"], ["diff", "plan.json", "plan.json"]):
            assert main([*argv, "--model", "chatty:build", "--json"]) == 0
            out, err = capsys.readouterr()
            json.loads(out)
            assert "chatty: building" in err and "chatty: " not in out


@pytest.mark.parametrize("argv, says", [
    (["--gpus", "1000000"], ("1,000,000 GPUs on one node is more than a node holds (at most 128): --gpus is the whole "
                             "cluster, spread over --nodes; give the node count too, e.g. --nodes 125000")),
    (["--gpus", "1001"], "1,001 GPUs on one node is more than a node holds"),
    (["--gpus-per-node", "4096"], "4,096 GPUs on one node"),
    (["--nodes", "2", "--gpus", "512"], "256 GPUs on one node"),
    (["--nodes", "500000", "--gpus-per-node", "8"], "a cluster of 4,000,000 GPUs is more than the 1,048,576"),
])
def test_a_cluster_too_large_to_be_meant_is_refused(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.chdir(tmp_path)
    assert main(["search", "--model", "gpt2-tiny", "--seq-len", "64", "--mem", "1GB", *argv]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "plan.json").exists()


def test_a_large_cluster_given_by_its_nodes_is_planned():
    settings = autoplan.SearchSettings.create(model="gpt2-tiny", gpus=1_000_000, nodes=125_000)
    assert (settings.gpus, settings.nodes) == (1_000_000, 125_000)
    assert autoplan.SearchSettings.create(model="gpt2-tiny", gpus=128).gpus == 128
