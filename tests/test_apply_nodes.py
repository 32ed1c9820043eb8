"""A run over several nodes (issue 16, item 11): two "nodes" of one rank each, rendezvousing over localhost.

Two `autoplan apply` processes, as two nodes would run them (`--nnodes 2 --node-rank 0|1 --rdzv-endpoint
127.0.0.1:PORT`), run a plan for a world of 2. Node 0 prints and writes the report with both ranks'
measurements (rank 1's sent over the rendezvous store); node 1 says how its own rank did.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from planmaker import make_plan

from autoplan.run.report import load_report

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_of_one_rank_each_report_on_node_0(tmp_path):
    plan_path, report_path = tmp_path / "plan.json", tmp_path / "r.json"
    make_plan("gpt2-tiny", {"transformer.h.0": "shard", "transformer.h.1": "replicate"}).save(plan_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen([sys.executable, "-m", "autoplan", "apply", str(plan_path), "--steps", "2", "--warmup", "1",
                          "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", endpoint,
                          "--report", str(report_path), "--timeout", "120"],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=900) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    (out0, err0), (out1, err1) = outputs
    assert nodes[0].returncode == 0, err0[-3000:]
    assert nodes[1].returncode == 0, err1[-3000:]

    assert "on 1 rank(s) of 2 on node 0 of 2" in out0 and "--nnodes=2 --node-rank=0 --rdzv-backend=static" in out0
    assert "on 2 rank(s) on 2 nodes" in out0 and "peak memory per rank" in out0  # node 0: the report
    assert "rank 1 (this node): ok after 3 step(s)" in out1 and "node 0 prints the predicted-vs-measured" in out1

    report = load_report(report_path)  # written by node 0 only, with both ranks' measurements
    assert report.status == "ok" and report.nodes == 2 and report.world_size == 2 and not report.dry_run
    assert set(report.measured.peak_mem_bytes_per_rank) == {"0", "1"}
    assert len(report.measured.losses) == 3 and report.measured.step_time_s > 0
    assert json.loads(report_path.read_text())["nodes"] == 2
