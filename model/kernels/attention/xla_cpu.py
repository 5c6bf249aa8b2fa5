"""XLA:CPU's formulation ("xla_chunked"): a block that carries a `limit` (a cache) is folded into a
running softmax a few keys at a time up to that limit, so a mostly empty cache costs what its
filled part does. A performance choice for XLA:CPU; numerically the reference's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxgen.model.kernels.attention.block import KVBlock, capped, dequantized, group, read_whole, ungroup, visibility
from jaxgen.model.layers import NEG_INF


def cpu_chunk(rows: int, queries: int) -> int:
  """Keys per step when XLA:CPU reads a limited block. rows: batch x kv heads; queries: per row.

  A decode step over many rows streams best in short steps (each step's scores stay in cache),
  one over a few rows in longer ones (fewer loop trips); a prompt chunk's many queries make each
  step a real matmul, which larger steps feed better. The figures are in docs/performance.md.
  """
  if queries > 1:
    return 256
  return 128 if rows <= 4 else 64


def chunked_parts(q: jax.Array, softcap):
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
    return capped(s, softcap).astype(jnp.float32)

  def weighted(p, v):  # [B, K, R, S] x [B, K, S, H] -> [B, K, R, H] float32
    pv = jax.lax.dot_general(p.astype(q.dtype), v.astype(q.dtype), (((3,), (2,)), ((0, 1), (0, 1))),
                             preferred_element_type=acc)
    return pv.astype(jnp.float32)

  return scores, weighted


def start_state(q, kh: int, blocks, q_pos, window, scores, weighted):
  """The running softmax state (max, sum of exp, weighted values) [B, K, T*G, .] after the blocks
  that have no limit (read whole, like the reference)."""
  b, t, n, h = q.shape
  qg = group(q, kh)
  zeros = jnp.zeros((b, kh, t * (n // kh), 1), jnp.float32)
  run = (zeros + NEG_INF, zeros, jnp.zeros((b, kh, t * (n // kh), h), jnp.float32))
  if not blocks:
    return run
  kvs = [read_whole(blk, b, q.dtype) for blk in blocks]
  s = jnp.concatenate([jnp.where(visibility(q_pos, blk.pos, window, n // kh), scores(qg, k), NEG_INF)
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
  return (dequantized(part(blk.k), part(blk.k_scale), dtype), dequantized(part(blk.v), part(blk.v_scale), dtype))


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
    visible = visibility(q_pos, jax.lax.dynamic_slice_in_dim(blk.pos, at, c, axis=1), window, g)
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
  scores, weighted = chunked_parts(q, softcap)
  run = start_state(q, kh, [blk for blk in blocks if blk.limit is None], q_pos, window, scores, weighted)
  qg = group(q, kh)
  for blk in blocks:
    if blk.limit is not None:
      c = min(chunk or cpu_chunk(b * kh, t), blk.k.shape[2])
      run = fold_chunked(run, qg, blk, q_pos, window, c, scores, weighted)
  return ungroup(run[2] / run[1], q)


def unlimited_first(q, blocks, q_pos, window, softcap):
  """What the kernels' paths share: the running state after the blocks without a limit (read
  whole), the grouped queries and each grouped row's position [B, T*G]."""
  kh = blocks[0].k.shape[1]
  scores, weighted = chunked_parts(q, softcap)
  run = start_state(q, kh, [blk for blk in blocks if blk.limit is None], q_pos, window, scores, weighted)
  return kh, scores, weighted, run, group(q, kh), jnp.repeat(q_pos, q.shape[2] // kh, axis=1)
