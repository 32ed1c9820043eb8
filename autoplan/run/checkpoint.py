"""Sharded checkpoints: each rank writes its shards with torch.distributed.checkpoint (DCP), and a run
resumes under any plan of the same model, on any number of ranks.

What a checkpoint folder holds:
- DCP's files: the model's parameters and the optimizer's tensor states, as the sharded state dicts of
  `torch.distributed.checkpoint.state_dict` name them (by parameter path, whatever the sharding). DCP
  records each tensor's global shape and every shard's place in it, so loading into another sharding
  (other units, sharding kinds, checkpointing, tensor-parallel degree or world size) reads each rank's new
  shard from the shards saved: a plan is a layout of the same parameters, and DCP reshards.
- `autoplan-checkpoint.json`, written last, by rank 0, once every rank's shards are on disk (so a folder
  without it is a checkpoint that did not finish): the step, the data position, the optimizer's
  hyperparameters and non-tensor state, the LR scheduler's state, the parameters' paths and global shapes
  (what a model must have to load it) and the plan it was saved under.

A checkpoint folder is data: loading it never imports or runs code. DCP itself reads its index with
`pickle` and non-tensor entries with `torch.load(weights_only=False)`, either of which runs whatever a
crafted file names; here the index is read by an unpickler that builds only DCP's own metadata records
(`_DataOnlyReader`), an index that declares a non-tensor entry is refused, only tensors are asked of DCP
(read by its `weights_only` loader), and everything else comes from the JSON record.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from autoplan.errors import CheckpointError
from autoplan.fileio import read_versioned_json, write_text_atomic
from autoplan.version import __version__

__all__ = ["RECORD_FILE", "Checkpoint", "check_params", "find_checkpoint", "load_checkpoint", "read_record",
           "save_checkpoint", "step_folder"]

RECORD_FILE = "autoplan-checkpoint.json"
SCHEMA_VERSION = 1
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


@dataclass
class Checkpoint:
    """What a loaded checkpoint says besides the tensors it put in place."""

    path: Path
    step: int  # optimizer steps taken before it was saved
    data: dict[str, Any] = field(default_factory=dict)  # the data position, as the saver gave it
    plan: dict[str, Any] | None = None  # the plan it was saved under (its model, mesh and world size)


def step_folder(directory: str | os.PathLike, step: int) -> Path:
    """Where `autoplan apply --save DIR` puts the checkpoint of `step`: DIR/step-<step>."""
    return Path(directory) / f"step-{step}"


def find_checkpoint(path: str | os.PathLike) -> Path:
    """`path` itself when it holds a finished checkpoint, else its step-<N> folder of the largest N that does.
    CheckpointError naming what is there otherwise."""
    folder = Path(path).expanduser()
    if (folder / RECORD_FILE).is_file():
        return folder
    if not folder.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: it is not a folder")
    steps = sorted(((int(m.group(1)), child) for child in folder.iterdir()
                    if (m := _STEP_FOLDER.match(child.name)) and (child / RECORD_FILE).is_file()), reverse=True)
    if not steps:
        unfinished = [child.name for child in folder.iterdir() if _STEP_FOLDER.match(child.name)]
        raise CheckpointError(f"no finished checkpoint in {path}: it holds no {RECORD_FILE} and no step-<N> folder "
                              "with one" + (f" ({', '.join(sorted(unfinished))} did not finish saving)"
                                            if unfinished else ""))
    return steps[0][1]


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int, scheduler: Any = None, data: dict[str, Any] | None = None, plan: Any = None) -> Path:
    """Save the model (and optimizer, LR scheduler) as this rank's shards into the folder `path`; every rank of
    the process group calls it. `step` is the optimizer steps taken; `data` the data position (JSON values, e.g.
    {"samples": 4096}); `plan` the Plan it runs under, recorded. Returns the folder, once complete on every rank."""
    folder = Path(path).expanduser()
    model_state, optim_state = _state_dicts(model, optimizer)
    tensors, values = _split_optim(optim_state)
    dcp.save({"model": model_state, "optim": tensors}, storage_writer=dcp.FileSystemWriter(str(folder)))
    if _rank() == 0:
        record = {
            "schema_version": SCHEMA_VERSION, "autoplan_version": __version__, "torch_version": torch.__version__,
            "step": int(step), "data": data or {}, "world_size": _world_size(),
            "params": {name: list(param.shape) for name, param in model.named_parameters()},
            "optimizer": None if optimizer is None else {"class": type(optimizer).__name__, "values": values,
                                                         "param_groups": optim_state["param_groups"]},
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "plan": None if plan is None else _plan_summary(plan),
        }
        write_text_atomic(folder / RECORD_FILE, _dumps(record))
    if dist.is_initialized():
        dist.barrier()  # no rank goes on (or exits) before the record is written
    return folder


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    scheduler: Any = None) -> Checkpoint:
    """Load a checkpoint (a folder from `save_checkpoint`, or `autoplan apply --save`'s folder: its latest
    finished step) into `model` (and `optimizer`, `scheduler`) as they are sharded now, on every rank."""
    folder = find_checkpoint(path)
    record = read_record(folder)
    check_params(record, model, folder)
    if optimizer is not None and record.get("optimizer") is None:
        raise CheckpointError(f"the checkpoint {folder} holds no optimizer state; load the model alone (no optimizer)")
    model_state, optim_state = _state_dicts(model, optimizer)  # the shards to fill, as this model is sharded
    tensors, _ = _split_optim(optim_state)
    wanted = {"model": model_state, "optim": tensors}
    reader = _DataOnlyReader(str(folder))
    reader.read_metadata()  # refused here, with its own message, before DCP reads it (and wraps what fails)
    try:
        dcp.load(wanted, storage_reader=reader)
    except Exception as exc:  # noqa: BLE001 - DCP's own errors (a missing shard, a key not saved) name what failed
        raise CheckpointError(f"cannot load the checkpoint {folder}: {type(exc).__name__}: {exc}") from None
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=wanted["model"], optim_state_dict={})
    else:
        saved = record["optimizer"]
        merged = _merge_optim(wanted["optim"], _decoded(saved["values"]), optim_state["param_groups"],
                              _decoded(saved["param_groups"]))
        set_state_dict(model, optimizer, model_state_dict=wanted["model"], optim_state_dict=merged)
    if scheduler is not None:
        if record.get("scheduler") is None:
            raise CheckpointError(f"the checkpoint {folder} holds no LR scheduler state")
        scheduler.load_state_dict(_decoded(record["scheduler"]))
    if dist.is_initialized():
        dist.barrier()
    return Checkpoint(folder, int(record["step"]), dict(record.get("data") or {}), record.get("plan"))


# --------------------------------------------------------------------------- #
# State dicts: tensors for DCP, everything else as JSON
# --------------------------------------------------------------------------- #


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    if optimizer is None:
        model_state, _ = get_state_dict(model, [])
        return model_state, {"state": {}, "param_groups": []}
    return get_state_dict(model, optimizer)  # the optimizer's state made first where it has none yet


def _split_optim(optim_state: dict) -> tuple[dict, dict]:
    """The optimizer's per-parameter state as (tensors, other values), both keyed by parameter path."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    values: dict[str, dict[str, Any]] = {}
    for name, state in optim_state.get("state", {}).items():
        for key, value in state.items():
            (tensors if isinstance(value, torch.Tensor) else values).setdefault(str(name), {})[key] = value
    return tensors, values


