"""Which modules of a model tensor parallelism can split, and how: the Megatron layout, found from the modules.

The search costs a layout (cost_models.tensor_parallel) and `apply` runs it (autoplan.run.tp); both
read it from here, so what is costed is what runs. Which module of a model plays which role is knowledge
about models, so it lives with them. A block is recognised when it has one of these shapes (SHAPES):
- the zoo Llama's: an attention module `attn` with projections `wq`, `wk`, `wv`, `wo` and head counts
  `n_heads`, `n_kv_heads`, an MLP `mlp` with `w1` (gate), `w3` (up), `w2` (down);
- Hugging Face's Llama family (Llama, Mistral, Qwen2/3, Gemma): `self_attn` with `q_proj`, `k_proj`,
  `v_proj`, `o_proj`, `mlp` with `gate_proj`, `up_proj`, `down_proj`; head counts from the config;
- GPT-NeoX: `attention` with one `query_key_value` projection laid out head by head (each head's q, k
  and v together, so a split by output features gives each rank whole heads) and `dense`, `mlp` with
  `dense_h_to_4h` and `dense_4h_to_h`; Falcon's the same under `self_attention` (its fused q/k/v laid out
  head by head, or by key/value group in the new decoder architecture: whole groups per rank);
- Phi-3: `self_attn` with `qkv_proj` (all of q, then k, then v) and `o_proj`, `mlp` with `gate_up_proj`
  (gate rows, then up rows) and `down_proj`. A split by output features would cut across the sections, so
  each section is split over the group (TpLayout.fused): autoplan.run.tp reorders the fused weight's rows
  so that rank r's block of rows holds its q heads, its k heads and its v heads (its gate and its up rows);
with norms around them (and per-head norms inside the attention, as Qwen3's, which stay whole). A block
whose MLP is a mixture of experts (stacked expert weights: the zoo's `moe`, transformers' Mixtral,
Qwen2/3-MoE) gets its attention split as above and its experts split by width, each expert on every rank
(autoplan.models.tp_experts). The model around the blocks must be an embedding,
the blocks, a final norm and a head (modules without parameters, such as a rotary embedding, aside);
the embedding and the head are split by vocabulary rows where the vocabulary divides and they are not
tied (else they stay replicated, which sequence parallelism cannot start from). Sequence parallelism
needs the zoo's dense block (whose attention takes the residual stream as its one gathered input). Anything
else is refused with the reason, and the search keeps the data-parallel plans.
"""

from __future__ import annotations

import copy

import torch.nn as nn

from autoplan.models.structure import expert_stacks, largest_module_list
from autoplan.models.tp_experts import TpRefusal, LayoutParts, moe_layout
from cost_models.tensor_parallel import TpLayout, TpRole

__all__ = ["ATTENTION", "MLP", "SHAPES", "TpRefusal", "block_shape", "check_with_experts", "local_heads", "recognise"]

ATTENTION = ("attn", ("wq", "wk", "wv"), "wo")  # child, column-wise projections, row-wise projection
MLP = ("mlp", ("w1", "w3"), "w2")
# the block shapes recognised: name -> (attention, MLP) as (child, column-wise projections, row-wise projection)
SHAPES = {
    "zoo": (ATTENTION, MLP),
    "hugging face llama": (("self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"),
                           ("mlp", ("gate_proj", "up_proj"), "down_proj")),
    "gpt-neox": (("attention", ("query_key_value",), "dense"), ("mlp", ("dense_h_to_4h",), "dense_4h_to_h")),
    "falcon": (("self_attention", ("query_key_value",), "dense"), ("mlp", ("dense_h_to_4h",), "dense_4h_to_h")),
    "phi-3": (("self_attn", ("qkv_proj",), "o_proj"), ("mlp", ("gate_up_proj",), "down_proj")),
}
# the attention's head counts a rank's share is set by (autoplan.run.tp): attributes of the attention module
_HEAD_ATTRIBUTES = {"zoo": ("n_heads", "n_kv_heads"), "falcon": ("num_heads", "num_kv_heads"),
                    "phi-3": ("num_key_value_heads",)}
