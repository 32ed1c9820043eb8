"""A progress bar for a trace that takes a while: a model traced block by block (its blocks differ,
or a short trace of them could not stand for the whole) runs every block forward and backward on the
meta device, a quarter of a second each for a Hugging Face block here.

The bar counts blocks, forward then backward, on stderr (tqdm), and appears only once a trace has
taken DELAY_S: a search that answers at once prints nothing.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from cost_models.records import OpRecord

__all__ = ["DELAY_S", "LOG_INTERVAL_S", "BlockProgress"]

DELAY_S = 2.0
LOG_INTERVAL_S = 10.0


class BlockProgress:
    """Told of each op as it starts (counting.CostMode.progress); moves the bar when a later block starts."""

    def __init__(self, label: str, blocks_path: str, blocks: int, delay_s: float | None = None):
        self.prefix, self.blocks = blocks_path + ".", blocks
        # a terminal redraws the bar in place; a log file gets a line now and then
        interval = 0.2 if sys.stderr.isatty() else LOG_INTERVAL_S
        self.bar = tqdm(total=2 * blocks, desc=label, unit="block", delay=DELAY_S if delay_s is None else delay_s,
                        file=sys.stderr, leave=False, dynamic_ncols=True, mininterval=interval)

    def __call__(self, op: OpRecord, backward: bool) -> None:
        if not op.module.startswith(self.prefix):
            return
        head = op.module[len(self.prefix):].split(".", 1)[0]
        if not head.isdigit():
            return
        block = int(head)
        done = self.blocks + (self.blocks - block) if backward else block + 1
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        if done >= 2 * self.blocks:
            self.bar.close()