def _merge_optim(tensors: dict, values: dict, groups: list[dict], saved_groups: list[dict]) -> dict:
    """The optimizer state dict to load: the tensors read, the values saved, and this optimizer's own
    parameter groups (their grouping: one per device) with the hyperparameters saved for their parameters."""
    state = {name: {**values.get(name, {}), **tensors.get(name, {})} for name in set(tensors) | set(values)}
    saved_of = {param: group for group in saved_groups for param in group["params"]}
    merged_groups = []
    for group in groups:
        saved = next((saved_of[p] for p in group["params"] if p in saved_of), None)
        hyper = {k: v for k, v in (saved or group).items() if k != "params"}
        merged_groups.append({**hyper, "params": group["params"]})
    return {"state": state, "param_groups": merged_groups}


def read_record(folder: Path) -> dict:
    """The checkpoint's JSON record (CheckpointError for one that does not read)."""
    return read_versioned_json(folder / RECORD_FILE, "checkpoint record", SCHEMA_VERSION, CheckpointError,
                               "save the checkpoint again")


def check_params(record: dict, model: nn.Module, folder: Path) -> None:
    """The model must have the checkpoint's parameters, by path and global shape; the first difference is named."""
    saved = {name: list(shape) for name, shape in record.get("params", {}).items()}
    have = {name: list(param.shape) for name, param in model.named_parameters()}
    for name, shape in have.items():
        if name not in saved:
            raise CheckpointError(f"the checkpoint {folder} is of another model: its parameters lack {name} {shape}")
        if saved[name] != shape:
            raise CheckpointError(f"the checkpoint {folder} is of another model: {name} is {saved[name]} there, "
                                  f"{shape} here")
    missing = sorted(set(saved) - set(have))
    if missing:
        raise CheckpointError(f"the checkpoint {folder} is of another model: it has {missing[0]}, which this model "
                              "lacks")


