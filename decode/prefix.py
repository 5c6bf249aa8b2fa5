"""Prefix caching: the keys and values of prompt prefixes kept in a device block store, so a
prompt that starts like an earlier one prefills only what is new.

Granularity is a block of `BLOCK` tokens. A block is identified by a chained hash: the hash of its
tokens and of the hash of the block before it, so equal hashes mean equal token prefixes, not only
equal blocks. On admission the engine looks up the longest run of cached blocks of the prompt
(never its last token, whose logits must be computed), copies them into the request's cache row
(`restore`) and prefills the rest. After every prompt chunk, and when a request finishes, the
row's completed blocks are copied into the store (`save`). Copies, not shared pages: the cache
row layout and the attention kernels stay as they are, and a cached block needs no reference
count (a restore is a copy made at once, so any block can be evicted at any time).

Sliding-window layers. A ring layer holds only the last W positions of a row, but a continuation
from position P needs positions [P - W, P) of it, and a hit may end at any block. So every block
is stored for every layer, ring layers included: a cached token costs what it would cost in a
model with only global layers (the price of hits that may end anywhere, with no recompute).
Blocks are copied out of the row after each prompt chunk, while the ring still holds them: the
engine's chunks are therefore at most the smallest ring (a multiple of `BLOCK`), and a model whose
window is shorter than a block caches nothing. Generated tokens are saved when their request
finishes, as far back as the rings still hold them (chat: turn N reuses turns 1..N-1 and the
reply of turn N-1 as long as it fits the window).

Eviction is least recently used, with a block's ancestors always more recent than itself (a
chain is touched deepest first), so a chain is evicted from its tail and no reachable block ever
loses its parent.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxgen.decode.cache import KVCache
from jaxgen.decode.prefix_index import BLOCK, PrefixIndex, chain  # noqa: F401 (the host side)
from jaxgen.model import kv, quant
from jaxgen.model.config import ModelConfig

AXES = ("prefix_blocks",) + kv.AXES[1:]  # logical axes of a store array [NB, K, BLOCK, H]
SCALE_AXES = ("prefix_blocks",) + kv.SCALE_AXES[1:]


# ------------------------------------------------------------------------------------ the device
@dataclasses.dataclass(frozen=True)
class StoreSpec:
  """A store of `blocks` blocks of every layer's keys and values, in the cache's dtype (an int8
  cache stores its block scales too). The last block is scratch: it takes the writes of padding."""

  blocks: int
  cache_dtype: str

  @property
  def usable(self) -> int:
    return self.blocks - 1

  def shapes(self, cfg: ModelConfig) -> tuple[kv.LayerCache, ...]:
    shape = (self.blocks, cfg.num_kv_heads, BLOCK, cfg.head_dim)
    entries = [jax.ShapeDtypeStruct(shape, jnp.dtype(self.cache_dtype))] * 2
    if self.cache_dtype == "int8":
      groups = cfg.head_dim // quant.group_size(cfg.head_dim, quant.KV_GROUP)
      entries += [jax.ShapeDtypeStruct(shape[:-1] + (groups,), jnp.float32)] * 2
    return tuple(kv.LayerCache(*entries) for _ in cfg.layer_kinds)

  def axes(self, cfg: ModelConfig) -> tuple[kv.LayerCache, ...]:
    entries = (AXES, AXES) + ((SCALE_AXES, SCALE_AXES) if self.cache_dtype == "int8" else ())
    return tuple(kv.LayerCache(*entries) for _ in cfg.layer_kinds)

  def total_bytes(self, cfg: ModelConfig) -> int:
    return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(self.shapes(cfg)))


def bytes_per_block(cfg: ModelConfig, cache_dtype: str) -> int:
  return StoreSpec(1, cache_dtype).total_bytes(cfg)


def spec_for(cfg: ModelConfig, cache_dtype: str, tokens: int) -> StoreSpec:
  """The store a budget of `tokens` cached tokens buys (scratch block included in the budget)."""
  return StoreSpec(max(tokens // BLOCK, 0), cache_dtype)


def default_tokens(cfg: ModelConfig, cache_dtype: str, cache_bytes: int, free_bytes: int | None) -> int:
  """The default budget: half the device memory left free once weights and cache are placed,
  or, where the device does not say (CPU, multi-process runs), as many bytes as the KV cache."""
  budget = cache_bytes if free_bytes is None else free_bytes // 2
  return BLOCK * max(budget // bytes_per_block(cfg, cache_dtype), 0)


def allocate(cfg: ModelConfig, spec: StoreSpec):
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec.shapes(cfg))


def save(cache: KVCache, store, slot, first, ids):
  """Copies blocks of cache row `slot` into the store: block i holds positions first + BLOCK * i ...
  and goes to store block ids[i] (padding: the scratch block). -> the new store.

  Entries are read where the row keeps them (position p at entry p % size: a ring's layout, and a
  global layer's for every p it holds), so the caller must only ask for blocks the rings still hold.
  """
  m = ids.shape[0]
  pos = first + jnp.arange(m * BLOCK, dtype=jnp.int32).reshape(m, BLOCK)

  def copy(a, s):  # a [B', K, S + 1, X] -> s [NB, K, BLOCK, X]
    row = jax.lax.dynamic_index_in_dim(a, slot, 0, keepdims=False)  # [K, S + 1, X]
    got = row[:, jnp.mod(pos, a.shape[2] - kv.SCRATCH)]  # [K, M, BLOCK, X]
    return s.at[ids].set(got.swapaxes(0, 1))

  return tuple(jax.tree.map(copy, layer, blocks) for layer, blocks in zip(cache.layers, store))


def restore(cache: KVCache, store, slot, ids, length) -> KVCache:
  """Cache row `slot` set to hold the `length` tokens (a multiple of BLOCK) of store blocks ids
  [ceil(max_len / BLOCK)] (block j of the prefix in ids[j]). Every layer gets what it would hold
  after prefilling them: a global layer positions [0, length), a ring the last of them."""

  def fill(a, s):
    size = a.shape[2] - kv.SCRATCH
    p = kv.entry_positions(jnp.reshape(length, (1,)), size, ring=True)[0]  # [size]: -1 where the entry stays empty
    q = jnp.maximum(p, 0)
    got = s[ids[q // BLOCK], :, q % BLOCK]  # [size, K, X]
    row = jax.lax.dynamic_index_in_dim(a, slot, 0, keepdims=False)  # [K, S + 1, X]
    new = jnp.where((p >= 0)[None, :, None], got.swapaxes(0, 1), row[:, :size])
    return jax.lax.dynamic_update_slice(a, new[None], (slot, 0, 0, 0))

  layers = tuple(jax.tree.map(fill, layer, blocks) for layer, blocks in zip(cache.layers, store))
  return KVCache(layers, cache.lengths.at[slot].set(length))
