"""Projections `x @ w.T` (weights stored [out, in]): one entry point, the plain-XLA reference, and
the backends. The `Platform` names the implementation (`IMPLS`), chosen once:

- "xla": the plain formulation and the reference. Equal dtypes: one matmul, 16-bit operands
  accumulating in float32. Weights narrower than the activations are widened first.
  What TPU and GPU run (there, activations and weights share the weights' dtype).
- "xla_cpu": XLA:CPU with 16-bit weights under float32 activations, where the same math runs
  10-40x apart by formulation (see `_matmul_xla_cpu`). A performance decision, not a numerical one.
- "cpu": jaxgen's bf16 kernel (`cpu_kernels.matmul`) for decode-sized row counts; the rest as
  "xla_cpu".

Every implementation returns x's dtype.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jaxgen.model import cpu_kernels, quant


def matmul(x: jax.Array, w: jax.Array, platform) -> jax.Array:
  """x [..., in] . w [out, in]^T -> [..., out] in x's dtype."""
  return IMPLS[platform.matmul](x, w)


def project(x: jax.Array, w: jax.Array, scale: jax.Array | None, platform) -> jax.Array:
  """x [..., in] . w [out, in]^T, where an int8 w with its block scales [out, in / G] is
  dequantized into x's dtype inside the product (see `model.quant`; XLA fuses the convert and
  multiply into the dot's operand on TPU and GPU). The "cpu" matmul takes int8 products to
  `cpu_kernels.int8_matmul`, which reads the int8 blocks as stored."""
  if scale is None:
    return matmul(x, w, platform)
  if platform.matmul == "cpu" and int8_kernel_takes(x, w, scale):
    rows = math.prod(x.shape[:-1])
    y = cpu_kernels.int8_matmul(x.reshape(rows, -1), w, scale)
    return y.reshape(*x.shape[:-1], w.shape[0])
  return matmul(x, quant.dequantize(w, scale, x.dtype), platform)


def int8_kernel_takes(x: jax.Array, w: jax.Array, scale: jax.Array) -> bool:
  """Whether `cpu_kernels.int8_matmul` serves this product: float32 activations and blocks of 32.
  Any row count: prompt chunks too, where dequantizing the weight for XLA's matmul costs more than
  the kernel's extra conversions (docs/performance.md)."""
  return x.dtype == jnp.float32 and scale.ndim == 2 and scale.shape[1] * quant.GROUP == w.shape[1]


def matmul_xla(x: jax.Array, w: jax.Array) -> jax.Array:
  if w.dtype != x.dtype:
    w = w.astype(x.dtype)
  if x.dtype == jnp.float32:
    return x @ w.T
  dims = (((x.ndim - 1,), (1,)), ((), ()))
  return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(x.dtype)


def _matmul_xla_cpu(x: jax.Array, w: jax.Array) -> jax.Array:
  """A single row (batch-1 decode) upcasts the weight inside the matvec, which XLA:CPU fuses into
  one pass over the 16-bit bytes; more rows round the activations to the weight dtype and
  accumulate in float32 on the CPU's bf16 dot units. The other formulations are 10-40x slower."""
  if w.dtype == x.dtype:
    return x @ w.T
  if math.prod(x.shape[:-1]) == 1:
    return _materialize(x) @ w.astype(x.dtype).T
  dims = (((x.ndim - 1,), (1,)), ((), ()))
  return jax.lax.dot_general(x.astype(w.dtype), w, dims, preferred_element_type=jnp.float32).astype(x.dtype)


def _materialize(x: jax.Array) -> jax.Array:
  """x, computed once into its own buffer before a fused matvec reads it.

  XLA:CPU fuses the producers of a small vector into the matrix-vector product that consumes it
  and then evaluates them once per output row (10x slower for the attention output feeding `o`).
  A reduction is never fused into its consumer, so x goes through one (an exact identity: x + 0).
  """
  return jnp.sum(jnp.stack([x, jnp.zeros_like(x)]), axis=0)


def kernel_takes(x: jax.Array, w: jax.Array) -> bool:
  """Whether `cpu_kernels.matmul` serves this product: bf16 weights under wider activations,
  2..MAX_ROWS rows (one row is XLA's fused matvec; prompt chunks are large matmuls, which XLA runs
  well), an input size the kernel's 32-wide steps divide."""
  rows = math.prod(x.shape[:-1])
  return (w.dtype == jnp.bfloat16 and x.dtype != w.dtype and 1 < rows <= cpu_kernels.MAX_ROWS
          and w.shape[1] % 32 == 0)


def _matmul_cpu(x: jax.Array, w: jax.Array) -> jax.Array:
  if not kernel_takes(x, w):
    return _matmul_xla_cpu(x, w)
  rows = math.prod(x.shape[:-1])
  y = cpu_kernels.matmul(x.reshape(rows, -1).astype(w.dtype), w)
  return y.reshape(*x.shape[:-1], w.shape[0]).astype(x.dtype)


# What serves a product with int8 weights (`quantization="int8"`), by the platform's matmul:
INT8_IMPLS = {
    "cpu": "jaxgen's int8 kernel (reads the int8 blocks as stored; VNNI dot products over activations "
           "split into two int8 parts per group of 4)",
    "xla": "int8 blocks dequantized into the activations' dtype as the dot's operand (XLA fuses it "
           "into the dot on TPU and GPU)",
    "xla_cpu": "int8 blocks dequantized into the activations' dtype, then XLA:CPU's matmul",
}

IMPLS: dict[str, Callable] = {"xla": matmul_xla, "xla_cpu": _matmul_xla_cpu, "cpu": _matmul_cpu}
