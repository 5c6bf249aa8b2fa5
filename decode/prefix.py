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

import collections
import dataclasses
import hashlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxgen.decode.cache import KVCache
from jaxgen.model import kv, quant
from jaxgen.model.config import ModelConfig

BLOCK = 16  # tokens per cached block
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


# -------------------------------------------------------------------------------------- the host
def chain(ids: Sequence[int], blocks: int) -> list[bytes]:
  """Chained hashes of the first `blocks` full blocks of token ids."""
  arr = np.asarray(ids[:blocks * BLOCK], np.int64)
  out, h = [], b""
  for i in range(blocks):
    h = hashlib.blake2b(h + arr[i * BLOCK:(i + 1) * BLOCK].tobytes(), digest_size=16).digest()
    out.append(h)
  return out


class PrefixIndex:
  """Which chained hashes the store holds, in which block, least recently used first."""

  def __init__(self, blocks: int):
    self.capacity = blocks
    self._free = list(range(blocks - 1, -1, -1))
    self._lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    self.evictions = 0

  def __contains__(self, h: bytes) -> bool:
    return h in self._lru

  def __len__(self) -> int:
    return len(self._lru)

  def lookup(self, hashes: Sequence[bytes]) -> list[int]:
    """Store blocks of the longest cached run of `hashes` from the first (touched as used)."""
    ids = []
    for h in hashes:
      i = self._lru.get(h)
      if i is None:
        break
      ids.append(i)
    self.touch(hashes[:len(ids)])
    return ids

  def touch(self, hashes: Sequence[bytes]) -> None:
    """Marks a chain used, deepest block first: ancestors end up more recent than descendants."""
    for h in reversed(hashes):
      if h in self._lru:
        self._lru.move_to_end(h)

  def add(self, h: bytes, keep: frozenset[bytes] | set[bytes]) -> int | None:
    """A store block for new hash `h`: a free one, or the least recently used one's unless that
    is in `keep` (the chain being saved: then the store is too small for it and None is returned)."""
    if self._free:
      i = self._free.pop()
    else:
      if not self._lru:
        return None
      victim = next(iter(self._lru))
      if victim in keep:
        return None
      i = self._lru.pop(victim)
      self.evictions += 1
    self._lru[h] = i
    return i

  def check(self) -> None:
    """Every block is either free or held by exactly one hash (nothing leaked)."""
    held = list(self._lru.values())
    if sorted(held + self._free) != list(range(self.capacity)):
      raise AssertionError(f"prefix store blocks leaked: {len(held)} held + {len(self._free)} free "
                           f"!= {self.capacity}")
