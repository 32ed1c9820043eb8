"""A hostile user's second round (issue 26): other paths, other files, other signals, malformed input. Each
case goes through the CLI and must end with a clear message and the right exit status (usage 2; a signal
128 + its number), no traceback, and nothing written or replaced that was not asked for."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import autoplan
from autoplan.cli.main import main

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "gpt2-tiny", "--gpus", "2", "--seq-len", "64", "--mem", "40MB", "--fit-to", "allocated"]


def cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.fixture(scope="module")
def plan_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    autoplan.search("gpt2-tiny", "40MB", gpus=2, seq_len=64, fit_to="allocated").save(path)
    return path.read_text()


@pytest.fixture
def plan_path(tmp_path, plan_text):
    path = tmp_path / "plan.json"
    path.write_text(plan_text)
    return path


# ---- other paths: an output that is one of the command's own files, or no file name at all ----


def test_1_a_plan_and_its_pins_written_to_one_file(tmp_path, capsys):
    code, _, err = cli(capsys, "search", *TINY, "-o", tmp_path / "same", "--emit-pins", tmp_path / "same")
    assert code == 2 and "is the --emit-pins file" in err and not (tmp_path / "same").exists()


def test_2_a_plan_written_over_the_pins_file_it_reads(tmp_path, capsys):
    pins = tmp_path / "pins.yaml"
    pins.write_text("pins:\n  <root>: shard\n")
    code, _, err = cli(capsys, "search", *TINY, "--pins", pins, "-o", pins)
    assert code == 2 and f"--out {pins} is the --pins file" in err and pins.read_text() == "pins:\n  <root>: shard\n"


@pytest.mark.parametrize("extra", [[], ["--fake-world"]])
def test_3_a_report_written_over_the_plan_it_runs(plan_path, plan_text, capsys, extra):
    code, out, err = cli(capsys, "apply", plan_path, "--report", plan_path, *extra)
    assert code == 2 and "is the plan file" in err and plan_path.read_text() == plan_text
    assert "launching torchrun" not in out


def test_4_an_output_path_that_is_a_symlink_loop(tmp_path, capsys):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    code, _, err = cli(capsys, "search", *TINY, "-o", tmp_path / "loop")
    assert code == 2 and "Too many levels of symbolic links" in err and (tmp_path / "loop").is_symlink()


def test_5_an_output_path_ending_in_a_slash_names_a_folder(tmp_path, capsys):
    code, _, err = cli(capsys, "search", *TINY, "-o", f"{tmp_path / 'plans'}/")
    assert code == 2 and "it ends in /, so it names a directory" in err and list(tmp_path.iterdir()) == []


def test_6_a_profile_written_where_no_file_can_be_made(tmp_path, capsys):
    code, _, err = cli(capsys, "profile", "--quick", "--no-cache", "--no-progress", "-o", "/proc/autoplan.json")
    assert code == 2 and "cannot write the profile file /proc/autoplan.json" in err


# ---- other files: devices, folders, text that is not UTF-8 or not a plan, records nested or keyed twice ----


@pytest.mark.parametrize("command", [
    ["estimate", "--plan", "{dev}"], ["explain", "{dev}"], ["search", *TINY, "--pins", "{dev}"],
    ["search", *TINY, "--profile", "{dev}.json"],
])
def test_7_an_input_that_is_a_device_is_refused_not_read_forever(tmp_path, capsys, command):
    (tmp_path / "zero.json").symlink_to("/dev/zero")  # /dev/zero under a plan-like name too
    dev = "/dev/zero" if command[0] != "search" or "--pins" in command else str(tmp_path / "zero")
    code, _, err = cli(capsys, *[arg.format(dev=dev) for arg in command])
    assert code == 2 and "it is a character device, not a file" in err, err


def test_8_a_data_file_that_is_a_device_is_refused_before_the_run(plan_path, capsys):
    code, out, err = cli(capsys, "apply", plan_path, "--data", "/dev/zero")
    assert code == 2 and "cannot read data file /dev/zero: it is a character device" in err
    assert "launching torchrun" not in out


def test_9_a_plan_that_is_a_folder(tmp_path, capsys):
    code, _, err = cli(capsys, "estimate", "--plan", tmp_path)
    assert code == 2 and f"cannot read plan file {tmp_path}: it is a directory, not a file" in err


def test_10_a_plan_that_is_not_utf8(tmp_path, capsys):
    (tmp_path / "latin1.json").write_bytes(b'{"schema_version": 1, "model": "caf\xe9"}')
    code, _, err = cli(capsys, "explain", tmp_path / "latin1.json")
    assert code == 2 and "cannot read plan file" in err and "can't decode byte 0xe9" in err


@pytest.mark.parametrize("text, says", [
    ("[1, 2]", "is not an autoplan plan file (no schema_version)"),
    ("", "is not valid JSON"),
    ('{"schema_version": 1e400}', "has schema_version Infinity, not a version number"),
])
def test_11_a_plan_that_is_not_a_plan(tmp_path, capsys, text, says):
    (tmp_path / "p.json").write_text(text)
    code, _, err = cli(capsys, "diff", tmp_path / "p.json", tmp_path / "p.json")
    assert code == 2 and says in err


@pytest.mark.parametrize("suffix, text", [
    (".json", '{"pins": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    (".yaml", "pins: " + "[" * 100_000 + "]" * 100_000 + "\n"),
])
def test_12_a_pins_file_nested_too_deeply(tmp_path, capsys, suffix, text):
    (tmp_path / f"pins{suffix}").write_text(text)
    code, _, err = cli(capsys, "search", *TINY, "--pins", tmp_path / f"pins{suffix}", "-o", tmp_path / "plan.json")
    assert code == 2 and "nests too deeply to read" in err and not (tmp_path / "plan.json").exists()


def test_13_a_profile_with_a_key_twice(tmp_path, capsys):
    text = (REPO / "profiles" / "cpu-gloo-2.json").read_text()
    (tmp_path / "twice.json").write_text(text.replace("{", '{"name": "other",', 1))
    code, _, err = cli(capsys, "estimate", *TINY[:6], "--strategy", "shard", "--profile", tmp_path / "twice.json")
    assert code == 2 and "the key 'name' appears twice in one object" in err


def test_14_a_measurement_cache_folder_that_is_a_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "cache").write_text("x")
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = cli(capsys, "profile", "--quick", "--no-progress", "-o", tmp_path / "p.json")
    assert code == 2 and "($AUTOPLAN_CACHE_DIR) is a file, not a folder" in err
    assert (tmp_path / "cache").read_text() == "x" and not (tmp_path / "p.json").exists()


# ---- other signals: SIGTERM, SIGHUP, SIGINT in the background, a reader that goes away ----

SLEEPY = textwrap.dedent("""
    import sys, time
    import torch.nn as nn

    class Sleepy(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)

        def forward(self, ids):
            print("sleepy: forward", file=sys.stderr, flush=True)
            time.sleep(600)
            return self.head(self.emb(ids))

    def build():
        return Sleepy()
