"""Attention over blocks of keys: one entry point, the plain-XLA reference, and the backends.

`attention(q, blocks, q_pos, window, softcap, platform)` is what a decoder layer calls; the
`Platform` names the implementation (`IMPLS`, one module each, beside the reference), chosen once
when an engine is built:

- "xla" (`reference.py`): the plain formulation and the reference. Scores of every block are joined, masked and
  softmaxed in one piece; each block is read whole. What TPU and GPU run.
- "xla_chunked" (`xla_cpu.py`): XLA:CPU's formulation. A block that carries a `limit` (a cache) is folded into a
  running softmax a few keys at a time up to that limit, so a mostly empty cache costs what its
  filled part does; its chunk sizes and score-matmul operand order suit XLA:CPU (docs/performance.md).
- "cpu": jaxgen's own kernel (`cpu.py`, `kernels.cpu_kernels.cache_attention`) folds limited float32 blocks in where
  they lie; every other block takes the "xla_chunked" path.
- "pallas": a Pallas kernel (`pallas.py`) folds each row's cache up to that
  row's own length (ragged); other blocks as the reference. For TPU and GPU; interpret mode on CPU.

A block is a `KVBlock`: keys and values [B', K, S, H] of which the batch reads the rows `rows`
(None: the first B), key positions [B, S] (-1: empty), and optionally `limit` (no key at index
>= limit is visible to any row). An int8 block (an int8 cache) carries the scales of its key and
value vectors and is dequantized into the queries' dtype as it is read (`block.py`).
Visibility is causal, within `window` when given:
`layers.attention_mask`. Query head n reads kv head n // G (G = N / K).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jaxgen.model.kernels.attention.block import KVBlock, read_rows
from jaxgen.model.kernels.attention.cpu import attention_cpu, kernel_takes
from jaxgen.model.kernels.attention.pallas import attention_pallas
from jaxgen.model.kernels.attention.reference import attention_xla
from jaxgen.model.kernels.attention.xla_cpu import attention_xla_chunked, cpu_chunk, fold_chunked

__all__ = ["KVBlock", "IMPLS", "attention", "attention_cpu", "attention_pallas", "attention_xla",
           "attention_xla_chunked", "cpu_chunk", "fold_chunked", "kernel_takes", "read_rows"]


def attention(q: jax.Array, blocks: Sequence[KVBlock], q_pos: jax.Array, window: int | None,
              softcap: float | None, platform) -> jax.Array:
  """q [B, T, N, H] (already scaled), q_pos [B, T] -> [B, T, N, H] in q's dtype."""
  return IMPLS[platform.attention](q, blocks, q_pos, window, softcap, platform)


IMPLS: dict[str, Callable] = {"xla": attention_xla, "xla_chunked": attention_xla_chunked, "cpu": attention_cpu,
                              "pallas": attention_pallas}
