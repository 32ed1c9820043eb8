import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Tests trace afresh: a trace served from disk would hide what a test of tracing checks (the cache's own tests
# turn it on, in a folder of their own); subprocesses inherit this
os.environ["AUTOPLAN_TRACE_CACHE"] = "off"


@pytest.fixture
def run_cli(tmp_path):
    """Run the `autoplan` CLI in a subprocess (as a user would) from a scratch directory."""

    def run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:  # a guard against a hang, not speed
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        return subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=timeout)

    return run
