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

import dataclasses
import importlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ALIASES",
    "PRESETS",
    "BertForMaskedLM",
    "GPT2",
    "Llama",
    "ModelConfig",
    "UnknownModelError",
    "build_model",
    "count_params",
    "get_config",
    "load_factory",
    "model_names",
]

FAMILIES = ("gpt2", "llama", "bert")

# Family defaults, applied by ModelConfig.__post_init__ when a field is None.
_DEFAULT_TIE_EMBEDDINGS = {"gpt2": True, "llama": False, "bert": True}
_DEFAULT_NORM_EPS = {"gpt2": 1e-5, "llama": 1e-5, "bert": 1e-12}


# --------------------------------------------------------------------------- #
# Config
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to rebuild a model exactly.

    ``ModelConfig(**dataclasses.asdict(cfg)) == cfg`` holds, so configs can be
    stored as JSON. ``n_kv_heads`` and ``ffn_hidden`` stay ``None`` when the
    family default applies (so overriding ``d_model`` also moves the MLP size);
    read the effective values from ``kv_heads`` / ``ffn_dim``.
    """

    family: str  # "gpt2" | "llama" | "bert"
    n_layers: int
    n_heads: int
    d_model: int
    vocab_size: int
    max_seq_len: int  # context length; the default sequence length for planning
    n_kv_heads: int | None = None  # llama GQA; None = n_heads
    ffn_hidden: int | None = None  # None = family default, see ffn_dim
    tie_embeddings: bool | None = None  # None = family default (gpt2/bert True, llama False)
    norm_eps: float | None = None  # None = family default (gpt2/llama 1e-5, bert 1e-12)
    rope_theta: float = 10000.0  # llama only
    multiple_of: int = 256  # llama only: ffn_dim rounding, as in Meta's code
    ffn_dim_multiplier: float | None = None  # llama only: ffn_dim scaling, as in Meta's code
    type_vocab_size: int = 2  # bert only: token-type (segment) embeddings
    init_std: float = 0.02  # std of the normal init for linear / embedding weights

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; expected one of {FAMILIES}")
        # Frozen dataclass: resolve defaults through object.__setattr__.
        if self.tie_embeddings is None:
            object.__setattr__(self, "tie_embeddings", _DEFAULT_TIE_EMBEDDINGS[self.family])
        if self.norm_eps is None:
            object.__setattr__(self, "norm_eps", _DEFAULT_NORM_EPS[self.family])
        for field in ("n_layers", "n_heads", "d_model", "vocab_size", "max_seq_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_kv_heads is not None:
            if self.family != "llama" and self.n_kv_heads != self.n_heads:
                raise ValueError(f"n_kv_heads (grouped-query attention) is only supported for llama, not {self.family}")
            if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
                raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        """Effective MLP hidden size."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.family != "llama":
            return 4 * self.d_model
        # Meta's llama FeedForward: 2/3 of 4*d (SwiGLU has three matrices),
        # optionally scaled, then rounded up to a multiple of multiple_of.
        hidden = int(2 * (4 * self.d_model) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return cls(**data)


# --------------------------------------------------------------------------- #
# Shared init helper
# --------------------------------------------------------------------------- #


def _init_parameters(root: nn.Module, std: float) -> None:
    """Normal(0, std) for linear/embedding weights, ones/zeros for norms, zero biases."""
    for module in root.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


def _split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    # [B, S, n_heads * head_dim] -> [B, n_heads, S, head_dim]; unflatten needs no
    # batch/sequence sizes, which keeps fx tracing free of shape proxies.
    return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    # [B, n_heads, S, head_dim] -> [B, S, n_heads * head_dim]
    return x.transpose(1, 2).flatten(2)


# --------------------------------------------------------------------------- #
# GPT-2
# --------------------------------------------------------------------------- #


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.d_model = config.d_model
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model)
        self.c_proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.d_model, dim=-1)
        q, k, v = (_split_heads(t, self.n_heads) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(_merge_heads(y))


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
        _init_parameters(self, self.config.init_std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# --------------------------------------------------------------------------- #
# Llama
# --------------------------------------------------------------------------- #


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
        q = _apply_rope(_split_heads(self.wq(x), self.n_heads), cos, sin)
        k = _apply_rope(_split_heads(self.wk(x), self.n_kv_heads), cos, sin)
        v = _split_heads(self.wv(x), self.n_kv_heads)
        # GQA: repeat k/v heads explicitly (as torchtitan does) so every SDPA
        # backend and any cost model sees plain multi-head attention.
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(_merge_heads(y))


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
        _init_parameters(self, self.config.init_std)
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


# --------------------------------------------------------------------------- #
# BERT (masked LM)
# --------------------------------------------------------------------------- #


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
        q, k, v = (_split_heads(t, self.n_heads) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)  # bidirectional, no padding mask
        return self.proj(_merge_heads(y))


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
        _init_parameters(self, self.config.init_std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.mlm_head(self.encoder(self.embeddings(input_ids)))


# The one place that maps a family to its model class.
_FAMILY_CLASSES: dict[str, type[nn.Module]] = {
    "gpt2": GPT2,
    "llama": Llama,
    "bert": BertForMaskedLM,
}


# --------------------------------------------------------------------------- #
# Presets
# --------------------------------------------------------------------------- #


def _gpt2(n_layers: int, n_heads: int, d_model: int) -> ModelConfig:
    return ModelConfig("gpt2", n_layers, n_heads, d_model, vocab_size=50257, max_seq_len=1024)


PRESETS: dict[str, ModelConfig] = {
    # GPT-2 (OpenAI). gpt2 = 124,439,808 and gpt2-xl = 1,557,611,200 parameters.
    "gpt2": _gpt2(12, 12, 768),
    "gpt2-medium": _gpt2(24, 16, 1024),
    "gpt2-large": _gpt2(36, 20, 1280),
    "gpt2-xl": _gpt2(48, 25, 1600),
    # Llama 2 (Meta), 6,738,415,616 / 13,015,864,320 / 68,976,648,192 parameters.
    "llama2-7b": ModelConfig(
        "llama", 32, 32, 4096, vocab_size=32000, max_seq_len=4096, ffn_hidden=11008
    ),
    "llama2-13b": ModelConfig(
        "llama", 40, 40, 5120, vocab_size=32000, max_seq_len=4096, ffn_hidden=13824
    ),
    "llama2-70b": ModelConfig(
        "llama", 80, 64, 8192, vocab_size=32000, max_seq_len=4096, n_kv_heads=8, ffn_hidden=28672
    ),
    # Llama 3 (Meta). Context 8192 (the Llama 3 pre-training length); the
    # long-context RoPE scaling of 3.1/3.2 changes no shapes and is not modelled.
    "llama-1b": ModelConfig(  # Llama-3.2-1B shape, tied embeddings: 1,235,814,400
        "llama", 16, 32, 2048, vocab_size=128256, max_seq_len=8192, n_kv_heads=8,
        ffn_hidden=8192, tie_embeddings=True, rope_theta=500000.0,
    ),
    "llama3-8b": ModelConfig(  # 8,030,261,248
        "llama", 32, 32, 4096, vocab_size=128256, max_seq_len=8192, n_kv_heads=8,
        ffn_hidden=14336, rope_theta=500000.0,
    ),
    "llama3-405b": ModelConfig(  # 405,853,388,800
        "llama", 126, 128, 16384, vocab_size=128256, max_seq_len=8192, n_kv_heads=8,
        ffn_hidden=53248, rope_theta=500000.0,
    ),
    # BERT-large (Google), masked-LM head; 335,174,458 as HF BertForMaskedLM.
    "bert-large": ModelConfig("bert", 24, 16, 1024, vocab_size=30522, max_seq_len=512),
    # Tiny presets for fast CPU tests and smoke training.
    "gpt2-tiny": ModelConfig("gpt2", 2, 4, 64, vocab_size=512, max_seq_len=128),
    "llama-tiny": ModelConfig(
        "llama", 2, 4, 64, vocab_size=512, max_seq_len=128, n_kv_heads=2, ffn_hidden=176
    ),
    "bert-tiny": ModelConfig("bert", 2, 4, 64, vocab_size=512, max_seq_len=128),
}

ALIASES: dict[str, str] = {
    "gpt2-small": "gpt2",
    "gpt2-124m": "gpt2",
    "gpt2-355m": "gpt2-medium",
    "gpt2-774m": "gpt2-large",
    "gpt2-1.5b": "gpt2-xl",
    "llama3.2-1b": "llama-1b",
    "bert-large-uncased": "bert-large",
}

_FACTORY_FORM = "package.module:factory"


class UnknownModelError(ValueError):
    """Raised for a model name that is neither a preset nor an alias."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(
            f"unknown model {name!r}. Known models: {', '.join(model_names())}. "
            f"For a custom model, give a factory as '{_FACTORY_FORM}' "
            "(a zero-argument callable returning an nn.Module)."
        )


def model_names() -> list[str]:
    """Preset names in table order, each alias listed after its target as 'alias (= target)'."""
    names: list[str] = []
    for preset in PRESETS:
        names.append(preset)
        names.extend(f"{alias} (= {target})" for alias, target in ALIASES.items() if target == preset)
    return names


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """Preset (or alias) config by name, with optional field overrides."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise UnknownModelError(name)
    config = PRESETS[key]
    return dataclasses.replace(config, **overrides) if overrides else config


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
    with torch.device(device):
        model = _FAMILY_CLASSES[config.family](config)
    if device.type != "meta":
        model.init_weights()
    return model


def load_factory(spec: str, device: str | torch.device | None = None) -> nn.Module:
    """Import ``package.module:factory`` and return ``factory()``.

    ``factory`` may be a dotted attribute path (``module:Class.build``). With
    ``device`` given, the factory runs under ``torch.device(device)`` (e.g.
    ``"meta"`` to build without allocating memory).
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"model factory {spec!r} is not of the form '{_FACTORY_FORM}'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only translate "this module does not exist"; a missing import inside
        # an existing module is the user's bug and keeps its own traceback.
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise
        raise ValueError(f"model factory {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    factory: Any = module
    for part in attr_path.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError as exc:
            raise ValueError(f"model factory {spec!r}: {module_name!r} has no attribute {attr_path!r}") from exc
    if not callable(factory):
        raise ValueError(f"model factory {spec!r}: {attr_path!r} is not callable")
    if device is None:
        model = factory()
    else:
        with torch.device(device):
            model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def count_params(model: nn.Module) -> int:
    """Number of unique parameters; a tied weight is counted once."""
    return sum(p.numel() for p in model.parameters())
