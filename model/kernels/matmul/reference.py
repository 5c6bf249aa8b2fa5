"""The plain-XLA projection, the reference: equal dtypes make one matmul (16-bit operands
accumulating in float32); weights narrower than the activations are widened first. What TPU and
GPU run. An int8 weight is dequantized into the activations' dtype as the dot's operand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxgen.model import quant


def matmul_xla(x: jax.Array, w: jax.Array) -> jax.Array:
  if w.dtype != x.dtype:
    w = w.astype(x.dtype)
  if x.dtype == jnp.float32:
    return x @ w.T
  dims = (((x.ndim - 1,), (1,)), ((), ()))
  return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(x.dtype)


def int8_xla(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
  """x . (int8 w with block scales)^T: dequantized into x's dtype inside the product (XLA fuses the
  convert and multiply into the dot's operand on TPU and GPU)."""
  return matmul_xla(x, quant.dequantize(w, scale, x.dtype))