""")


def _dispositions(background: bool) -> None:
    """The child's signals as a shell gives them: SIGTERM and SIGHUP at their defaults whatever this test runs
    under (under `nohup` SIGHUP is inherited ignored, and a command that ignores it rightly keeps running), and
    SIGINT ignored for a command started in the background."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN if background else signal.SIG_DFL)


def _stopped_while_tracing(tmp_path, command, sig, background=False) -> subprocess.CompletedProcess:
    """Run `command` on the sleepy model, send `sig` once its forward is running, return how it ended."""
    (tmp_path / "sleepy.py").write_text(SLEEPY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    started = subprocess.Popen(
        [sys.executable, "-m", "autoplan", *command, "--model", "sleepy:build", "--seq-len", "16", "--gpus", "2",
         "--mem", "1GB"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: _dispositions(background))  # noqa: PLW1509
    try:
        lines = []
        for line in started.stderr:
            lines.append(line)
            if "sleepy: forward" in line:
                break
        else:
            pytest.fail("".join(lines))
        started.send_signal(sig)
        out, err = started.communicate(timeout=120)
    finally:
        if started.poll() is None:
            started.kill()
            started.wait()
    return subprocess.CompletedProcess(started.args, started.returncode, out, "".join(lines) + err)


@pytest.mark.slow
def test_15_sigterm_stops_a_search_and_leaves_no_file(tmp_path):
    done = _stopped_while_tracing(tmp_path, ["search", "-o", "plan.json", "--emit-pins", "pins.yaml"], signal.SIGTERM)
    assert done.returncode == 143 and "interrupted by SIGTERM" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("__")) == ["sleepy.py"]


@pytest.mark.slow
def test_16_sighup_stops_an_estimate(tmp_path):
    done = _stopped_while_tracing(tmp_path, ["estimate", "--strategy", "shard", "--batch-size", "2"], signal.SIGHUP)
    assert done.returncode == 129 and "interrupted by SIGHUP" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_17_sigint_stops_a_search_started_in_the_background(tmp_path):
    done = _stopped_while_tracing(tmp_path, ["search", "-o", "plan.json"], signal.SIGINT, background=True)
    assert done.returncode == 130 and "interrupted" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "plan.json").exists()


def test_18_a_reader_that_goes_away_early(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    reader = subprocess.Popen([sys.executable, "-m", "autoplan", "search", *TINY, "--json", "-o", "plan.json"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader.stdout.read(10)  # `| head -c 10`
    reader.stdout.close()
    err = reader.stderr.read().decode()
    assert reader.wait(timeout=900) == 0 and "Traceback" not in err and "BrokenPipe" not in err
    assert json.loads((tmp_path / "plan.json").read_text())["units"]


# ---- malformed input ----


@pytest.mark.parametrize("argv, says", [
    (["search", *TINY[:6], "--mem", "1e400"], "is too large (it is not a finite number of bytes)"),
    (["search", *TINY[:6], "--mem", "nan"], "is not a size"),
    (["search", *TINY, "--time-limit", "nan"], "'nan' must be positive"),
    (["search", *TINY, "--headroom", "nan"], "--headroom must be a fraction of the limit in [0, 0.5), got nan"),
    (["search", *TINY, "--pin", "=shard"], "give PATTERN=DECISION"),
])
def test_19_numbers_and_pins_that_are_not(capsys, argv, says):
    code, _, err = cli(capsys, *argv)
    assert code == 2 and says in err, err


@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan"])
def test_20_a_rendezvous_timeout_that_is_not_a_time(plan_path, capsys, value):
    code, out, err = cli(capsys, "apply", plan_path, "--rdzv-timeout", value)
    assert code == 2 and "--rdzv-timeout must be a positive number of seconds" in err and "launching" not in out


def test_21_a_zoo_model_of_negative_layers_is_blamed_on_the_field(capsys):
    code, _, err = cli(capsys, "search", "--model", "gpt2-tiny[n_layers=-3]", "--seq-len", "64", "--mem", "1GB")
    assert code == 2 and "n_layers must be positive, got -3" in err
