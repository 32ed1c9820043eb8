"""GPT-2: `transformer.{wte,wpe,h,ln_f}`, `lm_head` (tied to `wte`); block = `ln_1, attn, ln_2, mlp` (pre-LN)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.models.common import init_parameters, merge_heads, split_heads
from autoplan.models.config import FAMILY_FOLLOWS, ModelConfig

__all__ = ["GPT2"]


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.d_model = config.d_model
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model)
        self.c_proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.d_model, dim=-1)
        q, k, v = (split_heads(t, self.n_heads) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(merge_heads(y))


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.d_model, config.ffn_dim)
        self.c_proj = nn.Linear(config.ffn_dim, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 uses the tanh approximation of GELU ("gelu_new").
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2: learned positions, pre-LN, GELU MLP, biases, tied LM head."""

    block_list_path = "transformer.h"
    follows = FAMILY_FOLLOWS["gpt2"]  # what it saves for backward, said by `autoplan models`

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.d_model),
                "wpe": nn.Embedding(config.max_seq_len, config.d_model),
                "h": nn.ModuleList(GPT2Block(config) for _ in range(config.n_layers)),
                "ln_f": nn.LayerNorm(config.d_model, eps=config.norm_eps),
            }
        )
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._tie_weights()

    def _tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def init_weights(self) -> None:
        # to_empty() gives each module its own tensor, so restore tying first.
        self._tie_weights()
        init_parameters(self, self.config.init_std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

