"""Results of the ranks of other nodes, relayed to node 0, so that the report written there covers every rank.

On a run over several nodes each rank writes its `rank<N>.json` on its own node; node 0's launcher hosts
the rendezvous store, so the ranks of the other nodes put their results there after every step, and rank 0
writes those into its run directory. On one node nothing is relayed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from autoplan.fileio import write_text_atomic

__all__ = ["FirstNodeRelay"]


class FirstNodeRelay:
    """Several nodes: the ranks of nodes other than node 0 put their result in the rendezvous store (hosted
    by node 0's launcher) after every step, and rank 0 writes those into its run directory, so the report on
    node 0 covers every rank. Nothing is sent on one node."""

    def __init__(self, rank: int, world_size: int, local_world_size: int):
        self.rank, self.world_size = rank, world_size
        self.store = None
        self.first_node = rank < local_world_size  # static rendezvous: node 0 holds ranks 0 .. local - 1
        if world_size > local_world_size and (rank == 0 or not self.first_node):
            self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                       timeout=timedelta(seconds=30))

    @classmethod
    def from_environment(cls, rank: int, world_size: int) -> FirstNodeRelay:
        """For a rank started by torch.distributed.run (LOCAL_WORLD_SIZE: the ranks of this node)."""
        return cls(rank, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))))

    def send(self, result) -> None:
        """Put `result` (a worker.RankResult) in the store, from a rank of a node other than node 0."""
        if self.store is not None and not self.first_node:
            self.store.set(f"autoplan/rank{result.rank}", json.dumps(dataclasses.asdict(result)))

    def collect(self, path_of: Callable[[int], Path]) -> None:
        """Rank 0: write the results the other nodes' ranks sent (those there are; nothing waits), each at
        `path_of(rank)`."""
        if self.store is None or self.rank != 0:
            return
        for rank in range(self.world_size):
            key = f"autoplan/rank{rank}"
            try:
                if self.store.check([key]):
                    write_text_atomic(path_of(rank), self.store.get(key).decode())
            except Exception:  # noqa: BLE001 - a store gone with its node: that rank is reported as silent
                return
