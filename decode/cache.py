"""The KV cache of an engine: one preallocated pytree of `slots` rows, threaded through the
compiled programs and donated, never copied.

`layers` holds one `kv.LayerCache` per decoder layer (full context in global layers, a ring of
the window in sliding-window ones, each with one scratch entry; see `jaxgen.model.kv`);
`lengths` [B] counts the tokens each row (slot) holds. The position of every entry follows from
the length, so nothing else is stored.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from jaxgen.model import kv, quant
from jaxgen.model.config import LOCAL, ModelConfig

LENGTH_AXES = ("cache_batch",)


@flax.struct.dataclass
class KVCache:
  layers: tuple[kv.LayerCache, ...]
  lengths: jax.Array  # [B] int32: tokens held per row

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """Sizes of the cache: `slots` rows of up to `max_len` tokens, in `dtype` (float32, bfloat16,
  float16, or int8 with float32 scales per block of 16 of each key and value vector).

  `align`: on TPU and GPU a layer's entries are padded to the sublane tile, so that a kernel
  reads the cache where it lies (an odd length makes XLA copy the whole cache into the kernel's
  layout on every step).

  `slack`: extra entries of every ring. A verify step writes the k proposed tokens before knowing
  which are accepted; the entries of rejected ones overwrite the ring's oldest, which the next
  query still sees unless the ring holds k more than the window (`decode.speculative`)."""

  slots: int
  max_len: int
  dtype: str = "float32"
  slack: int = 0
  align: int = 1  # each layer's entries (scratch included) a multiple of this (`Platform.cache_align`)

  def layer_len(self, cfg: ModelConfig, kind: str) -> int:
    """Entries of a layer, scratch excluded. A ring longer than its window (slack, alignment)
    keeps a few older entries, which the window's mask hides; a global layer's extra entries
    are never written (no row holds more than max_len)."""
    n = min(cfg.sliding_window + self.slack, self.max_len) if kind == LOCAL else self.max_len
    return -(-(n + kv.SCRATCH) // self.align) * self.align - kv.SCRATCH

  @property
  def quantized(self) -> bool:
    """int8 entries with float32 block scales (`model.kv`)."""
    return self.dtype == "int8"

  def scales_per_vector(self, cfg: ModelConfig) -> int:
    """Float32 scales of one int8 key or value vector: a block of `quant.KV_GROUP` each."""
    return cfg.head_dim // quant.group_size(cfg.head_dim, quant.KV_GROUP)

  def shapes(self, cfg: ModelConfig) -> KVCache:
    """The cache as a tree of ShapeDtypeStructs (for planning, sharding and allocation)."""
    dt = jnp.dtype(self.dtype)
    layers = []
    for kind in cfg.layer_kinds:
      shape = (self.slots, cfg.num_kv_heads, self.layer_len(cfg, kind) + kv.SCRATCH, cfg.head_dim)
      entries = [jax.ShapeDtypeStruct(shape, dt)] * 2
      if self.quantized:
        entries += [jax.ShapeDtypeStruct(shape[:-1] + (self.scales_per_vector(cfg),), jnp.float32)] * 2
      layers.append(kv.LayerCache(*entries))
    return KVCache(tuple(layers), jax.ShapeDtypeStruct((self.slots,), jnp.int32))

  def axes(self, cfg: ModelConfig) -> KVCache:
    """Logical axis names, in the same tree structure as `shapes`."""
    entries = (kv.AXES, kv.AXES) + ((kv.SCALE_AXES, kv.SCALE_AXES) if self.quantized else ())
    return KVCache(tuple(kv.LayerCache(*entries) for _ in cfg.layer_kinds), LENGTH_AXES)

  def bytes_per_slot(self, cfg: ModelConfig) -> int:
    scales = 4 * self.scales_per_vector(cfg) if self.quantized else 0
    per_entry = 2 * cfg.num_kv_heads * (cfg.head_dim * jnp.dtype(self.dtype).itemsize + scales)
    return sum(per_entry * (self.layer_len(cfg, kind) + kv.SCRATCH) for kind in cfg.layer_kinds)

  def bytes_per_token(self, cfg: ModelConfig) -> float:
    """Average bytes per cached token at full length (ring layers amortised over max_len)."""
    return self.bytes_per_slot(cfg) / self.max_len

  def total_bytes(self, cfg: ModelConfig) -> int:
    return self.slots * self.bytes_per_slot(cfg)


def allocate(cfg: ModelConfig, spec: CacheSpec) -> KVCache:
  """A zero-filled cache on the default device (`steps.init_state` places a sharded one)."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec.shapes(cfg))


def full_capacity(cfg: ModelConfig, spec: CacheSpec) -> int | None:
  """Tokens a row can hold: the global layers' length (None when every layer is a ring: a model
  whose every layer has a sliding window, e.g. Mistral, is bounded by the engine's max_len alone)."""
  return None if all(kind == LOCAL for kind in cfg.layer_kinds) else spec.max_len
