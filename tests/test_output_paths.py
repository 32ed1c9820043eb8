"""Output paths (issue 26, item 1): every writer (`search -o`, `--emit-pins`, `apply --report`, `profile -o`)
writes regular files only. A FIFO or a device node is refused and left as it was, a symlink is written
through to its file (the link stays), a read-only file is refused (exit 2), and a failed write leaves the
old file whole. Through the CLI, in this process: the checks come before any work."""

import json
import os
import stat

import pytest
from planmaker import make_plan

from autoplan.cli.main import main
from autoplan.errors import UsageError
from autoplan.fileio import write_text_atomic

TINY = ["--model", "gpt2-tiny", "--gpus", "2", "--seq-len", "64", "--mem", "40MB", "--fit-to", "allocated"]


def cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's usage errors (apply reports its checks through them)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def fifo(path):
    os.mkfifo(path)
    return path


def device_node(path):
    """A character device with /dev/null's numbers, where this user may make one (root); else the test is skipped."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"mknod is not allowed here: {exc}")
    return path


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command starts its work (a search, a measurement, a launch) before refusing its output."""
    import autoplan.api.search
    import autoplan.cli.apply
    import autoplan.profiling

    monkeypatch.setattr(autoplan.api.search, "search", lambda **_: pytest.fail("searched before checking the output"))
    monkeypatch.setattr(autoplan.profiling, "measure_profile", lambda *_: pytest.fail("measured before checking -o"))
    monkeypatch.setattr(autoplan.cli.apply, "launch", lambda *_, **__: pytest.fail("launched before checking --report"))


@pytest.fixture
def plan_path(tmp_path):
    path = tmp_path / "plan.json"
    make_plan("gpt2-tiny", {"transformer.h.0": "shard"}).save(path)
    return path


@pytest.mark.parametrize("make, kind", [(fifo, "a FIFO (named pipe)"), (device_node, "a character device")])
def test_search_refuses_to_replace_a_fifo_or_a_device_node(tmp_path, capsys, no_work, make, kind):
    target = make(tmp_path / "target")
    mode = target.lstat().st_mode
    for flag in ("-o", "--emit-pins"):
        argv = [flag, target] if flag == "-o" else ["-o", tmp_path / "plan.json", flag, target]
        code, _, err = cli(capsys, "search", *TINY, *argv)
        assert code == 2, err
        assert f"it is {kind}, and autoplan writes only regular files" in err and str(target) in err
        assert target.lstat().st_mode == mode  # still the FIFO / the device, not a plain file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # nothing else written, no temporary left


def test_search_writes_through_a_symlink_and_keeps_the_link(tmp_path, capsys):
    (tmp_path / "plans").mkdir()
    real = tmp_path / "plans" / "real.json"
    real.write_text("old")
    link = tmp_path / "plan.json"
    link.symlink_to(real)
    dangling = tmp_path / "pins.yaml"
    dangling.symlink_to(tmp_path / "plans" / "pins.yaml")  # points to a file not there yet: it is made
    code, _, err = cli(capsys, "search", *TINY, "-o", link, "--emit-pins", dangling)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert json.loads(real.read_text())["schema_version"] == 1
    assert dangling.is_symlink() and "\npins:\n" in (tmp_path / "plans" / "pins.yaml").read_text()
    assert sorted(p.name for p in (tmp_path / "plans").iterdir()) == ["pins.yaml", "real.json"]


def test_a_symlink_to_a_fifo_is_refused_as_the_fifo_is(tmp_path, capsys, no_work):
    link = tmp_path / "plan.json"
    link.symlink_to(fifo(tmp_path / "pipe"))
    code, _, err = cli(capsys, "search", *TINY, "-o", link)
    assert code == 2 and f"(a symlink to {tmp_path / 'pipe'}): it is a FIFO" in err
    assert link.is_symlink() and stat.S_ISFIFO((tmp_path / "pipe").stat().st_mode)


def test_a_read_only_file_is_refused_not_replaced(tmp_path, capsys, no_work):
    target = tmp_path / "plan.json"
    target.write_text("keep me")
    target.chmod(0o444)
    code, _, err = cli(capsys, "search", *TINY, "-o", target)
    assert code == 2 and f"cannot write --out {target}: the file is read-only (mode -r--r--r--)" in err
    assert "chmod u+w" in err
    assert target.read_text() == "keep me" and stat.S_IMODE(target.stat().st_mode) == 0o444


def test_a_file_written_again_keeps_its_mode(tmp_path, capsys):
    target = tmp_path / "plan.json"
    target.write_text("old")
    target.chmod(0o640)
    assert cli(capsys, "search", *TINY, "-o", target)[0] == 0
    assert stat.S_IMODE(target.stat().st_mode) == 0o640 and json.loads(target.read_text())["units"]


@pytest.mark.parametrize("make", [fifo, device_node])
def test_apply_refuses_a_report_path_that_is_not_a_regular_file_before_launching(plan_path, tmp_path, capsys, no_work,
                                                                                 make):
    target = make(tmp_path / "report")
    for extra in ([], ["--fake-world"]):
        code, out, err = cli(capsys, "apply", plan_path, "--report", target, *extra)
        assert code == 2 and "autoplan writes only regular files" in err, err
        assert "launching torchrun" not in out and "as rank 0" not in out
    assert not stat.S_ISREG(target.lstat().st_mode)


def test_apply_refuses_a_read_only_report_before_launching(plan_path, tmp_path, capsys, no_work):
    target = tmp_path / "r.json"
    target.write_text("{}")
    target.chmod(0o400)
    code, _, err = cli(capsys, "apply", plan_path, "--report", target)
    assert code == 2 and "the file is read-only" in err and target.read_text() == "{}"


@pytest.mark.parametrize("make", [fifo, device_node])
def test_profile_refuses_an_output_that_is_not_a_regular_file_before_measuring(tmp_path, capsys, no_work, make):
    target = make(tmp_path / "profile.json")
    code, _, err = cli(capsys, "profile", "--quick", "--no-cache", "--no-progress", "-o", target)
    assert code == 2 and "autoplan writes only regular files" in err
    assert not stat.S_ISREG(target.lstat().st_mode)


def test_a_profile_folder_that_is_a_file_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / "not-a-folder").write_text("x")
    monkeypatch.setenv("AUTOPLAN_PROFILE_DIR", str(tmp_path / "not-a-folder"))
    for argv in (["profiles"], ["profile", "--quick", "--no-cache", "--no-progress"], ["search", *TINY]):
        code, _, err = cli(capsys, *argv)
        assert code == 2, (argv, err)
        assert f"$AUTOPLAN_PROFILE_DIR is {tmp_path / 'not-a-folder'}, which is a file, not a folder" in err
    assert (tmp_path / "not-a-folder").read_text() == "x"


def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "plan.json"
    target.write_text("old")

    def fail(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(target, "new " * 10_000)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    monkeypatch.undo()
    with pytest.raises(UsageError, match="it is a FIFO"):
        write_text_atomic(fifo(tmp_path / "pipe"), "x")
