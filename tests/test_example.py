"""examples/train.py, a team's loop with autoplan in it, runs on 2 gloo ranks under torchrun: it trains, saves a
sharded checkpoint, and a run of it under another plan resumes from it with the uninterrupted run's losses."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import autoplan

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _train(tmp_path, plan, nproc, *flags) -> dict[int, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "--max-restarts=0", str(REPO / "examples" / "train.py"), str(plan), *map(str, flags)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+) loss (\S+)", completed.stdout, re.M)}


def test_the_example_trains_saves_and_resumes_under_another_plan(tmp_path):
    # the team's plan, searched on this machine's profile; the other plan fixes every block otherwise
    common = dict(gpus=2, seq_len=32, global_batch=8, profile="cpu-gloo-2")
    planned = autoplan.search("llama-tiny", "40MB", **common)
    planned.save(tmp_path / "plan.json")
    other = autoplan.search("llama-tiny", "40MB", pin=["layers.*=shard_keep+ckpt", "<root>=shard"], **common)
    other.save(tmp_path / "other.json")
    assert [u.label for u in other.units] != [u.label for u in planned.units]

    # one run is both the uninterrupted curve and the saved one: a save that changed the run's state would make
    # the run resumed from it leave this curve
    whole = _train(tmp_path, tmp_path / "plan.json", 2, "--steps", 6, "--save", "ckpt", "--save-every", 3)
    assert sorted(whole) == [1, 2, 3, 4, 5, 6] and whole[6] < whole[1]
    assert (tmp_path / "ckpt" / "step-3" / "autoplan-checkpoint.json").is_file()
    resumed = _train(tmp_path, tmp_path / "other.json", 2, "--steps", 6, "--resume", "ckpt/step-3")
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == pytest.approx({k: whole[k] for k in (4, 5, 6)}, rel=1e-4)
