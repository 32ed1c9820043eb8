"""Llama: `tok_embeddings`, `layers`, `norm`, `lm_head`; block = `attn_norm, attn, mlp_norm, mlp` (pre-RMSNorm, RoPE, SwiGLU, GQA).

It saves for backward what Hugging Face's LlamaForCausalLM saves (tests/test_models.py compares the two
traces), since published runs use that implementation (and torchtitan's):
- RMSNorm as LlamaRMSNorm computes it: the input upcast to fp32, normalised, cast back, then scaled; it
  saves 6 bytes an element (the fp32 copy and the bf16 normalised output). torch's nn.RMSNorm runs a
  composite on the CPU (and on the meta device the planner traces on) that saves 8, and may run a fused
  kernel on CUDA that saves less: the same model would then save different bytes per device.
- RoPE as Hugging Face applies it: cos/sin computed per forward in fp32 from `inv_freq` (the only
  buffer) and cast to the compute dtype, q and k rotated in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.models.common import init_parameters, merge_heads, split_heads
from autoplan.models.config import FAMILY_FOLLOWS, ModelConfig

__all__ = ["Llama", "RMSNorm", "RopeTransformer", "rope_tables", "rope_tables_at"]


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm's parameters and repr, Hugging Face LlamaRMSNorm's arithmetic (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(x.dtype)


def _inv_freq(config: ModelConfig, device: torch.device | None) -> torch.Tensor:
    head_dim = config.head_dim
    return 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def rope_tables(inv_freq: torch.Tensor, seq_len, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [seq_len, head_dim] in the half-split layout, computed in fp32, returned in `dtype`."""
    return rope_tables_at(inv_freq, torch.arange(seq_len, device=inv_freq.device, dtype=torch.float32), dtype)


def rope_tables_at(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos/sin at `positions` (the rows of a context-parallel rank's shard of the sequence: autoplan.run.context)."""
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, S, D]; rotate the pairs (x[i], x[i + D/2]), in x's dtype as Hugging Face does.
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.wq = nn.Linear(config.d_model, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.d_model, config.kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.d_model, config.kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = _apply_rope(split_heads(self.wq(x), self.n_heads), cos, sin)
        k = _apply_rope(split_heads(self.wk(x), self.n_kv_heads), cos, sin)
        v = split_heads(self.wv(x), self.n_kv_heads)
        # GQA: k/v heads unrepeated, as Hugging Face's Llama passes them to SDPA without a mask; the kernel
        # takes them so (flash), or autoplan's attention path repeats them for one that does not (efficient)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(merge_heads(y))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or config.ffn_dim
        self.w1 = nn.Linear(config.d_model, hidden, bias=False)  # gate
        self.w2 = nn.Linear(hidden, config.d_model, bias=False)  # down
        self.w3 = nn.Linear(config.d_model, hidden, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PreNormBlock(nn.Module):
    """A Llama-style block: attention, then an MLP (`mlp`: SwiGLU, or a mixture of experts), each after an
    RMSNorm and added to the residual stream."""

    def __init__(self, config: ModelConfig, mlp: nn.Module):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = LlamaAttention(config)
        self.mlp_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LlamaBlock(PreNormBlock):
    def __init__(self, config: ModelConfig):
        super().__init__(config, LlamaMLP(config))


class RopeTransformer(nn.Module):
    """Llama's embedding, rotary tables, norms and head around a stack of `block(config)` blocks."""

    block_list_path = "layers"

    def __init__(self, config: ModelConfig, block):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Non-persistent buffer: not a parameter, not in the state dict (as Hugging Face's inv_freq).
        self.register_buffer("inv_freq", _inv_freq(config, device=None), persistent=False)
        self._tie_weights()

    def _tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight

    def init_weights(self) -> None:
        self._tie_weights()
        init_parameters(self, self.config.init_std)
        with torch.no_grad():
            self.inv_freq.copy_(_inv_freq(self.config, device=self.inv_freq.device))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # the compute dtype from the root's own norm (gathered in it under FSDP2 mixed precision): reading
        # x.dtype would make torch.fx record the rotary tables as reading the embedding's output
        cos, sin = rope_tables(self.inv_freq, input_ids.size(1), self.norm.weight.dtype)
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


class Llama(RopeTransformer):
    """Llama 2/3: RMSNorm, RoPE, SwiGLU, no biases, GQA, untied head by default."""

    follows = FAMILY_FOLLOWS["llama"]  # what it saves for backward, said by `autoplan models`

    def __init__(self, config: ModelConfig):
        super().__init__(config, LlamaBlock)
