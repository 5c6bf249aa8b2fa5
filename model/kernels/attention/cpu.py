"""The CPU kernel's attention ("cpu"): limited float32 blocks folded in where they lie by jaxgen's
C++ kernel (`kernels.cpu_kernels.cache_attention`); every other block as XLA:CPU's formulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxgen.model.kernels import cpu_kernels
from jaxgen.model.kernels.attention.block import KVBlock, ungroup
from jaxgen.model.kernels.attention.xla_cpu import cpu_chunk, fold_chunked, unlimited_first


def kernel_takes(q: jax.Array, blk: KVBlock) -> bool:
  """Whether `cpu_kernels.cache_attention` folds this block in: a limited float32 block, float32
  queries, a head dim its 16-lane vectors divide, and decode-sized query rows per kv head (a prompt
  chunk's many rows are real matmuls, which XLA runs well)."""
  t, n, h = q.shape[1:]
  rows = t * (n // blk.k.shape[1])
  return (blk.limit is not None and q.dtype == blk.k.dtype == blk.v.dtype == jnp.float32 and h % 16 == 0
          and rows <= cpu_kernels.MAX_ROWS)


def attention_cpu(q, blocks, q_pos, window, softcap, platform=None):
  """Limited float32 blocks through the CPU kernel (read in place); the rest as "xla_chunked"."""
  b, t, n, h = q.shape
  kh, scores, weighted, run, qg, q_rows = unlimited_first(q, blocks, q_pos, window, softcap)
  for blk in blocks:
    if blk.limit is None:
      continue
    if kernel_takes(q, blk):
      k, v = (blk.k, blk.v) if blk.rows is None else (jnp.take(blk.k, blk.rows, axis=0), jnp.take(blk.v, blk.rows, axis=0))
      run = cpu_kernels.cache_attention(qg, k, v, blk.pos, q_rows, blk.limit, run, window, softcap)
    else:
      c = min(cpu_chunk(b * kh, t), blk.k.shape[2])
      run = fold_chunked(run, qg, blk, q_pos, window, c, scores, weighted)
  return ungroup(run[2] / run[1], q)
