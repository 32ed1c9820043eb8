"""A pipeline stage's module: the model's own submodules that one stage runs, at their own paths.

Why a module of its own, not torch's `pipeline()` splitter: the splitter traces the model with torch.export
and hands back graph modules whose submodules are no longer the model's (its `layers.3` becomes part of a
`submod_1` graph), so the plan's units (module paths) and their decisions (FSDP2 `fully_shard`, activation
checkpointing by forward hooks, tensor parallelism) would have no module to land on; it also traces every
stage on every rank. A `StageModule` instead holds the very module objects the plan names, registered under
their original paths ("layers.3" stays "layers.3", "transformer.h.0.attn" stays "transformer.h.0.attn", as
torchtitan keeps its stage's layers in a dict keyed by their index), so per-unit apply runs unchanged on
a stage; the model's code stays free of parallelism.

The stage runs its parts in the model's forward order: the embedding (first stage only), the blocks it
holds, then the parts after the blocks (norm, head). How the embedding is made and what a block takes beside
the hidden state is the one thing a stage must know of a family (`_RUNNERS`): the zoo's Llama family
(Llama, the mixture of experts: rotary tables from the root's `inv_freq`) and GPT-2 (token plus position
embeddings). The root's own buffers are the stage's too; the root's initialisation initialises it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from autoplan.errors import PlanFileError, UsageError
from autoplan.models.gpt2 import GPT2
from autoplan.models.llama import RopeTransformer, rope_tables
from autoplan.plan.pipeline_spec import PipelineSpec

__all__ = ["ModelParts", "StageModule", "model_parts", "stage_parts"]


@dataclass(frozen=True)
class _Runner:
    before: tuple[str, ...]  # the embedding's modules, run by `embed` on the first stage
    after: tuple[str, ...]  # the modules after the blocks, each run on the hidden state in turn
    embed: Callable[[StageModule, torch.Tensor], torch.Tensor]  # (stage, input ids) -> hidden state
    block_args: Callable[[StageModule, torch.Tensor], tuple]  # (stage, hidden) -> what each block takes beside it


def _rope_embed(stage: StageModule, input_ids: torch.Tensor) -> torch.Tensor:
    return stage.get_submodule("tok_embeddings")(input_ids)


def _rope_args(stage: StageModule, x: torch.Tensor) -> tuple:
    # the root computes the tables in its norm's (compute) dtype; a stage's hidden state is in it already
    return rope_tables(stage.get_buffer("inv_freq"), x.size(1), x.dtype)


def _gpt2_embed(stage: StageModule, input_ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(input_ids.size(1), device=input_ids.device)
    return stage.get_submodule("transformer.wte")(input_ids) + stage.get_submodule("transformer.wpe")(positions)


_RUNNERS: dict[type, _Runner] = {
    RopeTransformer: _Runner(("tok_embeddings",), ("norm", "lm_head"), _rope_embed, _rope_args),
    GPT2: _Runner(("transformer.wte", "transformer.wpe"), ("transformer.ln_f", "lm_head"), _gpt2_embed,
                  lambda stage, x: ()),
}


@dataclass(frozen=True)
class ModelParts:
    """A model cut into the parts a stage may hold, in forward order: embedding modules, blocks, the rest."""

    runner: _Runner
    blocks: tuple[str, ...]  # each block's path ("layers.0", ...)

    @property
    def order(self) -> tuple[str, ...]:
        return self.runner.before + self.blocks + self.runner.after


def model_parts(model: nn.Module) -> ModelParts:
    """The parts of a zoo Llama-family or GPT-2 model; UsageError for a model no stage knows how to run."""
    runner = next((r for cls, r in _RUNNERS.items() if isinstance(model, cls)), None)
    if runner is None:
        raise UsageError(f"a pipelined plan runs the zoo's Llama-family and GPT-2 models; {type(model).__name__} has "
                         "no stage runner (search it without a pipeline: `--pp 1`)")
    path = type(model).block_list_path
    blocks = tuple(f"{path}.{name}" for name, _ in model.get_submodule(path).named_children())
    own = [name for name, _ in model.named_parameters(recurse=False)]
    if own:
        raise UsageError(f"the model's root holds parameters of its own ({', '.join(own)}), which no stage can hold")
    return ModelParts(runner, blocks)


def stage_parts(model: nn.Module, pipeline: PipelineSpec) -> list[list[str]]:
    """Each stage's parts, in forward order. The plan's `modules` name them: a part, or a module holding parts (a
    block list, GPT-2's `transformer`), which stands for those of its parts no stage names itself (an embedding
    part named so by several stages is the first's, a final one the last's); "" and "<root>" (the root's own
    parameters) hold nothing. An embedding or final part no stage holds goes to the first or last stage. PlanFileError where a stage names a module the model lacks or one inside a part, where two stages hold
    a part, parts are out of forward order or a block is in no stage, or where tied weights (GPT-2's embedding and
    head) would be held by two stages."""
    parts = model_parts(model)
    named = [[(path, _named_parts(model, parts, path, index)) for path in stage.modules if path not in ("", "<root>")]
             for index, stage in enumerate(pipeline.stages)]
    owner: dict[str, int] = {}
    around: dict[str, list[int]] = {}  # parts no stage names itself -> the stages naming a module around them
    for index, paths in enumerate(named):
        for path, inside in paths:
            if inside != [path]:
                for part in inside:
                    around.setdefault(part, []).append(index)
            elif owner.setdefault(path, index) != index:
                raise PlanFileError(f"pipeline stages {owner[path]} and {index} both hold {path}")
    for part, claims in around.items():
        if part in owner or len(set(claims)) == 1:
            owner.setdefault(part, claims[0])
        elif part in parts.blocks:
            raise PlanFileError(f"pipeline stages {' and '.join(map(str, sorted(set(claims))))} both hold {part}")
        else:  # an embedding part with the first stage that may hold it, a final one with the last
            owner[part] = min(claims) if part in parts.runner.before else max(claims)
    last = len(pipeline.stages) - 1
    for part in parts.runner.before + parts.runner.after:
        owner.setdefault(part, 0 if part in parts.runner.before else last)
    missing = [block for block in parts.blocks if block not in owner]
    if missing:
        raise PlanFileError(f"the model's block(s) {', '.join(missing)} are in no pipeline stage; every block must be")
    order = [owner[part] for part in parts.order]
    if order != sorted(order) or set(order) != set(range(len(pipeline.stages))):
        listed = "; ".join(f"stage {i}: {', '.join(p for p in parts.order if owner[p] == i) or 'nothing'}"
                           for i in range(len(pipeline.stages)))
        raise PlanFileError(f"the pipeline's stages must each hold a run of the model's parts in forward order "
                            f"({listed})")
    _check_ties(model, owner)
    return [[part for part in parts.order if owner[part] == i] for i in range(len(pipeline.stages))]


def _named_parts(model: nn.Module, parts: ModelParts, path: str, index: int) -> list[str]:
    try:
        model.get_submodule(path)
    except AttributeError:
        raise PlanFileError(f"pipeline stage {index} names module {path!r}, which the model "
                            f"({type(model).__name__}) lacks") from None
    if path in parts.order:
        return [path]
    inside = [part for part in parts.order if part.startswith(path + ".")]
    if not inside:
        raise PlanFileError(f"pipeline stage {index} names {path!r}, inside one of the model's parts; a stage holds "
                            f"whole parts: {', '.join(parts.order[:3])}, ...")
    return inside


def _check_ties(model: nn.Module, owner: dict[str, int]) -> None:
    holders: dict[int, tuple[str, int]] = {}
    for part, index in owner.items():
        for name, param in model.get_submodule(part).named_parameters(remove_duplicate=False):
            seen = holders.setdefault(id(param), (f"{part}.{name}", index))
            if seen[1] != index:
                raise PlanFileError(f"{seen[0]} and {part}.{name} are one tied weight, held by pipeline stages "
                                    f"{seen[1]} and {index}; pipeline a model with untied embeddings "
                                    "(`tie_embeddings=false`)")


class StageModule(nn.Module):
    """The parts of `model` one stage runs (`parts`: paths in forward order), at their own paths, with the root's
    buffers. Input: token ids on the first stage, else the previous stage's hidden state; output: the next
    stage's input, or the logits on the last stage."""

    def __init__(self, model: nn.Module, parts: list[str], index: int, last: int):
        super().__init__()
        runner = model_parts(model).runner
        for path in parts:
            parent = self
            *outer, name = path.split(".")
            for step in outer:
                if step not in parent._modules:
                    parent.add_module(step, nn.Module())
                parent = parent._modules[step]
            parent.add_module(name, model.get_submodule(path))
        for name, buffer in model.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in model._non_persistent_buffers_set)
        self.stage_index, self.is_last = index, index == last
        self._root = (model,)  # not a submodule: the model's own initialisation (init_weights)
        self._runner = runner
        self._embeds = any(path in runner.before for path in parts)
        self._blocks = tuple(path for path in parts if path not in runner.before + runner.after)
        self._after = tuple(path for path in parts if path in runner.after)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._embeds:
            x = self._runner.embed(self, x)
        if self._blocks:
            extra = self._runner.block_args(self, x)
            for path in self._blocks:
                x = self.get_submodule(path)(x, *extra)
        for path in self._after:
            x = self.get_submodule(path)(x)
        return x

    def example_args(self, micro_batch: int, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Meta tensors of what the stage takes and gives for one micro-batch: token ids or the hidden state in,
        the hidden state or the logits out (what a stage on a fake process group is told: no peer answers it)."""
        config = self._root[0].config
        hidden = torch.empty(micro_batch, seq_len, config.d_model, dtype=dtype, device="meta", requires_grad=True)
        ids = torch.empty(micro_batch, seq_len, dtype=torch.long, device="meta")
        holds_head = self._runner.after[-1] in self._after
        logits = torch.empty(micro_batch, seq_len, config.vocab_size, dtype=dtype, device="meta", requires_grad=True)
        return (ids if self._embeds else hidden), (logits if holds_head else hidden)

    def init_weights(self) -> None:
        """The model's own initialisation, run on the model whose parts this stage holds (its other parts are
        other stages', still on the meta device, where initialising them allocates nothing); the root's buffers
        are the stage's materialised ones first."""
        (root,) = self._root
        for name, buffer in self.named_buffers(recurse=False):
            root._buffers[name] = buffer
        if hasattr(root, "init_weights"):
            root.init_weights()
            return
        for module in self.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
