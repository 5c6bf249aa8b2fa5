"""`KVBlock`, what every attention implementation reads, and the helpers they share: reading a
block's rows (dequantizing an int8 cache), grouping query heads by kv head, the causal/window mask."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxgen.model import quant
from jaxgen.model.layers import attention_mask


class KVBlock(NamedTuple):
  k: jax.Array  # [B', K, S, H]
  v: jax.Array  # [B', K, S, H]
  pos: jax.Array  # [B, S] int32: position of each key of each batch row, -1 for an empty entry
  limit: jax.Array | None = None  # int32 scalar: no key at index >= limit is visible
  rows: jax.Array | None = None  # [B] int32: the rows of k, v the batch reads; None: the first B
  k_scale: jax.Array | None = None  # [B', K, S, H / 16] float32: k and v are int8 (`model.kv`)
  v_scale: jax.Array | None = None
  start: jax.Array | None = None  # [B] int32: tokens each row held, when the block is a cache (`kv.held`)
  ring: int | None = None  # a cache block's ring size (its positions wrap); None: entry j holds position j


def read_rows(x: jax.Array, rows: jax.Array | None, b: int) -> jax.Array:
  """The batch's rows of a block array [B', ...] -> [B, ...]."""
  return x[:b] if rows is None else jnp.take(x, rows, axis=0)


def dequantized(x: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
  return x.astype(dtype) if scale is None else quant.dequantize(x, scale, dtype)


def read_whole(blk: KVBlock, b: int, dtype) -> tuple[jax.Array, jax.Array]:
  """The batch's rows of the block's keys and values, whole, in `dtype`."""
  scale = lambda s: None if s is None else read_rows(s, blk.rows, b)  # noqa: E731
  return (dequantized(read_rows(blk.k, blk.rows, b), scale(blk.k_scale), dtype),
          dequantized(read_rows(blk.v, blk.rows, b), scale(blk.v_scale), dtype))


def group(q: jax.Array, kv_heads: int) -> jax.Array:
  """[B, T, N, H] -> [B, K, T*G, H]: the G heads and T queries of one kv head are one matmul's rows."""
  b, t, n, h = q.shape
  g = n // kv_heads
  return q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * g, h)


def ungroup(out: jax.Array, q: jax.Array) -> jax.Array:
  b, t, n, h = q.shape
  kh = out.shape[1]
  return out.reshape(b, kh, t, n // kh, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h).astype(q.dtype)


def visibility(q_pos: jax.Array, k_pos: jax.Array, window: int | None, g: int) -> jax.Array:
  """bool [B, 1, T*G, S]: row t*G + g of the grouped queries is query t."""
  return jnp.repeat(attention_mask(q_pos, k_pos, window), g, axis=1)[:, None]


def capped(s: jax.Array, softcap: float | None) -> jax.Array:
  return s if softcap is None else jnp.tanh(s / softcap) * softcap


def held_position(j: jax.Array, n: jax.Array, ring: int | None) -> jax.Array:
  """Position held by cache entries j (int32 of any shape) of a row that held n tokens; negative
  where empty. Scalar arithmetic a kernel can do on its own (no position array in memory): entry j
  of a global layer holds position j; of a ring of W, the latest p < n with p % W == j."""
  if ring is None:
    return jnp.where(j < n, j, -1)
  # n - 1 = q * ring + r: entries up to r hold lap q, the later ones lap q - 1 (a lap before the
  # first: empty).
  last = jnp.maximum(n - 1, 0)
  lap = jax.lax.div(last, np.int32(ring))  # truncating, operands >= 0; a numpy constant (a kernel captures no array)
  r = last - lap * ring
  p = j + ring * (lap - (j > r).astype(jnp.int32))
  return jnp.where(n > 0, p, -1)
