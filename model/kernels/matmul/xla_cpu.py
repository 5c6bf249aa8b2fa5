"""XLA:CPU's formulations ("xla_cpu") for 16-bit weights under float32 activations, where the
same math runs 10-40x apart by formulation. A performance decision, not a numerical one."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxgen.model import quant


def matmul_xla_cpu(x: jax.Array, w: jax.Array) -> jax.Array:
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


def int8_xla_cpu(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
  """int8 blocks dequantized into the activations' dtype, then XLA:CPU's matmul."""
  return matmul_xla_cpu(x, quant.dequantize(w, scale, x.dtype))