def _plan_summary(plan: Any) -> dict[str, Any]:
    c, t = plan.cluster, plan.training
    return {"model": plan.model.name, "fingerprint": plan.model.fingerprint, "world_size": c.world_size,
            "tp": c.tp_degree, "micro_batch_size": t.micro_batch_size, "grad_accum_steps": t.grad_accum_steps,
            "global_batch_size": t.global_batch_size, "units": {u.module or "<root>": u.label for u in plan.units}}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _encoded(value: Any) -> Any:
    """JSON values, tuples kept as {"tuple": [...]} (an optimizer's betas are a tuple)."""
    if isinstance(value, tuple):
        return {"tuple": [_encoded(v) for v in value]}
    if isinstance(value, list):
        return [_encoded(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encoded(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"a checkpoint records optimizer and scheduler state as plain values; {type(value).__name__} "
                          f"{value!r} is not one")


def _decoded(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"tuple"} and isinstance(value["tuple"], list):
            return tuple(_decoded(v) for v in value["tuple"])
        return {k: _decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    return value


def _dumps(record: dict) -> str:
    return json.dumps(_encoded(record), indent=1) + "\n"


# --------------------------------------------------------------------------- #
# Reading DCP's index as data
# --------------------------------------------------------------------------- #

_METADATA_FILE = ".metadata"  # DCP's index, beside its shard files
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name ("torch.strided")
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _IndexUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and torch's dtypes, and nothing else."""

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                 torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"the checkpoint's index names {module}.{name}, which is not part of a checkpoint's "
                              "index; it is not read (a checkpoint is data)")


class _DataOnlyReader(FileSystemReader):
    """DCP's file reader with its index read by `_IndexUnpickler`, and an index with non-tensor entries refused."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / _METADATA_FILE
        try:
            with open(path, "rb") as handle:
                metadata = _IndexUnpickler(handle).load()
        except CheckpointError:
            raise
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise CheckpointError(f"cannot read the checkpoint's index {path}: {exc}") from None
        entries = getattr(metadata, "state_dict_metadata", None)
        if not isinstance(entries, dict):
            raise CheckpointError(f"the checkpoint's index {path} is not a DCP index")
        objects = sorted(key for key, entry in entries.items() if isinstance(entry, BytesStorageMetadata))
        if objects:
            raise CheckpointError(f"the checkpoint {self.path} stores {objects[0]} as a pickled object, which loading "
                                  "would run as code; autoplan's checkpoints hold tensors only")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata
