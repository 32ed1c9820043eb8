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
  `dense_h_to_4h` and `dense_4h_to_h`;
with norms around them (and per-head norms inside the attention, as Qwen3's, which stay whole). Fused
projections that put all of q before k and v (Phi-3's qkv_proj, gate_up_proj; Falcon's) are refused:
a split by output features would cut across them. The model around the blocks must be an embedding,
the blocks, a final norm and a head (modules without parameters, such as a rotary embedding, aside);
the embedding and the head are split by vocabulary rows where the vocabulary divides and they are not
tied (else they stay replicated, which sequence parallelism cannot start from). Sequence parallelism
needs the zoo's block (whose attention takes the residual stream as its one gathered input). Anything
else is refused with the reason, and the search keeps the data-parallel plans.
"""

from __future__ import annotations

import torch.nn as nn

from autoplan.models.structure import expert_stacks, largest_module_list
from cost_models.tensor_parallel import TpLayout, TpRole

__all__ = ["ATTENTION", "MLP", "SHAPES", "TpRefusal", "recognise"]

ATTENTION = ("attn", ("wq", "wk", "wv"), "wo")  # child, column-wise projections, row-wise projection
MLP = ("mlp", ("w1", "w3"), "w2")
# the block shapes recognised: name -> (attention, MLP) as (child, column-wise projections, row-wise projection)
SHAPES = {
    "zoo": (ATTENTION, MLP),
    "hugging face llama": (("self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"),
                           ("mlp", ("gate_proj", "up_proj"), "down_proj")),
    "gpt-neox": (("attention", ("query_key_value",), "dense"), ("mlp", ("dense_h_to_4h",), "dense_4h_to_h")),
}
_FUSED = ("qkv_proj", "query_key_value", "c_attn", "Wqkv")
_NORMS = (nn.LayerNorm, nn.RMSNorm)


def _is_norm(module: nn.Module) -> bool:
    """A norm: torch's, or a model's own (LlamaRMSNorm): no children, parameters of one dimension."""
    return isinstance(module, _NORMS) or (next(module.children(), None) is None and "Norm" in type(module).__name__
                                          and all(p.dim() == 1 for p in module.parameters()))


def _shape_of(block: nn.Module) -> str | None:
    for name, (attention, _mlp) in SHAPES.items():
        attn = getattr(block, attention[0], None)
        if attn is not None and all(isinstance(getattr(attn, n, None), nn.Linear) for n in (*attention[1], attention[2])):
            return name
    return None


def _heads(block: nn.Module, shape: str) -> tuple[object, object]:
    attn = getattr(block, SHAPES[shape][0][0])
    if shape == "zoo":
        return getattr(attn, "n_heads", None), getattr(attn, "n_kv_heads", None)
    config = getattr(attn, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    return heads, getattr(config, "num_key_value_heads", None) or heads


class TpRefusal(ValueError):
    """The model (or this degree) cannot take the layout; the message says why."""


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
                     "Face's Llama family's q/k/v/o_proj and gate/up/down_proj, or GPT-NeoX's)")


def _block(block: nn.Module, path: str, t: int, sp: bool) -> tuple[dict[str, TpRole], dict[str, int], list[str]]:
    """Roles and split parameters of one block; TpRefusal when it is not a recognised shape or t does not divide."""
    shape = _shape_of(block)
    if expert_stacks(block):
        raise TpRefusal(f"block {path}: its MLP is a mixture of experts; tensor parallelism splits dense MLPs only "
                        "(experts split by expert or by width are not done yet)")
    if shape is None:
        raise _unrecognised(block, path)
    if sp and shape != "zoo":
        raise TpRefusal(f"block {path}: sequence parallelism needs the zoo's block, whose attention takes the "
                        f"residual stream as its one gathered input ({shape} blocks take keyword inputs)")
    heads, kv_heads = _heads(block, shape)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise TpRefusal(f"block {path}: its attention has no integer head counts")
    if heads % t:
        raise TpRefusal(f"{heads} attention heads do not divide by the tensor-parallel degree {t}")
    if kv_heads % t:
        raise TpRefusal(f"{kv_heads} key/value heads (grouped-query attention) do not divide by the "
                        f"tensor-parallel degree {t}")
    roles: dict[str, TpRole] = {path: TpRole.SEQUENCE}
    split: dict[str, int] = {}
    regions = []
    for child_name, columns, row in SHAPES[shape]:
        child = getattr(block, child_name, None)
        where = f"{path}.{child_name}"
        if child is None:
            raise TpRefusal(f"block {path} has no {child_name}")
        roles[where] = TpRole.SHARDED
        regions.append(where)
        for name in columns:
            linear = _linear(child, name, where)
            if linear.out_features % t:
                raise TpRefusal(f"{where}.{name} has {linear.out_features} output features, which do not divide "
                                f"by the tensor-parallel degree {t}")
            roles[f"{where}.{name}"] = TpRole.COLWISE
            split[f"{where}.{name}.weight"] = 0
            if linear.bias is not None:
                split[f"{where}.{name}.bias"] = 0
        linear = _linear(child, row, where)
        roles[f"{where}.{row}"] = TpRole.ROWWISE
        split[f"{where}.{row}.weight"] = 1
        extra = [n for n, m in child.named_children() if n not in (*columns, row) and any(True for _ in m.parameters())
                 and not (_is_norm(m) and child_name == SHAPES[shape][0][0])]  # per-head norms stay whole
        if extra:
            raise TpRefusal(f"{where} has modules the layout does not place: {', '.join(extra)}")
    for name, child in block.named_children():
        if name in (SHAPES[shape][0][0], SHAPES[shape][1][0]) or not any(True for _ in child.parameters()):
            continue
        if not _is_norm(child):
            raise TpRefusal(f"block {path} has a module the layout does not place: {name} ({type(child).__name__})")
        roles[f"{path}.{name}"] = TpRole.SEQUENCE
    return roles, split, regions


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
    roles: dict[str, TpRole] = {}
    split: dict[str, int] = {}
    regions: list[str] = []
    for index, block in enumerate(model.get_submodule(blocks_path)):
        block_roles, block_split, block_regions = _block(block, f"{blocks_path}.{index}", degree, sequence_parallel)
        roles.update(block_roles)
        split.update(block_split)
        regions += block_regions
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
                    head=heads[0] if vocab_parallel else None, notes=tuple(notes))
