"""jaxgen's CPU kernels for projections ("cpu"): a bf16 matmul for decode-sized row counts and an
int8 matmul that reads int8 blocks as stored (`kernels.cpu_kernels`); what they do not take runs
as XLA:CPU's formulation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxgen.model import quant
from jaxgen.model.kernels import cpu_kernels
from jaxgen.model.kernels.matmul.xla_cpu import int8_xla_cpu, matmul_xla_cpu


def kernel_takes(x: jax.Array, w: jax.Array) -> bool:
  """Whether `cpu_kernels.matmul` serves this product: bf16 weights under wider activations,
  2..MAX_ROWS rows (one row is XLA's fused matvec; prompt chunks are large matmuls, which XLA runs
  well), an input size the kernel's 32-wide steps divide."""
  rows = math.prod(x.shape[:-1])
  return (w.dtype == jnp.bfloat16 and x.dtype != w.dtype and 1 < rows <= cpu_kernels.MAX_ROWS
          and w.shape[1] % 32 == 0)


def matmul_cpu(x: jax.Array, w: jax.Array) -> jax.Array:
  if not kernel_takes(x, w):
    return matmul_xla_cpu(x, w)
  rows = math.prod(x.shape[:-1])
  y = cpu_kernels.matmul(x.reshape(rows, -1).astype(w.dtype), w)
  return y.reshape(*x.shape[:-1], w.shape[0]).astype(x.dtype)


def int8_kernel_takes(x: jax.Array, w: jax.Array, scale: jax.Array) -> bool:
  """Whether `cpu_kernels.int8_matmul` serves this product: float32 activations and blocks of 32.
  Any row count: prompt chunks too, where dequantizing the weight for XLA's matmul costs more than
  the kernel's extra conversions (docs/performance.md)."""
  return x.dtype == jnp.float32 and scale.ndim == 2 and scale.shape[1] * quant.GROUP == w.shape[1]


def int8_cpu(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
  if not int8_kernel_takes(x, w, scale):
    return int8_xla_cpu(x, w, scale)
  rows = math.prod(x.shape[:-1])
  y = cpu_kernels.int8_matmul(x.reshape(rows, -1), w, scale)
  return y.reshape(*x.shape[:-1], w.shape[0])
