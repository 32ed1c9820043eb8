"""Which modules of a model tensor parallelism can split, and how: the Megatron layout, found from the modules.

The search costs a layout (cost_models.tensor_parallel) and `apply` runs it (autoplan.run.tp); both
read it from here, so what is costed is what runs. Which module of a model plays which role is knowledge
about models, so it lives with them. A block is recognised when it has the zoo Llama's
shape: an attention module `attn` with projections `wq`, `wk`, `wv`, `wo` and head counts `n_heads`,
`n_kv_heads`, an MLP `mlp` with `w1` (gate), `w3` (up), `w2` (down), and norms around them. The model
around the blocks must be an embedding, the blocks, a final norm and a head; the embedding and the
head are split by vocabulary rows where the vocabulary divides and they are not tied (else they stay
replicated, which sequence parallelism cannot start from). Anything else is refused with the reason,
and the search keeps the data-parallel plans.
"""

from __future__ import annotations

import torch.nn as nn

from autoplan.models.structure import largest_module_list
from cost_models.tensor_parallel import TpLayout, TpRole

__all__ = ["ATTENTION", "MLP", "TpRefusal", "recognise"]

ATTENTION = ("attn", ("wq", "wk", "wv"), "wo")  # child, column-wise projections, row-wise projection
MLP = ("mlp", ("w1", "w3"), "w2")
_NORMS = (nn.LayerNorm, nn.RMSNorm)


class TpRefusal(ValueError):
    """The model (or this degree) cannot take the layout; the message says why."""


def _linear(module: nn.Module, name: str, where: str) -> nn.Linear:
    child = getattr(module, name, None)
    if not isinstance(child, nn.Linear):
        raise TpRefusal(f"{where}.{name} is not an nn.Linear")
    return child


def _block(block: nn.Module, path: str, t: int) -> tuple[dict[str, TpRole], dict[str, int], list[str]]:
    """Roles and split parameters of one block; TpRefusal when it is not the recognised shape or t does not divide."""
    attn = getattr(block, ATTENTION[0], None)
    if attn is None or not isinstance(getattr(attn, ATTENTION[2], None), nn.Linear):
        fused = attn is not None and isinstance(getattr(attn, "c_attn", None), nn.Linear)
        raise TpRefusal(
            f"block {path}: " + ("its attention projects q, k and v with one fused matrix (c_attn), which a "
                                 "column split would cut across q, k and v" if fused else
                                 "not a recognised block (tensor parallelism needs attn.{wq,wk,wv,wo} and "
                                 "mlp.{w1,w2,w3}, the zoo's Llama layout)"))
    heads, kv_heads = getattr(attn, "n_heads", None), getattr(attn, "n_kv_heads", None)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise TpRefusal(f"block {path}: its attention has no integer n_heads and n_kv_heads")
    if heads % t:
        raise TpRefusal(f"{heads} attention heads do not divide by the tensor-parallel degree {t}")
    if kv_heads % t:
        raise TpRefusal(f"{kv_heads} key/value heads (grouped-query attention) do not divide by the "
                        f"tensor-parallel degree {t}")
    roles: dict[str, TpRole] = {path: TpRole.SEQUENCE}
    split: dict[str, int] = {}
    regions = []
    for child_name, columns, row in (ATTENTION, MLP):
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
        extra = [n for n, m in child.named_children() if n not in (*columns, row)]
        if extra:
            raise TpRefusal(f"{where} has modules the layout does not place: {', '.join(extra)}")
    for name, child in block.named_children():
        if name in (ATTENTION[0], MLP[0]):
            continue
        if not isinstance(child, _NORMS):
            raise TpRefusal(f"block {path} has a module the layout does not place: {name} ({type(child).__name__})")
        roles[f"{path}.{name}"] = TpRole.SEQUENCE
    return roles, split, regions


def recognise(model: nn.Module, degree: int, sequence_parallel: bool) -> TpLayout:
    """The layout of `model` at `degree`; TpRefusal (saying why) where the model or the degree cannot take it."""
    blocks_path = largest_module_list(model)
    if blocks_path is None:
        raise TpRefusal("the model has no repeated blocks (an nn.ModuleList of two or more) to split")
    roles: dict[str, TpRole] = {}
    split: dict[str, int] = {}
    regions: list[str] = []
    for index, block in enumerate(model.get_submodule(blocks_path)):
        block_roles, block_split, block_regions = _block(block, f"{blocks_path}.{index}", degree)
        roles.update(block_roles)
        split.update(block_split)
        regions += block_regions
    if "." in blocks_path:
        raise TpRefusal(f"the blocks ({blocks_path}) are not a child of the model's root")
    others = [(name, child) for name, child in model.named_children() if name != blocks_path]
    embeddings = [name for name, child in others if isinstance(child, nn.Embedding)]
    norms = [name for name, child in others if isinstance(child, _NORMS)]
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
