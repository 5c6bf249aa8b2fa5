"""Attention over blocks of keys: one entry point, the plain-XLA reference, and the backends.

`attention(q, blocks, q_pos, window, softcap, platform)` is what a decoder layer calls; the
`Platform` names the implementation (`IMPLS`), chosen once when an engine is built:

- "xla": the plain formulation and the reference. Scores of every block are joined, masked and
  softmaxed in one piece; each block is read whole. What TPU and GPU run.
- "xla_chunked": XLA:CPU's formulation. A block that carries a `limit` (a cache) is folded into a
  running softmax a few keys at a time up to that limit, so a mostly empty cache costs what its
  filled part does; its chunk sizes and score-matmul operand order suit XLA:CPU (docs/performance.md).
- "cpu": jaxgen's own kernel (`cpu_kernels.cache_attention`) folds limited float32 blocks in where
  they lie; every other block takes the "xla_chunked" path.
- "pallas": a Pallas kernel (`pallas_kernels.cache_attention`) folds each row's cache up to that
  row's own length (ragged); other blocks as the reference. For TPU and GPU; interpret mode on CPU.

A block is a `KVBlock`: keys and values [B', K, S, H] of which the batch reads the rows `rows`
(None: the first B), key positions [B, S] (-1: empty), and optionally `limit` (no key at index
>= limit is visible to any row). An int8 block (an int8 cache) carries the scales of its key and
value vectors and is dequantized into the queries' dtype as it is read (`_read`, `_chunk`).
Visibility is causal, within `window` when given:
`layers.attention_mask`. Query head n reads kv head n // G (G = N / K).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jaxgen.model import cpu_kernels, pallas_kernels, quant
from jaxgen.model.layers import NEG_INF, attention_mask


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


def attention(q: jax.Array, blocks: Sequence[KVBlock], q_pos: jax.Array, window: int | None,
              softcap: float | None, platform) -> jax.Array:
  """q [B, T, N, H] (already scaled), q_pos [B, T] -> [B, T, N, H] in q's dtype."""
  return IMPLS[platform.attention](q, blocks, q_pos, window, softcap, platform)


def read_rows(x: jax.Array, rows: jax.Array | None, b: int) -> jax.Array:
  """The batch's rows of a block array [B', ...] -> [B, ...]."""
  return x[:b] if rows is None else jnp.take(x, rows, axis=0)


def _dequantized(x: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
  return x.astype(dtype) if scale is None else quant.dequantize(x, scale, dtype)


def _read(blk: KVBlock, b: int, dtype) -> tuple[jax.Array, jax.Array]:
  """The batch's rows of the block's keys and values, whole, in `dtype`."""
  scale = lambda s: None if s is None else read_rows(s, blk.rows, b)  # noqa: E731
  return (_dequantized(read_rows(blk.k, blk.rows, b), scale(blk.k_scale), dtype),
          _dequantized(read_rows(blk.v, blk.rows, b), scale(blk.v_scale), dtype))


def _group(q: jax.Array, kv_heads: int) -> jax.Array:
  """[B, T, N, H] -> [B, K, T*G, H]: the G heads and T queries of one kv head are one matmul's rows."""
  b, t, n, h = q.shape
  g = n // kv_heads
  return q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * g, h)


def _ungroup(out: jax.Array, q: jax.Array) -> jax.Array:
  b, t, n, h = q.shape
  kh = out.shape[1]
  return out.reshape(b, kh, t, n // kh, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h).astype(q.dtype)


def _visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None, g: int) -> jax.Array:
  """bool [B, 1, T*G, S]: row t*G + g of the grouped queries is query t."""
  return jnp.repeat(attention_mask(q_pos, k_pos, window), g, axis=1)[:, None]


def _capped(s: jax.Array, softcap: float | None) -> jax.Array:
  return s if softcap is None else jnp.tanh(s / softcap) * softcap


# ------------------------------------------------------------------------------ the reference
def attention_xla(q, blocks, q_pos, window, softcap, platform=None):
  """Every block read whole; one masked softmax over the joined scores (float32)."""
  b, t, n, h = q.shape
  kh = blocks[0].k.shape[1]
  g = n // kh
  qg = _group(q, kh)
  scores, values = [], []
  for blk in blocks:
    k, v = _read(blk, b, q.dtype)
    s = jnp.einsum("bkrh,bksh->bkrs", qg, k, preferred_element_type=jnp.float32)
    visible = _visible(q_pos, blk.pos, window, g)
    if blk.limit is not None:
      visible &= jnp.arange(k.shape[2]) < blk.limit
    scores.append(jnp.where(visible, _capped(s, softcap), NEG_INF))
    values.append(v)
  s = jnp.concatenate(scores, axis=-1)  # [B, K, T*G, sum S_i]
  p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  v = jnp.concatenate(values, axis=2)  # [B, K, sum S_i, H]
  out = jnp.einsum("bkrs,bksh->bkrh", p.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)
  return _ungroup(out, q)


