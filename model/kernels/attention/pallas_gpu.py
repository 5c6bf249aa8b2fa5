"""The ragged cache attention of `pallas.py`, written for GPUs (Pallas' Triton backend).

What the TPU kernel does with a grid over cache blocks and scalar prefetch, a GPU program does
with a loop: one program per (batch row, kv head) loads the row's cache row number and length,
then walks that row's filled entries `BLOCK_GPU` at a time (the loop stops at the row's length,
so a step reads what its rows hold). Keys and values are read from global memory where they lie,
a block per iteration, through masked loads; only the running softmax state and one block of
keys and values are live on chip, so it fits a streaming multiprocessor's shared memory whatever
the cache's length (the TPU kernel lowered for GPU staged whole blocks and overflowed it).

Triton's shapes are powers of two and a dot's sides at least 16: the query rows (G heads x T
queries of one kv head) are padded to that, the padding masked. Positions follow from each row's
length as in `pallas.py` (`block.held_position`). An int8 cache is not handled here
(`attention.attention_pallas` says so).
Interpret mode runs it on CPU for tests; `jaxgen plan --target gpu-h100-1 --attention-impl pallas`
compiles it for an H100 without one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxgen.model.kernels.attention.block import capped, held_position
from jaxgen.model.layers import NEG_INF

BLOCK_GPU = 64  # cache entries per loop iteration


def _kernel(rows_ref, start_ref, length_ref, q_pos_ref, q_ref, k_ref, v_ref, m_in, l_in, acc_in,
            m_ref, l_ref, acc_ref, *, size: int, block: int, ring: int | None, window: int | None,
            softcap: float | None):
  """One (batch row i, kv head j) program: fold the row's entries [0, length) into the state."""
  i, j = pl.program_id(0), pl.program_id(1)
  row, n, length = rows_ref[i], start_ref[i], length_ref[i]
  q = q_ref[...]  # [R, H]
  q_pos = q_pos_ref[...][:, None]  # [R, 1]; padding rows hold -1 and see nothing

  def body(c, carry):
    m_prev, l_prev, acc_prev = carry
    idx = c * block + jnp.arange(block, dtype=jnp.int32)  # [C]
    inside = idx < size
    k = plgpu.load(k_ref.at[row, j, pl.ds(c * block, block), :], mask=inside[:, None], other=0.0)
    v = plgpu.load(v_ref.at[row, j, pl.ds(c * block, block), :], mask=inside[:, None], other=0.0)
    s = plgpu.dot(q, k.astype(q.dtype).T)  # [R, C] float32
    s = capped(s, softcap)
    k_pos = held_position(idx, n, ring)[None, :]
    visible = (k_pos >= 0) & (k_pos <= q_pos) & (idx < length)[None, :]
    if window is not None:
      visible &= q_pos - k_pos < window
    s = jnp.where(visible, s, NEG_INF)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])
    p = jnp.exp(s - m_new)
    scale = jnp.exp(m_prev - m_new)
    acc = acc_prev * scale + plgpu.dot(p.astype(q.dtype), v.astype(q.dtype))
    return m_new, l_prev * scale + jnp.sum(p, axis=1)[:, None], acc

  state = (m_in[...], l_in[...], acc_in[...])
  m, l, acc = jax.lax.fori_loop(0, pl.cdiv(length, block), body, state)
  m_ref[...], l_ref[...], acc_ref[...] = m, l, acc


def cache_attention_gpu(run, qg, k, v, q_pos, start, length, rows, *, ring: int | None, window: int | None,
                        softcap: float | None, k_scale=None, v_scale=None, interpret: bool = False):
  """As `pallas.cache_attention` (same arguments and result), for a float cache on GPU."""
  if k_scale is not None or v_scale is not None:
    raise ValueError("the GPU kernel reads a float cache; an int8 cache takes attention_impl='xla'")
  b, kh, r, h = qg.shape
  size = k.shape[2]
  rp = max(16, 1 << (r - 1).bit_length())  # query rows: a power of two, at least a dot's 16
  pad = ((0, 0), (0, 0), (0, rp - r), (0, 0))
  qg = jnp.pad(qg, pad)
  q_pos = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, rp - r)), constant_values=-1)
  run = [jnp.pad(x, pad) for x in run]
  whole = pl.BlockSpec(memory_space=pl.ANY)  # the cache stays where it is; the kernel indexes it
  state = lambda last: pl.BlockSpec((None, None, rp, last), lambda i, j: (i, j, 0, 0))  # noqa: E731
  scalar = pl.BlockSpec((b,), lambda i, j: (0,))
  kernel = functools.partial(_kernel, size=size, block=BLOCK_GPU, ring=ring, window=window, softcap=softcap)
  m, l, acc = pl.pallas_call(
      kernel,
      grid=(b, kh),
      in_specs=[scalar, scalar, scalar, pl.BlockSpec((None, rp), lambda i, j: (i, 0)), state(h), whole, whole,
                state(1), state(1), state(h)],
      out_specs=[state(1), state(1), state(h)],
      out_shape=[jax.ShapeDtypeStruct((b, kh, rp, 1), jnp.float32), jax.ShapeDtypeStruct((b, kh, rp, 1), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, rp, h), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="cache_attention_gpu",
  )(rows.astype(jnp.int32), start.astype(jnp.int32), length.astype(jnp.int32), q_pos, qg, k, v, *run)
  return m[:, :, :r], l[:, :, :r], acc[:, :, :r]
