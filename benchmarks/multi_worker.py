"""One torchrun launch that executes many plans in turn (one process group, one start-up), each with
autoplan's own training loop and measurement (autoplan.worker.train). Used by plan_quality.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/multi_worker.py specs.json
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch.distributed as dist

from autoplan.run.worker import RankResult, RunSpec, train


def main() -> None:
    specs = [RunSpec(**spec) for spec in json.loads(open(sys.argv[1]).read())]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    for spec in specs:
        result = RankResult(rank=rank)
        try:
            train(spec, rank, world_size, result)
            result.status = "ok"
        except Exception as exc:  # noqa: BLE001 - record it and go on with the next plan
            result.status, result.error = "failed", f"{type(exc).__name__}: {exc}"
        result.save(spec.run_dir)
        dist.barrier()
    # same teardown as autoplan.worker: no destroy_process_group (it can abort gloo after the work)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