# ------------------------------------------------------------------------------ XLA:CPU, chunked
def cpu_chunk(rows: int, queries: int) -> int:
  """Keys per step when XLA:CPU reads a limited block. rows: batch x kv heads; queries: per row.

  A decode step over many rows streams best in short steps (each step's scores stay in cache),
  one over a few rows in longer ones (fewer loop trips); a prompt chunk's many queries make each
  step a real matmul, which larger steps feed better. The figures are in docs/performance.md.
  """
  if queries > 1:
    return 256
  return 128 if rows <= 4 else 64


def _chunked_parts(q: jax.Array, softcap):
  """(scores(k, pos, q_pos_rows) -> [B, K, R, S] float32 masked later, weighted(p, v)) for XLA:CPU."""
  # Scores and softmax in float32. (Asking XLA:CPU for float32 output of float32 inputs still
  # costs ~10x in these batched dots, so the preference is only stated for 16-bit inputs.)
  acc = None if q.dtype == jnp.float32 else jnp.float32

  def scores(qg, k):
    dims = (((3,), (3,)), ((0, 1), (0, 1)))
    if qg.shape[2] < k.shape[2]:
      # Fewer queries than keys (decode): keys on the left. XLA:CPU's batched matmul runs 2-3x
      # faster with the longer side as its rows; the transpose back is of the small result.
      s = jax.lax.dot_general(k.astype(q.dtype), qg, dims, preferred_element_type=acc).swapaxes(2, 3)
    else:
      s = jax.lax.dot_general(qg, k.astype(q.dtype), dims, preferred_element_type=acc)
    return _capped(s, softcap).astype(jnp.float32)

  def weighted(p, v):  # [B, K, R, S] x [B, K, S, H] -> [B, K, R, H] float32
    pv = jax.lax.dot_general(p.astype(q.dtype), v.astype(q.dtype), (((3,), (2,)), ((0, 1), (0, 1))),
                             preferred_element_type=acc)
    return pv.astype(jnp.float32)

  return scores, weighted


