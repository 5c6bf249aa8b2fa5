"""Pallas kernels for accelerators: ragged attention over a KV cache.

`cache_attention` folds each batch row's cached keys into a running softmax, reading only that
row's filled entries: the grid is (batch row, kv head), and each program loops over its row's
cache in chunks of `chunk` keys up to the row's own length (not the batch's longest). It handles
grouped-query heads (the G query heads and T queries of one kv head are one matmul's rows),
sliding-window ring layers (visibility from the entries' positions), soft-capping, rows read
through an index (`rows`: the cache slot of each batch row) and an int8 cache with its scales.

Its reference is `attention.fold_chunked` (plain XLA, the batch's longest length for every row);
`attention.attention_pallas` is the entry point behind the kernel interface. On CPU it runs in
Pallas' interpret mode (slow: for tests); on TPU and GPU it compiles (Mosaic, Triton).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxgen.model.layers import NEG_INF

CHUNK = 128  # keys per loop step; the last step is moved back to end at the cache's end


def _kernel(lengths_ref, rows_ref, q_pos_ref, q_ref, k_ref, v_ref, pos_ref, m_ref, l_ref, acc_ref, *scale_refs,
            chunk: int, window: int | None, softcap: float | None, out_refs_at: int):
  scales, (m_out, l_out, acc_out) = scale_refs[:out_refs_at], scale_refs[out_refs_at:]
  b, h = pl.program_id(0), pl.program_id(1)
  row = rows_ref[b]
  size = k_ref.shape[2]
  q = q_ref[0, 0].astype(jnp.float32)  # [R, H]
  q_pos = q_pos_ref[0]  # [R]

  def read(ref, scale_ref, at):
    x = ref[row, h, pl.ds(at, chunk), :].astype(jnp.float32)  # [C, H]
    if scale_ref is None:
      return x
    s = scale_ref[row, h, pl.ds(at, chunk), :]  # [C, H / Q]
    return (x.reshape(chunk, s.shape[-1], -1) * s[..., None]).reshape(x.shape)

  def body(i, carry):
    m, l, acc = carry
    at = jnp.minimum(i * chunk, size - chunk)
    k = read(k_ref, scales[0] if scales else None, at)
    v = read(v_ref, scales[1] if scales else None, at)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [R, C]
    if softcap is not None:
      s = jnp.tanh(s / softcap) * softcap
    k_pos = pos_ref[0, pl.ds(at, chunk)]  # [C]
    index = at + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
    visible = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None]) & (index >= i * chunk)
    if window is not None:
      visible &= q_pos[:, None] - k_pos[None, :] < window
    s = jnp.where(visible, s, NEG_INF)
    # Entries past the row's length are never weighted; zero them so that whatever they hold
    # (never written: not necessarily finite) cannot reach the sum as 0 * inf.
    v = jnp.where((index < lengths_ref[b]).reshape(chunk, 1), v, 0.0)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - m_new)
    scale = jnp.exp(m - m_new)
    acc = acc * scale + jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return m_new, l * scale + jnp.sum(p, axis=-1, keepdims=True), acc

  steps = (lengths_ref[b] + chunk - 1) // chunk
  m, l, acc = jax.lax.fori_loop(0, steps, body, (m_ref[0, 0], l_ref[0, 0], acc_ref[0, 0]))
  m_out[0, 0], l_out[0, 0], acc_out[0, 0] = m, l, acc


def cache_attention(run, qg, k, v, pos, q_rows, lengths, rows, *, window: int | None, softcap: float | None,
                    k_scale=None, v_scale=None, interpret: bool = False):
  """Folds each row's cache entries [0, lengths[b]) into the running softmax state.

  run: (m [B, K, R, 1], l [B, K, R, 1], acc [B, K, R, H]) float32; qg: [B, K, R, H] grouped
  queries; k, v: [B', K, S, H] (int8 with k_scale, v_scale [B', K, S, H / Q]); pos: [B, S] key
  positions (-1 empty); q_rows: [B, R] each query row's position; lengths: [B] entries to read;
  rows: [B] the cache row of each batch row. -> the new (m, l, acc).
  """
  b, kh, r, h = qg.shape
  size = k.shape[2]
  chunk = min(CHUNK, size)
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)  # noqa: E731  read where it lies
  per = lambda shape: pl.BlockSpec((1, 1) + shape, lambda i, j: (i, j) + (0,) * len(shape))  # noqa: E731
  row_of = lambda x: pl.BlockSpec((1,) + x.shape[1:], lambda i, j: (i,) + (0,) * (x.ndim - 1))  # noqa: E731
  scales = [s for s in (k_scale, v_scale) if s is not None]
  kernel = functools.partial(_kernel, chunk=chunk, window=window, softcap=softcap, out_refs_at=len(scales))
  return pl.pallas_call(
      kernel, grid=(b, kh),
      in_specs=[whole(lengths), whole(rows), row_of(q_rows), per((r, h)), whole(k), whole(v), row_of(pos),
                per((r, 1)), per((r, 1)), per((r, h))] + [whole(s) for s in scales],
      out_specs=[per((r, 1)), per((r, 1)), per((r, h))],
      out_shape=[jax.ShapeDtypeStruct((b, kh, r, 1), jnp.float32), jax.ShapeDtypeStruct((b, kh, r, 1), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, r, h), jnp.float32)],
      interpret=interpret,
  )(lengths, rows, q_rows, qg, k, v, pos, *run, *scales)