_FUSED = ("qkv_proj", "query_key_value", "c_attn", "Wqkv")
_NORMS = (nn.LayerNorm, nn.RMSNorm)


def _is_norm(module: nn.Module) -> bool:
    """A norm: torch's, or a model's own (LlamaRMSNorm): no children, parameters of one dimension."""
    return isinstance(module, _NORMS) or (next(module.children(), None) is None and "Norm" in type(module).__name__
                                          and all(p.dim() == 1 for p in module.parameters()))


def block_shape(block: nn.Module) -> str | None:
    """Which of SHAPES the block has (by its attention), if any."""
    for name, (attention, _mlp) in SHAPES.items():
        attn = getattr(block, attention[0], None)
        names = (*attention[1], attention[2])
        if attn is not None and all(isinstance(getattr(attn, n, None), nn.Linear) for n in names):
            return name
    return None


def _heads(block: nn.Module, shape: str) -> tuple[object, object]:
    attn = getattr(block, SHAPES[shape][0][0])
    if shape in ("zoo", "falcon"):
        return tuple(getattr(attn, name, None) for name in _HEAD_ATTRIBUTES[shape])
    config = getattr(attn, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    return heads, getattr(config, "num_key_value_heads", None) or heads


def _linear(module: nn.Module, name: str, where: str) -> nn.Linear:
    child = getattr(module, name, None)
    if not isinstance(child, nn.Linear):
        raise TpRefusal(f"{where}.{name} is not an nn.Linear")
    return child


def _unrecognised(block: nn.Module, path: str) -> TpRefusal:
    fused = [child for _, module in block.named_children() for child in _FUSED
             if isinstance(getattr(module, child, None), nn.Linear)]
    if fused:
        return TpRefusal(f"block {path}: its attention projects q, k and v with one fused matrix ({fused[0]}), which a "
                         "column split would cut across q, k and v")
    return TpRefusal(f"block {path}: not a recognised block (tensor parallelism needs the zoo's Llama layout, Hugging "
                     "Face's Llama family's q/k/v/o_proj and gate/up/down_proj, Phi-3's, GPT-NeoX's or Falcon's)")


def _sections(block: nn.Module, shape: str, child_name: str, name: str, linear: nn.Linear) -> tuple[int, ...]:
    """The sections a fused projection concatenates (Phi-3's q/k/v and gate/up), else one."""
    if shape != "phi-3":
        return (linear.out_features,)
    if name == "gate_up_proj":
        return (linear.out_features // 2,) * 2
    attn = getattr(block, child_name)
    heads, kv_heads = _heads(block, shape)
    return (heads * attn.head_dim, kv_heads * attn.head_dim, kv_heads * attn.head_dim)


def _region(block: nn.Module, path: str, shape: str, spec: tuple, t: int, parts: LayoutParts) -> None:
    """One attention or dense MLP: its column-wise projections (split section by section where fused), its
    row-wise projection, and the ops between them sharded."""
    child_name, columns, row = spec
    child = getattr(block, child_name, None)
    where = f"{path}.{child_name}"
    if child is None:
        raise TpRefusal(f"block {path} has no {child_name}")
    parts.roles[where] = TpRole.SHARDED
    parts.regions.append(where)
    for name in columns:
        linear = _linear(child, name, where)
        sections = _sections(block, shape, child_name, name, linear)
        if sum(sections) != linear.out_features or any(s % t for s in sections):
            raise TpRefusal(f"{where}.{name} has {linear.out_features} output features, which do not divide "
                            f"by the tensor-parallel degree {t}")
        parts.roles[f"{where}.{name}"] = TpRole.COLWISE
        for param in ("weight", "bias") if linear.bias is not None else ("weight",):
            parts.split[f"{where}.{name}.{param}"] = 0
            if len(sections) > 1:
                parts.fused[f"{where}.{name}.{param}"] = sections
    _linear(child, row, where)
    parts.roles[f"{where}.{row}"] = TpRole.ROWWISE
    parts.split[f"{where}.{row}.weight"] = 1
    extra = [n for n, m in child.named_children() if n not in (*columns, row) and any(True for _ in m.parameters())
             and not (_is_norm(m) and child_name == SHAPES[shape][0][0])]  # per-head norms stay whole
    if extra:
        raise TpRefusal(f"{where} has modules the layout does not place: {', '.join(extra)}")


def _checked_heads(block: nn.Module, path: str, shape: str, t: int) -> None:
    heads, kv_heads = _heads(block, shape)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise TpRefusal(f"block {path}: its attention has no integer head counts")
    if heads % t:
        raise TpRefusal(f"{heads} attention heads do not divide by the tensor-parallel degree {t}")
    if kv_heads % t:
        raise TpRefusal(f"{kv_heads} key/value heads (grouped- or multi-query attention) do not divide by the "
                        f"tensor-parallel degree {t}")
    attn = getattr(block, SHAPES[shape][0][0])
    if shape == "falcon" and getattr(getattr(attn, "config", None), "alibi", False):
        raise TpRefusal(f"block {path}: Falcon's ALiBi biases are built for every head outside the attention, "
                        "which tensor parallelism would have to split")


def _block(block: nn.Module, path: str, t: int, sp: bool) -> LayoutParts:
    """Roles and split parameters of one block; TpRefusal when it is not a recognised shape or t does not divide."""
    shape = block_shape(block)
    if shape is None:
        raise _unrecognised(block, path)
    stacks = expert_stacks(block)
    if sp and (shape != "zoo" or stacks):
        kind = "a mixture of experts" if stacks else f"{shape} blocks, which take keyword inputs"
        raise TpRefusal(f"block {path}: sequence parallelism needs the zoo's dense block, whose attention takes the "
                        f"residual stream as its one gathered input ({kind})")
    _checked_heads(block, path, shape, t)
    parts = LayoutParts()
    parts.roles[path] = TpRole.SEQUENCE
    attention, mlp = SHAPES[shape]
    _region(block, path, shape, attention, t, parts)
    placed = [attention[0]]
    if stacks:
        placed.append(stacks[0].split(".")[0])
        moe = moe_layout(getattr(block, placed[1]), f"{path}.{placed[1]}", t)
        for name in ("roles", "split", "widths", "fused"):
            getattr(parts, name).update(getattr(moe, name))
        parts.regions += moe.regions
    else:
        _region(block, path, shape, mlp, t, parts)
        placed.append(mlp[0])
    for name, child in block.named_children():
        if name in placed or not any(True for _ in child.parameters()):
            continue
        if not _is_norm(child):
            raise TpRefusal(f"block {path} has a module the layout does not place: {name} ({type(child).__name__})")
        parts.roles[f"{path}.{name}"] = TpRole.SEQUENCE
    return parts


def check_with_experts(layout: TpLayout | None, ep: int) -> None:
    """TpRefusal where a layout that splits experts by width meets expert parallelism (experts placed on ranks,
    Mesh.ep): the two would split the same stacked weights both ways, which neither the cost nor apply builds."""
    if layout is not None and layout.expert_widths and ep > 1:
        raise TpRefusal(f"tensor parallelism splits the experts by width, and expert parallelism ({ep}-way) by "
                        "expert: both at once is not built (search one of them)")


def local_heads(model: nn.Module, layout: TpLayout) -> None:
    """Set each block's attention to the heads one rank holds, where its code reads head counts (the zoo's, Falcon's,
    Phi-3's q/k/v boundaries); the other Hugging Face attentions infer them from their projections' widths. Phi-3
    reads the q section's width from its config, so its attention gets a copy of the config of its own."""
    t = layout.degree
    blocks_path = largest_module_list(model)
    for block in model.get_submodule(blocks_path) if blocks_path is not None and t > 1 else ():
        shape = block_shape(block)
        attn = getattr(block, SHAPES[shape][0][0], None) if shape is not None else None
        for name in _HEAD_ATTRIBUTES.get(shape, ()):
            setattr(attn, name, getattr(attn, name) // t)
        if shape == "phi-3":
            attn.config = copy.copy(attn.config)
            attn.config.num_attention_heads //= t
            attn.config.num_key_value_heads //= t


def _around(model: nn.Module, blocks_path: str) -> list[tuple[str, nn.Module]]:
    """The modules with parameters beside the path from the root to the blocks (Hugging Face's `model.norm`
    and `lm_head` around `model.layers`)."""
    parts, found = blocks_path.split("."), []
    for depth in range(len(parts)):
        ancestor = ".".join(parts[:depth])
        for name, child in model.get_submodule(ancestor).named_children():
            if name != parts[depth] and any(True for _ in child.parameters()):
                found.append((f"{ancestor}.{name}" if ancestor else name, child))
    return found


def recognise(model: nn.Module, degree: int, sequence_parallel: bool) -> TpLayout:
    """The layout of `model` at `degree`; TpRefusal (saying why) where the model or the degree cannot take it."""
    blocks_path = largest_module_list(model)
    if blocks_path is None:
        raise TpRefusal("the model has no repeated blocks (an nn.ModuleList of two or more) to split")
    parts = LayoutParts()
    for index, block in enumerate(model.get_submodule(blocks_path)):
        block_parts = _block(block, f"{blocks_path}.{index}", degree, sequence_parallel)
        for name in ("roles", "split", "widths", "fused"):
            getattr(parts, name).update(getattr(block_parts, name))
        parts.regions += block_parts.regions
    roles, split, regions = parts.roles, parts.split, parts.regions
    others = _around(model, blocks_path)
    embeddings = [name for name, child in others if isinstance(child, nn.Embedding)]
    norms = [name for name, child in others if _is_norm(child)]
    heads = [name for name, child in others if isinstance(child, nn.Linear)]
    if len(embeddings) != 1 or len(norms) != 1 or len(heads) != 1 or len(others) != 3:
        raise TpRefusal("around the blocks the layout needs exactly one embedding, one final norm and one head "
                        f"(the model has: {', '.join(f'{n} ({type(c).__name__})' for n, c in others)})")
    embedding, norm, head = (model.get_submodule(n) for n in (embeddings[0], norms[0], heads[0]))
    hidden = embedding.embedding_dim
    roles[norms[0]] = TpRole.SEQUENCE
    notes = []
    vocab = embedding.num_embeddings
    tied = head.weight is embedding.weight
    vocab_parallel = not tied and vocab % degree == 0 and head.out_features == vocab
    if vocab_parallel:
        roles[embeddings[0]] = TpRole.VOCAB_EMBED
        roles[heads[0]] = TpRole.COLWISE
        split[f"{embeddings[0]}.weight"] = 0
        split[f"{heads[0]}.weight"] = 0
        if head.bias is not None:
            split[f"{heads[0]}.bias"] = 0
    else:
        why = ("tied to each other" if tied else f"a vocabulary of {vocab} does not divide by {degree}")
        if sequence_parallel:
            raise TpRefusal(f"sequence parallelism starts from a vocabulary-parallel embedding, and {embeddings[0]} "
                            f"and {heads[0]} cannot be split ({why})")
        notes.append(f"{embeddings[0]} and {heads[0]} stay replicated across the tensor-parallel group ({why})")
    return TpLayout(degree=degree, sequence_parallel=sequence_parallel, hidden=hidden, roles=roles,
                    regions=tuple(regions), split_params=split,
                    embedding=embeddings[0] if vocab_parallel else None,
                    head=heads[0] if vocab_parallel else None, notes=tuple(notes), expert_widths=parts.widths,
                    fused=parts.fused)
