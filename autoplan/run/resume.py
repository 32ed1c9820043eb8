"""`autoplan apply --save DIR --save-every N` and `--resume DIR`: a run's checkpoints, on every rank.

A run resumed from a checkpoint carries on where the saved one stopped: the model's weights and the
optimizer's state (resharded for this run's plan by torch.distributed.checkpoint: autoplan.run.checkpoint),
the step count, and the data position. The data is a function of the step (synthetic tokens are drawn from
(seed, step)); an Alpaca file is read from the sample the saved run had reached, also where this plan's
global batch differs from the saved one's. Steps are counted across runs: a checkpoint saved after the
run's third step of one resumed at step 3 is `DIR/step-6`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoplan.errors import UsageError
from autoplan.fileio import check_writable
from autoplan.run.checkpoint import (
    RECORD_FILE,
    check_params,
    find_checkpoint,
    load_checkpoint,
    read_record,
    save_checkpoint,
    step_folder,
)
from autoplan.run.data import AlpacaTokens, BatchShape
from autoplan.run.tp import check_resume_degree

__all__ = ["CheckpointFlags", "Checkpoints", "StepsFrom"]


@dataclass(frozen=True)
class CheckpointFlags:
    """`autoplan apply`'s --save, --save-every and --resume."""

    save_dir: str | None = None
    save_every: int | None = None
    resume: str | None = None

    def check(self, plan, model) -> list[str]:
        """UsageError (or CheckpointError) for flags that cannot work, before any rank starts: --save-every without
        --save or below 1, a --save folder that cannot be written, a --resume with no finished checkpoint or one
        of another model. Returns what to say before the run."""
        if self.save_every is not None and (self.save_every < 1 or self.save_dir is None):
            raise UsageError(f"`save_every` {self.save_every}: give a number of steps of at least 1, with `save` DIR")
        said = []
        if self.save_dir is not None:
            check_writable(Path(self.save_dir) / "step-0" / RECORD_FILE, "checkpoint folder", param="save")
            said.append(f"checkpoints to {self.save_dir}/step-<N> " + (f"every {self.save_every} steps and "
                                                                        if self.save_every else "") + "at the end")
        if self.resume is not None:
            found = find_checkpoint(self.resume)
            record = read_record(found)
            check_params(record, model, found)
            check_resume_degree(model, (record.get("plan") or {}).get("tp") or 1, plan.cluster.tp_degree, str(found))
            said.append(f"resumes from {found} (step {record['step']}"
                        + (f", saved under a plan of {record['plan']['world_size']} ranks" if record.get("plan")
                           else "")
                        + ")")
        return said


class StepsFrom:
    """A data source whose step 0 is `first` of `data`: the global batches of a resumed run."""

    def __init__(self, data: Any, first: int):
        self.data, self.first = data, first

    def global_batch(self, step: int, shape: BatchShape):
        return self.data.global_batch(self.first + step, shape)


@dataclass
class Checkpoints:
    """What one rank does about checkpoints in a run: where it resumed, and when it saves."""

    save_dir: str | None
    save_every: int | None  # steps between saves, counted across runs; None: at the end only
    last_step: int  # index of the run's last step (in this run's numbering)
    data_label: str = ""  # what the data is (recorded in the checkpoint)
    first: int = 0  # steps taken before this run (the resumed checkpoint's)
    resumed_samples: int = 0  # samples read before this run

    def resume(self, path: str | None, model, optimizer, data: Any, shape: BatchShape) -> Any:
        """Load the checkpoint at `path` (a step folder, or a --save folder: its latest) into the model and the
        optimizer; the data, from the position the checkpoint saved. Nothing without a `path`."""
        if path is None:
            return data
        loaded = load_checkpoint(path, model, optimizer)
        self.first = loaded.step
        self.resumed_samples = int(loaded.data.get("samples", loaded.step * shape.global_batch_size))
        if isinstance(data, AlpacaTokens):  # from the saved run's sample, whatever its global batch was
            data.first_row = self.resumed_samples - loaded.step * shape.global_batch_size
        return StepsFrom(data, loaded.step)

    def after_step(self, step: int, model, optimizer, plan, shape: BatchShape) -> str | None:
        """Called on every rank after the run's `step` (0-based); saves when a save is due, returning its folder."""
        if self.save_dir is None:
            return None
        taken = self.first + step + 1
        due = (self.save_every is not None and taken % self.save_every == 0) or step == self.last_step
        if not due:
            return None
        folder = step_folder(self.save_dir, taken)
        save_checkpoint(folder, model, optimizer, step=taken, plan=plan,
                        data={"samples": self._samples(step, shape), "global_batch": shape.global_batch_size,
                              "source": self.data_label})
        return str(folder)

    def _samples(self, step: int, shape: BatchShape) -> int:
        """Samples read so far: the resumed run's, then this run's global batches."""
        return self.resumed_samples + (step + 1) * shape.global_batch_size
