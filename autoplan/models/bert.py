"""BERT (masked LM): `embeddings.{word_embeddings,position_embeddings,token_type_embeddings,norm}`, `encoder.layer`,
`mlm_head.{dense,norm,decoder}` (decoder tied to `word_embeddings`); block = `attn, attn_norm, mlp, mlp_norm` (post-LN)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.models.common import init_parameters, merge_heads, split_heads
from autoplan.models.config import FAMILY_FOLLOWS, ModelConfig

__all__ = ["BertForMaskedLM"]


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embeddings = nn.Embedding(config.max_seq_len, config.d_model)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.d_model)
        self.norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        # Single-segment input: every token has token type 0.
        token_types = torch.zeros_like(input_ids)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_types)
        )
        return self.norm(x)


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.d_model = config.d_model
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.d_model, dim=-1)
        q, k, v = (split_heads(t, self.n_heads) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)  # bidirectional, no padding mask
        return self.proj(merge_heads(y))


class BertMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.ffn_dim)
        self.proj = nn.Linear(config.ffn_dim, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn = BertAttention(config)
        self.attn_norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.mlp = BertMLP(config)
        self.mlp_norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Post-LN: normalise after each residual add.
        x = self.attn_norm(x + self.attn(x))
        return self.mlp_norm(x + self.mlp(x))


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class BertMLMHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.decoder = nn.Linear(config.d_model, config.vocab_size)  # weight tied, own bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(x))))


class BertForMaskedLM(nn.Module):
    """BERT encoder with the masked-LM head (no pooler), as HF BertForMaskedLM.

    bert-large matches HF ``BertForMaskedLM`` for bert-large-uncased:
    335,174,458 parameters = embeddings 31,782,912
    + 24 layers x 12,596,224 + MLM head 1,082,170 (dense + LN + decoder bias).
    """

    block_list_path = "encoder.layer"
    follows = FAMILY_FOLLOWS["bert"]  # what it saves for backward, said by `autoplan models`

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.mlm_head = BertMLMHead(config)
        self._tie_weights()

    def _tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.mlm_head.decoder.weight = self.embeddings.word_embeddings.weight

    def init_weights(self) -> None:
        self._tie_weights()
        init_parameters(self, self.config.init_std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.mlm_head(self.encoder(self.embeddings(input_ids)))

