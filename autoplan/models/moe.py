"""Mixture-of-experts transformers: the zoo's Llama with each block's MLP a routed set of experts.

Two shapes from one module, by config (autoplan.models.config, family "moe"):
- Mixtral-style: a few wide experts, each token sent to `top_k` of them (8 experts, top-2), the chosen
  weights renormalised to sum to one;
- fine-grained (DeepSeek-MoE / Qwen3-MoE style): many narrow experts (64, top-6), plus `n_shared_experts`
  that every token passes through (one SwiGLU MLP of their total width), weights not renormalised.

The experts run as transformers' grouped_mm path runs them: the (token, expert) pairs sorted by expert,
the tokens gathered into one [tokens x top_k, d] buffer (the dispatch buffer), one grouped matmul per
projection over all experts (torch._grouped_mm, groups by offsets), the outputs weighted and added back
per token (the combine). All shapes are fixed by tokens x top_k, whatever the routing, so the model traces
on meta tensors; the expert matmuls' FLOPs are counted for the tokens routed (autoplan.tracing.flops).
The experts' weights are stacked [experts, ...] in one module (`experts`), which autoplan makes an FSDP
unit of its own (autoplan.models.structure.expert_stacks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.models.config import ModelConfig
from autoplan.models.llama import LlamaMLP, PreNormBlock, RopeTransformer

__all__ = ["MoETransformer"]


class Router(nn.Module):
    """Scores every expert per token; picks the top_k (softmax in fp32, as Mixtral's and DeepSeek's)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k, self.normalise = config.top_k, config.norm_topk
        self.gate = nn.Linear(config.d_model, config.n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


class Experts(nn.Module):
    """`n_experts` SwiGLU MLPs with stacked weights: w1 (gate) and w3 (up) [E, ffn, d], w2 (down) [E, d, ffn]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_experts = config.n_experts
        self.w1 = nn.Parameter(torch.empty(config.n_experts, config.expert_ffn, config.d_model))
        self.w3 = nn.Parameter(torch.empty(config.n_experts, config.expert_ffn, config.d_model))
        self.w2 = nn.Parameter(torch.empty(config.n_experts, config.d_model, config.expert_ffn))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        top_k = experts.shape[-1]
        order = torch.argsort(experts.flatten(), stable=True)  # the (token, expert) pairs by expert
        tokens = order // top_k
        routed = x[tokens]  # the dispatch buffer: [tokens x top_k, d]
        counts = torch.histc(experts.flatten().float(), bins=self.n_experts, min=0, max=self.n_experts - 1)
        offsets = torch.cumsum(counts, dim=0).to(torch.int32)
        gate = torch._grouped_mm(routed, self.w1.transpose(-2, -1), offs=offsets)
        up = torch._grouped_mm(routed, self.w3.transpose(-2, -1), offs=offsets)
        out = torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs=offsets)
        out = out * weights.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, tokens, out)  # the combine


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config)
        self.shared = LlamaMLP(config, config.n_shared_experts * config.expert_ffn) if config.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, 1)
        weights, experts = self.router(flat)
        out = self.experts(flat, weights, experts).view_as(x)
        return out + self.shared(x) if self.shared is not None else out


class MoEBlock(PreNormBlock):
    def __init__(self, config: ModelConfig):
        super().__init__(config, MoE(config))


class MoETransformer(RopeTransformer):
    """Llama's embedding, attention, norms and head; every block's MLP a mixture of experts."""

    follows = "routes as transformers' grouped_mm experts do (sorted pairs, one grouped matmul per projection)"

    def __init__(self, config: ModelConfig):
        super().__init__(config, MoEBlock)

    def init_weights(self) -> None:
        super().init_weights()
        with torch.no_grad():  # the experts' stacked weights belong to no Linear: init_parameters leaves them
            for layer in self.layers:
                for weight in (layer.mlp.experts.w1, layer.mlp.experts.w2, layer.mlp.experts.w3):
                    nn.init.normal_(weight, mean=0.0, std=self.config.init_std)
