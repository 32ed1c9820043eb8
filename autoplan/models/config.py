"""Model configurations: one frozen record per model, and the zoo's presets.

A `ModelConfig` rebuilds a model exactly (`autoplan.models.zoo.build_model`), so plan files store it
as JSON; `NAME[field=value,...]` on the command line overrides fields of a preset.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ALIASES", "FAMILIES", "FAMILY_FOLLOWS", "PRESETS", "ModelConfig", "UnknownModelError", "get_config",
           "model_names"]

FACTORY_FORM = "package.module:factory"

FAMILIES = ("gpt2", "llama", "bert", "moe")
ROPE_FAMILIES = ("llama", "moe")  # rotary positions: precomputed tables of max_seq_len rows

# Family defaults, applied by ModelConfig.__post_init__ when a field is None.
_DEFAULT_TIE_EMBEDDINGS = {"gpt2": True, "llama": False, "bert": True, "moe": False}
_DEFAULT_NORM_EPS = {"gpt2": 1e-5, "llama": 1e-5, "bert": 1e-12, "moe": 1e-5}
# what each family's model saves for backward, said by `autoplan models` (the model classes' `follows`)
FAMILY_FOLLOWS = {
    # Hugging Face's GPT2LMHeadModel saves twice as much per block (a Python GELU, dropout masks)
    "gpt2": "nanoGPT / torchtitan style: torch's fused GELU, no dropout",
    "llama": "saves what Hugging Face's LlamaForCausalLM saves (its RMSNorm and RoPE)",
    "bert": "BERT's layout with torch's fused GELU and no dropout (not compared with Hugging Face's)",
    "moe": "the zoo Llama with a mixture of experts in place of its MLP (router, top-k experts, grouped matmuls)",
}


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

    family: str  # "gpt2" | "llama" | "bert" | "moe" (llama with a mixture of experts for each MLP)
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
    n_experts: int | None = None  # moe only: routed experts per block
    top_k: int | None = None  # moe only: experts each token is sent to
    expert_ffn: int | None = None  # moe only: one expert's SwiGLU hidden size
    n_shared_experts: int = 0  # moe only: experts every token passes through (one MLP of their total width)
    norm_topk: bool = True  # moe only: the chosen experts' weights renormalised to sum to one (Mixtral)

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
            if self.family not in ROPE_FAMILIES and self.n_kv_heads != self.n_heads:
                raise ValueError(f"n_kv_heads (grouped-query attention) is only supported for llama and moe, not "
                                 f"{self.family}")
            if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
                raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.family in ROPE_FAMILIES and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        self._check_experts()

    def _check_experts(self) -> None:
        experts = (self.n_experts, self.top_k, self.expert_ffn)
        if self.family != "moe":
            if any(value is not None for value in experts) or self.n_shared_experts:
                raise ValueError(f"n_experts, top_k, expert_ffn and n_shared_experts are the moe family's, not "
                                 f"{self.family}'s")
            return
        if any(value is None for value in experts):
            raise ValueError("a moe model needs n_experts, top_k and expert_ffn")
        if self.n_experts < 2 or not 1 <= self.top_k <= self.n_experts or self.expert_ffn < 1 or self.n_shared_experts < 0:
            raise ValueError(f"need n_experts >= 2, 1 <= top_k <= n_experts, expert_ffn >= 1 and n_shared_experts >= 0; "
                             f"got {self.n_experts}, {self.top_k}, {self.expert_ffn}, {self.n_shared_experts}")

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
        if self.family not in ROPE_FAMILIES:
            return 4 * self.d_model
        # Meta's llama FeedForward: 2/3 of 4*d (SwiGLU has three matrices),
        # optionally scaled, then rounded up to a multiple of multiple_of.
        hidden = int(2 * (4 * self.d_model) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def n_params(self) -> int:
        """Parameters of the model this config builds (a tied weight once), from the config alone: what
        `autoplan models` lists without building a module (tests/test_models.py checks it against the modules)."""
        d, vocab = self.d_model, self.vocab_size
        head = 0 if self.tie_embeddings else d * vocab
        if self.family in ("llama", "moe"):  # no biases; RMSNorm weights; GQA's narrower k and v
            kv = self.kv_heads * self.head_dim
            if self.family == "llama":
                mlp = 3 * d * self.ffn_dim
            else:  # the router, the experts' stacked w1, w3, w2, and the shared experts' one wider MLP
                mlp = d * self.n_experts + 3 * self.n_experts * self.expert_ffn * d
                mlp += 3 * d * self.n_shared_experts * self.expert_ffn
            block = 2 * d + 2 * d * d + 2 * d * kv + mlp
            return vocab * d + self.n_layers * block + d + head
        # gpt2 and bert: biases and LayerNorms (weight and bias); fused qkv
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (2 * d * self.ffn_dim + self.ffn_dim + d)
        if self.family == "gpt2":
            return vocab * d + self.max_seq_len * d + self.n_layers * block + 2 * d + head
        embeddings = (vocab + self.max_seq_len + self.type_vocab_size) * d + 2 * d
        mlm_head = d * d + d + 2 * d + vocab + head  # dense, its norm, the decoder's bias (and weight, untied)
        return embeddings + self.n_layers * block + mlm_head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return cls(**data)




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
    "llama3-70b": ModelConfig(  # 70,553,706,496
        "llama", 80, 64, 8192, vocab_size=128256, max_seq_len=8192, n_kv_heads=8,
        ffn_hidden=28672, rope_theta=500000.0,
    ),
    "llama3-405b": ModelConfig(  # 405,853,388,800
        "llama", 126, 128, 16384, vocab_size=128256, max_seq_len=8192, n_kv_heads=8,
        ffn_hidden=53248, rope_theta=500000.0,
    ),
    # Mixtures of experts: Mixtral-8x7B's shape (8 experts, top-2; 46,702,792,704 parameters) and a
    # fine-grained one of DeepSeek-MoE-16B's (64 experts of 1408, top-6, 2 shared; every block routed).
    "mixtral-8x7b": ModelConfig(
        "moe", 32, 32, 4096, vocab_size=32000, max_seq_len=32768, n_kv_heads=8, rope_theta=1e6,
        n_experts=8, top_k=2, expert_ffn=14336,
    ),
    "moe-16b": ModelConfig(
        "moe", 28, 16, 2048, vocab_size=102400, max_seq_len=4096, n_experts=64, top_k=6, expert_ffn=1408,
        n_shared_experts=2, norm_topk=False,
    ),
    # BERT-large (Google), masked-LM head; 335,174,458 as HF BertForMaskedLM.
    "bert-large": ModelConfig("bert", 24, 16, 1024, vocab_size=30522, max_seq_len=512),
    # Tiny presets for fast CPU tests and smoke training.
    "gpt2-tiny": ModelConfig("gpt2", 2, 4, 64, vocab_size=512, max_seq_len=128),
    "llama-tiny": ModelConfig(
        "llama", 2, 4, 64, vocab_size=512, max_seq_len=128, n_kv_heads=2, ffn_hidden=176
    ),
    "bert-tiny": ModelConfig("bert", 2, 4, 64, vocab_size=512, max_seq_len=128),
    "moe-tiny": ModelConfig(
        "moe", 2, 4, 64, vocab_size=512, max_seq_len=128, n_kv_heads=2, n_experts=8, top_k=2, expert_ffn=96,
    ),
    "moe-fine-tiny": ModelConfig(
        "moe", 2, 4, 64, vocab_size=512, max_seq_len=128, n_kv_heads=2, n_experts=16, top_k=4, expert_ffn=32,
        n_shared_experts=1, norm_topk=False,
    ),
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



class UnknownModelError(ValueError):
    """Raised for a model name that is neither a preset nor an alias."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(
            f"unknown model {name!r}. Known models: {', '.join(model_names())}. "
            f"For a custom model, give a factory as '{FACTORY_FORM}' "
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

