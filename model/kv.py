"""What one decoder layer keeps of past tokens, and how a batch of rows reads and extends it.

A `LayerCache` holds keys and values of many rows: k, v [B', K, S_l + 1, H], kv heads before the
sequence so attention is a plain batched matmul over (B, K) with no relayout. By the layer's kind:
- a global layer keeps the whole context: entry j holds position j;
- a sliding-window layer keeps a ring of S_l = W entries: entry j holds the latest position p with
  p % W == j. A long context pays full length in global layers only.
The last entry (index S_l) is scratch: never attended, it absorbs the writes of padding and of
rows that take no token, so every write is an unconditional in-place update (a conditional "drop"
write makes XLA copy the whole layer).

An int8 cache stores k and v as int8 with float32 scales per (row, kv head, entry) and block of
16 of the head dim (`quant.KV_GROUP`; one block when 16 does not divide H): each new key or
value vector is quantized on write and dequantized where attention reads it. (One scale per
vector moved 4% of the embedded model's greedy choices on the golden prompts; blocks of 32, 1.5%;
of 16, 1%.) Entries are written once and never rescaled, so a ring overwrites an entry's values
and scales together.

A layer call covers B rows (`batch.BatchMeta`): row b is cache row `index[b]` (or b), held `start[b]` tokens
before the call and takes the first `count[b]` of the T new ones (positions start[b] + t). The
positions of all held entries follow from `start`, so nothing else is stored.
"""

from __future__ import annotations


import flax.struct
import jax
import jax.numpy as jnp
from jaxgen.model import quant
from jaxgen.model.kernels.attention import KVBlock
from jaxgen.model.batch import BatchMeta

SCRATCH = 1  # extra entry per layer that takes writes meant for nowhere
AXES = ("cache_batch", "kv_heads", "cache_seq", "head_dim")  # logical axes of k and v
SCALE_AXES = AXES[:-1] + (None,)  # of an int8 cache's scales [B', K, S_l + 1, H / 16]


@flax.struct.dataclass
class LayerCache:
  k: jax.Array  # [B', K, S_l + 1, H]
  v: jax.Array  # [B', K, S_l + 1, H]
  k_scale: jax.Array | None = None  # [B', K, S_l + 1, H / 16] float32: int8 caches only
  v_scale: jax.Array | None = None

  @property
  def quantized(self) -> bool:
    return self.k_scale is not None


def capacity(layer: LayerCache) -> int:
  """Entries a layer holds (its length without the scratch entry)."""
  return layer.k.shape[2] - SCRATCH


def entry_positions(lengths: jax.Array, size: int, ring: bool) -> jax.Array:
  """Position held by each of `size` entries, given rows holding `lengths` tokens. -> [B, size].

  Global layer: entry j holds position j if j < length. Ring of W: entry j holds the latest
  p < length with p % W == j. Empty entries get -1.
  """
  j = jnp.arange(size, dtype=jnp.int32)[None, :]
  n = lengths[:, None]
  p = (n - 1) - jnp.mod(n - 1 - j, size) if ring else j
  return jnp.where((p >= 0) & (p < n), p, -1)


def held(layer: LayerCache, rows: BatchMeta, ring: bool) -> KVBlock:
  """What the rows held before this call, as an attention block read where it lies.

  Only the filled part is visible: no entry at or past the longest length of a row that takes
  tokens now (or the ring's size). Rows that take none (finished or idle slots keep their old
  lengths) have their output discarded and do not count.
  """
  size = capacity(layer)
  pos = jnp.pad(entry_positions(rows.start, size, ring), ((0, 0), (0, SCRATCH)), constant_values=-1)
  limit = jnp.minimum(jnp.max(jnp.where(rows.count > 0, rows.start, 0)), size)
  return KVBlock(layer.k, layer.v, pos, limit, rows.index, layer.k_scale, layer.v_scale, rows.start,
                 size if ring else None)


def write(layer: LayerCache, k: jax.Array, v: jax.Array, rows: BatchMeta, after: jax.Array) -> LayerCache:
  """The layer with the rows' new entries written. k, v: [B, T, K, H] as the model computes them.

  Position p goes to entry p % S_l. Only the last S_l of a row's new tokens are written (earlier
  ones would be overwritten anyway on a ring), so real indices never collide; the rest go to the
  scratch entry.

  `after` is the attention output of this layer. The write is made to depend on it through an
  exact zero per row: that orders the in-place update after every read of the old entries.
  Without the data dependence XLA cannot prove the order and copies the whole layer (XLA:CPU:
  2-4 copies of every cache array per step). Per row, so a row whose output is not finite spoils
  no other row's entries.
  """
  b, t = k.shape[:2]
  zero = (0 * jnp.sum(after, axis=tuple(range(1, after.ndim)))).astype(k.dtype)[:, None, None, None]
  k, v = k + zero, v + zero
  scales = None
  if layer.quantized:  # int8 [B, T, K, H] and scales [B, T, K, H / 16]
    (k, k_scale), (v, v_scale) = quant.quantize(k, quant.KV_GROUP), quant.quantize(v, quant.KV_GROUP)
    scales = (k_scale, v_scale)
  size = capacity(layer)
  ti = jnp.arange(t, dtype=jnp.int32)[None, :]
  keep = (ti < rows.count[:, None]) & (ti >= rows.count[:, None] - size)
  idx = jnp.where(keep, jnp.mod(rows.start[:, None] + ti, size), size)  # index `size` is the scratch entry
  row = jnp.arange(b, dtype=jnp.int32) if rows.index is None else rows.index
  if b == 1 and t == 1:
    # One entry: a plain in-place update (XLA lowers a one-element scatter to a select that
    # reads the old entry first, which costs a copy of the whole layer every step).
    at = (row[0], 0, idx[0, 0], 0)
    new = [jax.lax.dynamic_update_slice(layer.k, k.swapaxes(1, 2).astype(layer.k.dtype), at),
           jax.lax.dynamic_update_slice(layer.v, v.swapaxes(1, 2).astype(layer.v.dtype), at)]
    if scales is not None:
      new += [jax.lax.dynamic_update_slice(old, s.swapaxes(1, 2), at)
              for old, s in zip((layer.k_scale, layer.v_scale), scales)]
    return LayerCache(*new)
  rr = jnp.broadcast_to(row[:, None], (b, t))
  # Advanced indices (rows, idx) around the kv-head slice put [B, T] first: values are [B, T, K, H].
  unique = t == 1  # one write per row: no two updates meet, not even in the scratch entry
  new = [old.at[rr, :, idx].set(x.astype(old.dtype), mode="promise_in_bounds", unique_indices=unique)
         for old, x in ((layer.k, k), (layer.v, v))]
  if scales is not None:
    new += [old.at[rr, :, idx].set(s, mode="promise_in_bounds", unique_indices=unique)
            for old, s in zip((layer.k_scale, layer.v_scale), scales)]
  return LayerCache(*new)
