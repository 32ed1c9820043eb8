"""Model zoo: plain single-device transformer LMs plus the preset table.

The models hold no parallelism; the planner traces them with
``torch.fx.symbolic_trace`` and wraps their blocks with FSDP2 ``fully_shard``.
They are built on the meta device by default, so even 405B-parameter presets
cost no memory until ``model.to_empty(device=...); model.init_weights()``.

Layout per family (the repeated blocks are always an ``nn.ModuleList`` whose
entries have ``attn`` and ``mlp`` children):

- gpt2:  ``transformer.{wte,wpe,h,ln_f}``, ``lm_head`` (tied to ``wte``);
         block = ``ln_1, attn, ln_2, mlp`` (pre-LN).
- llama: ``tok_embeddings``, ``layers``, ``norm``, ``lm_head``;
         block = ``attn_norm, attn, mlp_norm, mlp`` (pre-RMSNorm, RoPE, SwiGLU).
- bert:  ``embeddings.{word_embeddings,position_embeddings,token_type_embeddings,norm}``,
         ``encoder.layer``, ``mlm_head.{dense,norm,decoder}`` (decoder tied to
         ``word_embeddings``); block = ``attn, attn_norm, mlp, mlp_norm`` (post-LN).

Each model class names its block list in ``block_list_path``.
"""

from __future__ import annotations

import torch
from torch import nn

from autoplan.models.bert import BertForMaskedLM
from autoplan.models.common import buffers_to_meta, meta_init
from autoplan.models.config import ALIASES, PRESETS, ModelConfig, UnknownModelError, get_config, model_names
from autoplan.models.gpt2 import GPT2
from autoplan.models.llama import Llama
from autoplan.models.moe import MoETransformer

__all__ = [
    "ALIASES", "PRESETS", "BertForMaskedLM", "GPT2", "Llama", "MoETransformer", "ModelConfig", "UnknownModelError",
    "build_model",
    "count_params", "get_config", "model_names",
]

# The one place that maps a family to its model class.
FAMILY_CLASSES: dict[str, type[nn.Module]] = {
    "gpt2": GPT2,
    "llama": Llama,
    "bert": BertForMaskedLM,
    "moe": MoETransformer,
}


def build_model(config_or_name: ModelConfig | str, device: str | torch.device = "meta") -> nn.Module:
    """Build a model under ``torch.device(device)``.

    On the meta device the model has shapes only; materialise it with
    ``model.to_empty(device=...); model.init_weights()``. On a real device the
    weights are initialised by ``init_weights()`` right away.
    """
    config = get_config(config_or_name) if isinstance(config_or_name, str) else config_or_name
    if not isinstance(config, ModelConfig):
        raise TypeError(f"expected a ModelConfig or a model name, got {type(config_or_name).__name__}")
    device = torch.device(device)
    if device.type == "meta":  # shapes only: nothing initialised, nothing of torch's compiler imported
        with torch.device(device), meta_init():
            model = FAMILY_CLASSES[config.family](config)
        buffers_to_meta(model)
    else:
        with torch.device(device):
            model = FAMILY_CLASSES[config.family](config)
    if device.type != "meta":
        model.init_weights()
    return model



def count_params(model: nn.Module) -> int:
    """Number of unique parameters; a tied weight is counted once."""
    return sum(p.numel() for p in model.parameters())
