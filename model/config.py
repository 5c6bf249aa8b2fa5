"""The one frozen model config, read from a checkpoint's own metadata.

Per-family differences (Gemma's (1 + w) norms, sandwich norms, q/k norms, GELU vs SiLU, embedding
scale, soft-caps, local/global layer pattern) are fields here, not forks of the model code. Values
that a format does not record (GGUF has no field for Gemma 3's local RoPE base or its 5:1 layer
pattern) come from `FAMILY_DEFAULTS`, the published constants of each architecture. The readers
that build a config from a checkpoint's metadata live in `jaxgen.checkpoints`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

GLOBAL, LOCAL = "global", "local"
WEIGHT_QUANTIZATIONS = (None, "int8")


# Families whose activations overflow float16 (Gemma's residual stream exceeds its 65,504: the
# 270M model gives NaN at every position of the golden prompts). float16 weights still serve them
# where activations are float32 (this CPU's platform); bfloat16 has float32's range.
FLOAT16_OVERFLOWS = frozenset({"gemma2", "gemma3"})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and conventions of a decoder-only transformer.

  Vocabulary of shape letters used across jaxgen: B batch, T query length, S cache length,
  D embed, N query heads, K kv heads, H head dim, F mlp dim, V vocab, L layers.
  """

  family: str  # "gemma3", "gemma2", "llama", "qwen2", "qwen3", "mistral"
  vocab_size: int  # V
  embed_dim: int  # D
  num_layers: int  # L
  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int  # H
  mlp_dim: int  # F
  max_context: int
  norm_eps: float = 1e-6
  norm_offset: float = 0.0  # Gemma stores norm weights as w and applies (1 + w): offset 1.0
  rope_base: float = 10_000.0  # global (full-attention) layers
  rope_base_local: float = 10_000.0  # sliding-window layers
  rope_scale: float = 1.0  # linear position scaling on global layers (Gemma 3 4B+ use 8)
  # Llama 3.1+ frequency scaling on global layers: (factor, low_freq_factor, high_freq_factor,
  # original context length); None: plain RoPE. See `layers.llama3_frequencies`.
  rope_llama3: tuple[float, float, float, int] | None = None
  # Per-frequency divisors [H/2] on global layers (llama.cpp stores Llama 3.1+ scaling this way).
  rope_factors: tuple[float, ...] | None = None
  sliding_window: int | None = None  # W; None: every layer attends to the whole context
  layer_kinds: tuple[str, ...] = ()  # GLOBAL or LOCAL per layer
  query_scale: float = 0.0  # multiplies q; 0.0 means 1/sqrt(H)
  embed_scale: bool = False  # multiply embeddings by sqrt(D) (Gemma)
  activation: str = "silu"  # "silu" or "gelu_tanh" for the gated MLP
  qk_norm: bool = False  # RMSNorm over H on q and k (Gemma 3, Qwen3)
  sandwich_norm: bool = False  # extra norms after attention and after the MLP (Gemma 2/3)
  qkv_bias: bool = False  # Qwen2
  tie_embeddings: bool = True
  final_softcap: float | None = None  # Gemma 2: 30.0
  attn_softcap: float | None = None  # Gemma 2: 50.0
  # How the projection and embedding weights are stored: None (the model's dtype) or "int8" (a
  # float32 scale per block of 32 inputs, see `model.quant`). Part of the config so that every
  # derived tree (parameter specs, shardings, the memory plan, an orbax restore target) follows it.
  weight_quant: str | None = None

  def __post_init__(self):
    if len(self.layer_kinds) != self.num_layers:
      raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries, expected num_layers={self.num_layers}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if LOCAL in self.layer_kinds and not self.sliding_window:
      raise ValueError("a layer is LOCAL but sliding_window is not set")
    if self.activation not in ("silu", "gelu_tanh"):
      raise ValueError(f"activation={self.activation!r}; expected 'silu' or 'gelu_tanh'")
    if self.weight_quant not in WEIGHT_QUANTIZATIONS:
      raise ValueError(f"quantization={self.weight_quant!r} is not supported; choose one of {list(WEIGHT_QUANTIZATIONS)}")
    if self.rope_factors is not None and len(self.rope_factors) != self.head_dim // 2:
      raise ValueError(f"rope_factors has {len(self.rope_factors)} entries, expected head_dim / 2 = {self.head_dim // 2}")

  @property
  def q_scale(self) -> float:
    return self.query_scale or 1.0 / math.sqrt(self.head_dim)

  @property
  def num_params(self) -> int:
    """Parameter count (tied embeddings counted once)."""
    d, h = self.embed_dim, self.head_dim
    attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
    norms = d * (4 if self.sandwich_norm else 2) + (2 * h if self.qk_norm else 0)
    layer = attn + 3 * d * self.mlp_dim + norms
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * layer + emb + d


# Architecture constants that checkpoint formats leave out. Each entry documents its source model.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    # Gemma 3 text decoders: every 6th layer global, local RoPE base 10k, GELU(tanh), sqrt(D) scale.
    "gemma3": dict(norm_offset=1.0, rope_base_local=10_000.0, embed_scale=True, activation="gelu_tanh",
                   qk_norm=True, sandwich_norm=True, global_every=6, tie_embeddings=True),
    # Gemma 2: alternating local/global, soft-caps on attention and final logits.
    "gemma2": dict(norm_offset=1.0, embed_scale=True, activation="gelu_tanh", sandwich_norm=True,
                   global_every=2, tie_embeddings=True, final_softcap=30.0, attn_softcap=50.0),
    "llama": dict(activation="silu"),
    "mistral": dict(activation="silu"),
    "qwen2": dict(activation="silu", qkv_bias=True),
    "qwen3": dict(activation="silu", qk_norm=True),
}


def layer_pattern(num_layers: int, global_every: int | None, sliding_window: int | None) -> tuple[str, ...]:
  """LOCAL/GLOBAL per layer: with `global_every=g`, layers g-1, 2g-1, ... are global."""
  if not sliding_window or not global_every:
    return (GLOBAL,) * num_layers
  return tuple(GLOBAL if (i + 1) % global_every == 0 else LOCAL for i in range(num_layers))
