"""Llama: `tok_embeddings`, `layers`, `norm`, `lm_head`; block = `attn_norm, attn, mlp_norm, mlp` (pre-RMSNorm, RoPE, SwiGLU, GQA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.models.common import init_parameters, merge_heads, split_heads
from autoplan.models.config import ModelConfig

__all__ = ["Llama"]


def _rope_tables(config: ModelConfig, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [max_seq_len, head_dim] in the half-split layout."""
    head_dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    positions = torch.arange(config.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, S, D]; rotate the pairs (x[i], x[i + D/2]).
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


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
        # GQA: repeat k/v heads explicitly (as torchtitan does) so every SDPA
        # backend and any cost model sees plain multi-head attention.
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(merge_heads(y))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.ffn_dim, bias=False)  # gate
        self.w2 = nn.Linear(config.ffn_dim, config.d_model, bias=False)  # down
        self.w3 = nn.Linear(config.d_model, config.ffn_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = LlamaAttention(config)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama 2/3: RMSNorm, RoPE, SwiGLU, no biases, GQA, untied head by default."""

    block_list_path = "layers"

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Non-persistent buffers: not parameters, not in the state dict.
        cos, sin = _rope_tables(config, device=None)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._tie_weights()

    def _tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight

    def init_weights(self) -> None:
        self._tie_weights()
        init_parameters(self, self.config.init_std)
        with torch.no_grad():
            cos, sin = _rope_tables(self.config, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.size(1)
        # narrow() rather than [:seq_len]: fx cannot slice a real tensor with a proxy.
        cos = self.rope_cos.narrow(0, 0, seq_len)
        sin = self.rope_sin.narrow(0, 0, seq_len)
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