def _start(q, kh: int, blocks, q_pos, window, scores, weighted):
  """The running softmax state (max, sum of exp, weighted values) [B, K, T*G, .] after the blocks
  that have no limit (read whole, like the reference)."""
  b, t, n, h = q.shape
  qg = _group(q, kh)
  zeros = jnp.zeros((b, kh, t * (n // kh), 1), jnp.float32)
  run = (zeros + NEG_INF, zeros, jnp.zeros((b, kh, t * (n // kh), h), jnp.float32))
  if not blocks:
    return run
  kvs = [_read(blk, b, q.dtype) for blk in blocks]
  s = jnp.concatenate([jnp.where(_visible(q_pos, blk.pos, window, n // kh), scores(qg, k), NEG_INF)
                       for blk, (k, _) in zip(blocks, kvs)], axis=-1)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  total, at = run[2], 0
  for blk, (_, v) in zip(blocks, kvs):
    size = blk.k.shape[2]
    total = total + weighted(p[..., at:at + size], v)
    at += size
  return m, jnp.sum(p, axis=-1, keepdims=True), total


def _chunk_of(x: jax.Array, rows: jax.Array | None, b: int, at, c: int) -> jax.Array:
  """Entries [at, at + c) of the batch's rows of x [B', K, S, ...] -> [B, K, c, ...], reading only those."""
  tail = x.shape[3:]
  if rows is None:
    return jax.lax.dynamic_slice(x, (0, 0, at) + (0,) * len(tail), (b, x.shape[1], c) + tail)
  take = lambda r: jax.lax.dynamic_slice(x, (r, 0, at) + (0,) * len(tail), (1, x.shape[1], c) + tail)[0]  # noqa: E731
  return jax.vmap(take)(rows)


def _chunk(blk: KVBlock, b: int, at, c: int, dtype) -> tuple[jax.Array, jax.Array]:
  """Keys and values [at, at + c) of the batch's rows, in `dtype`."""
  part = lambda x: None if x is None else _chunk_of(x, blk.rows, b, at, c)  # noqa: E731
  return (_dequantized(part(blk.k), part(blk.k_scale), dtype), _dequantized(part(blk.v), part(blk.v_scale), dtype))


def fold_chunked(run, qg, blk: KVBlock, q_pos, window, c: int, scores, weighted):
  """Folds keys [0, limit) of one block into the running state, c keys a step (a while loop).

  The loop runs ceil(limit / c) times. Its last window is moved back to end at the block's end
  when it would overrun (a slice cannot), and keys it already folded in are masked out.
  """
  b = qg.shape[0]
  g = qg.shape[2] // q_pos.shape[1]
  size = blk.k.shape[2]

  def body(carry):
    i, (m, l, acc) = carry
    at = jnp.minimum(i * c, size - c)
    visible = _visible(q_pos, jax.lax.dynamic_slice_in_dim(blk.pos, at, c, axis=1), window, g)
    visible &= at + jnp.arange(c) >= i * c
    k, v = _chunk(blk, b, at, c, qg.dtype)
    s = jnp.where(visible, scores(qg, k), NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - m_new)
    scale = jnp.exp(m - m_new)
    acc = acc * scale + weighted(p, v)
    return i + 1, (m_new, l * scale + jnp.sum(p, axis=-1, keepdims=True), acc)

  _, run = jax.lax.while_loop(lambda carry: carry[0] * c < blk.limit, body, (jnp.int32(0), run))
  return run


def attention_xla_chunked(q, blocks, q_pos, window, softcap, platform=None, chunk: int | None = None):
  """Blocks with a limit folded in chunk by chunk (XLA:CPU); the others read whole first."""
  b, t, n, h = q.shape
  kh = blocks[0].k.shape[1]
  scores, weighted = _chunked_parts(q, softcap)
  run = _start(q, kh, [blk for blk in blocks if blk.limit is None], q_pos, window, scores, weighted)
  qg = _group(q, kh)
  for blk in blocks:
    if blk.limit is not None:
      c = min(chunk or cpu_chunk(b * kh, t), blk.k.shape[2])
      run = fold_chunked(run, qg, blk, q_pos, window, c, scores, weighted)
  return _ungroup(run[2] / run[1], q)


# ------------------------------------------------------------------------------ the CPU kernel
def kernel_takes(q: jax.Array, blk: KVBlock) -> bool:
  """Whether `cpu_kernels.cache_attention` folds this block in: a limited float32 block, float32
  queries, a head dim its 16-lane vectors divide, and decode-sized query rows per kv head (a prompt
  chunk's many rows are real matmuls, which XLA runs well)."""
  t, n, h = q.shape[1:]
  rows = t * (n // blk.k.shape[1])
  return (blk.limit is not None and q.dtype == blk.k.dtype == blk.v.dtype == jnp.float32 and h % 16 == 0
          and rows <= cpu_kernels.MAX_ROWS)


def _unlimited_first(q, blocks, q_pos, window, softcap):
  """What the kernels' paths share: the running state after the blocks without a limit (read
  whole), the grouped queries and each grouped row's position [B, T*G]."""
  kh = blocks[0].k.shape[1]
  scores, weighted = _chunked_parts(q, softcap)
  run = _start(q, kh, [blk for blk in blocks if blk.limit is None], q_pos, window, scores, weighted)
  return kh, scores, weighted, run, _group(q, kh), jnp.repeat(q_pos, q.shape[2] // kh, axis=1)


def attention_cpu(q, blocks, q_pos, window, softcap, platform=None):
  """Limited float32 blocks through the CPU kernel (read in place); the rest as "xla_chunked"."""
  b, t, n, h = q.shape
  kh, scores, weighted, run, qg, q_rows = _unlimited_first(q, blocks, q_pos, window, softcap)
  for blk in blocks:
    if blk.limit is None:
      continue
    if kernel_takes(q, blk):
      k, v = (blk.k, blk.v) if blk.rows is None else (jnp.take(blk.k, blk.rows, axis=0), jnp.take(blk.v, blk.rows, axis=0))
      run = cpu_kernels.cache_attention(qg, k, v, blk.pos, q_rows, blk.limit, run, window, softcap)
    else:
      c = min(cpu_chunk(b * kh, t), blk.k.shape[2])
      run = fold_chunked(run, qg, blk, q_pos, window, c, scores, weighted)
  return _ungroup(run[2] / run[1], q)


# ---------------------------------------------------------------------------- Pallas (TPU, GPU)
def attention_pallas(q, blocks, q_pos, window, softcap, platform=None):
  """Cache blocks through the Pallas kernel, each row read up to its own filled length
  (`pallas_kernels.cache_attention`, positions computed from `start`); the other blocks as the
  reference reads them. Interpret mode on CPU."""
  b, t, n, h = q.shape
  kh, scores, weighted, run, qg, q_rows = _unlimited_first(q, blocks, q_pos, window, softcap)
  # Pallas compiles only for TPU and GPU; the platform says which the program is for (a plan
  # compiles for a TPU from a CPU process).
  backend = jax.default_backend() if platform is None or platform.backend == "any" else platform.backend
  interpret = backend not in ("tpu", "gpu", "cuda") or (platform is not None and platform.emulated)
  for blk in blocks:
    if blk.limit is None:
      continue
    if blk.start is None:
      raise ValueError("attention_impl='pallas' reads cache blocks made by kv.held: their positions follow from "
                       "each row's length (KVBlock.start), which this block does not carry")
    size = blk.k.shape[2] if blk.ring is None else blk.ring
    length = jnp.minimum(jnp.minimum(blk.start, size), blk.limit).astype(jnp.int32)  # [B] entries to read
    rows = jnp.arange(b, dtype=jnp.int32) if blk.rows is None else blk.rows.astype(jnp.int32)
    run = pallas_kernels.cache_attention(run, qg, blk.k, blk.v, q_rows, blk.start, length, rows, ring=blk.ring,
                                         window=window, softcap=softcap, k_scale=blk.k_scale, v_scale=blk.v_scale,
                                         interpret=interpret)
  return _ungroup(run[2] / run[1], q)


IMPLS: dict[str, Callable] = {"xla": attention_xla, "xla_chunked": attention_xla_chunked, "cpu": attention_cpu,
                              "pallas": attention_pallas}
