"""Projections `x @ w.T` (weights stored [out, in]): one entry point, the plain-XLA reference, and
the backends. The `Platform` names the implementation (`IMPLS`), chosen once:

- "xla" (`reference.py`): the plain formulation and the reference. Equal dtypes: one matmul, 16-bit operands
  accumulating in float32. Weights narrower than the activations are widened first.
  What TPU and GPU run (there, activations and weights share the weights' dtype).
- "xla_cpu" (`xla_cpu.py`): XLA:CPU with 16-bit weights under float32 activations, where the same
  math runs 10-40x apart by formulation. A performance decision, not a numerical one.
- "cpu" (`cpu.py`): jaxgen's bf16 kernel for decode-sized row counts; the rest as "xla_cpu".

Int8 weights (`quantization="int8"`) go through the same names (`INT8_IMPLS`). Every
implementation returns x's dtype.
"""

from __future__ import annotations

from typing import Callable

import jax
from jaxgen.model.kernels.matmul.cpu import int8_cpu, int8_kernel_takes, kernel_takes, matmul_cpu
from jaxgen.model.kernels.matmul.reference import int8_xla, matmul_xla
from jaxgen.model.kernels.matmul.xla_cpu import int8_xla_cpu, matmul_xla_cpu

__all__ = ["IMPLS", "INT8_IMPLS", "INT8_REASONS", "int8_kernel_takes", "kernel_takes", "matmul", "matmul_xla", "project"]


def matmul(x: jax.Array, w: jax.Array, platform) -> jax.Array:
  """x [..., in] . w [out, in]^T -> [..., out] in x's dtype."""
  return IMPLS[platform.matmul](x, w)


def project(x: jax.Array, w: jax.Array, scale: jax.Array | None, platform) -> jax.Array:
  """x [..., in] . w [out, in]^T, where an int8 w carries its block scales [out, in / G] (see
  `model.quant`)."""
  if scale is None:
    return matmul(x, w, platform)
  return INT8_IMPLS[platform.matmul](x, w, scale)


IMPLS: dict[str, Callable] = {"xla": matmul_xla, "xla_cpu": matmul_xla_cpu, "cpu": matmul_cpu}
INT8_IMPLS: dict[str, Callable] = {"xla": int8_xla, "xla_cpu": int8_xla_cpu, "cpu": int8_cpu}

# What serves a product with int8 weights (`quantization="int8"`), by the platform's matmul:
INT8_REASONS = {
    "cpu": "jaxgen's int8 kernel (reads the int8 blocks as stored; VNNI dot products over activations "
           "split into two int8 parts per group of 4)",
    "xla": "int8 blocks dequantized into the activations' dtype as the dot's operand (XLA fuses it "
           "into the dot on TPU and GPU)",
    "xla_cpu": "int8 blocks dequantized into the activations' dtype, then XLA:CPU's matmul",
}
