"""The one frozen model config, read from a checkpoint's own metadata.

Per-family differences (Gemma's (1 + w) norms, sandwich norms, q/k norms, GELU vs SiLU, embedding
scale, soft-caps, local/global layer pattern) are fields here, not forks of the model code. Values
that a format does not record (GGUF has no field for Gemma 3's local RoPE base or its 5:1 layer
pattern) come from `FAMILY_DEFAULTS`, the published constants of each architecture.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

GLOBAL, LOCAL = "global", "local"


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

  def __post_init__(self):
    if len(self.layer_kinds) != self.num_layers:
      raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries, expected num_layers={self.num_layers}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if LOCAL in self.layer_kinds and not self.sliding_window:
      raise ValueError("a layer is LOCAL but sliding_window is not set")
    if self.activation not in ("silu", "gelu_tanh"):
      raise ValueError(f"activation={self.activation!r}; expected 'silu' or 'gelu_tanh'")

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


def config_from_gguf_metadata(meta: Mapping[str, Any], source: str = "<gguf>") -> ModelConfig:
  """Builds the config from GGUF key/values (`{arch}.embedding_length`, ...)."""
  arch = meta.get("general.architecture")
  if arch not in FAMILY_DEFAULTS:
    raise ValueError(f"{source}: general.architecture={arch!r} is not supported; "
                     f"supported: {sorted(FAMILY_DEFAULTS)}")
  fam = dict(FAMILY_DEFAULTS[arch])

  def get(key, default=None):
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
      raise ValueError(f"{source}: metadata key {arch}.{key} is missing")
    return value

  n_heads = int(get("attention.head_count"))
  d = int(get("embedding_length"))
  head_dim = int(get("attention.key_length", d // n_heads))
  window = meta.get(f"{arch}.attention.sliding_window")
  n_layers = int(get("block_count"))
  vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
  query_scale = 0.0
  if arch in ("gemma2", "gemma3"):
    # Gemma scales queries by query_pre_attn_scalar**-0.5, which equals head_dim for these sizes.
    query_scale = head_dim ** -0.5
  rope_scale = 1.0
  if meta.get(f"{arch}.rope.scaling.type") == "linear":
    rope_scale = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
  return ModelConfig(
      family=arch,
      vocab_size=int(vocab),
      embed_dim=d,
      num_layers=n_layers,
      num_heads=n_heads,
      num_kv_heads=int(get("attention.head_count_kv", n_heads)),
      head_dim=head_dim,
      mlp_dim=int(get("feed_forward_length")),
      max_context=int(get("context_length")),
      norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
      norm_offset=fam["norm_offset"] if "norm_offset" in fam else 0.0,
      rope_base=float(get("rope.freq_base", 10_000.0)),
      rope_base_local=fam.get("rope_base_local", float(get("rope.freq_base", 10_000.0))),
      rope_scale=rope_scale,
      sliding_window=int(window) if window else None,
      layer_kinds=layer_pattern(n_layers, fam.get("global_every"), int(window) if window else None),
      query_scale=query_scale,
      embed_scale=fam.get("embed_scale", False),
      activation=fam["activation"],
      qk_norm=fam.get("qk_norm", False),
      sandwich_norm=fam.get("sandwich_norm", False),
      qkv_bias=fam.get("qkv_bias", False),
      tie_embeddings=fam.get("tie_embeddings", True),
      final_softcap=fam.get("final_softcap"),
      attn_softcap=fam.get("attn_softcap"),
  )
