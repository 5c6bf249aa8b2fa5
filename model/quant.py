"""int8 weights: symmetric, one scale per block of 32 inputs of each output channel.

A quantized weight w [..., in] is stored as `values` int8 [..., in] and `scale` float32
[..., in / G]: each run of G = 32 consecutive inputs of one output channel shares a scale (the
layout of GGUF's Q8_0), w ~= values * scale repeated G times along the last axis. A weight whose
input size 32 does not divide gets one scale per output channel (G = in). Per block, absmax:
scale = max|w| / 127, values = round(w / scale) in [-127, 127] (-128 is never produced); a block
of zeros gets scale 1 and values 0 rather than a division by zero. Each entry's rounding error is
at most its scale / 2.

Why blocks and not one scale per channel: on the embedded model a scale per channel moves 5% of
the greedy choices on the golden prompts (mean KL 7e-3 nats); blocks of 32 keep 98% (KL 7e-4).
The price is that the scale cannot be applied after the dot: the weight is dequantized inside the
product (`matmul.project`), a convert and a multiply that XLA fuses into the dot's operand on TPU
and GPU.

Which parameters are quantized: the projections and the embedding / logits table (`QUANTIZED`);
norms and biases stay in the model's dtype. The scale is a parameter of its own, named
`{weight}_scale`, with the weight's logical axes, the last renamed `{axis}_groups` (sharded like
the axis it groups where the blocks divide evenly, replicated otherwise: see `sharding.rules`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxgen.model.config import WEIGHT_QUANTIZATIONS as QUANTIZATIONS

QUANTIZED = ("q", "kv", "o", "gate_up", "down", "embed", "unembed")  # leaf names of quantized weights
SCALE_SUFFIX = "_scale"
INT8_MAX = 127
GROUP = 32
KV_GROUP = 16  # the int8 KV cache's block (`model.kv`)


def group_size(in_dim: int, group: int = GROUP) -> int:
  """Inputs per scale: `group` where it divides the input size, else the whole row."""
  return group if in_dim % group == 0 else in_dim


def scale_axes(axes: tuple[str | None, ...]) -> tuple[str | None, ...]:
  """Logical axes of a weight's scale: the weight's, its last (input) axis grouped."""
  return axes[:-1] + (None if axes[-1] is None else axes[-1] + "_groups",)


def check(quantization) -> str | None:
  """`quantization` if it is supported; a ValueError naming the choices otherwise."""
  if quantization not in QUANTIZATIONS:
    raise ValueError(f"quantization={quantization!r} is not supported; choose one of {list(QUANTIZATIONS)}")
  return quantization


def is_quantized_name(name: str) -> bool:
  """Whether parameter `name` ("layers.3.q", "embed", ...) is stored int8 under int8 quantization."""
  return name.rsplit(".", 1)[-1] in QUANTIZED


def quantize_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Host: float [..., in] -> (int8 [..., in], float32 scale [..., in / G])."""
  w = np.asarray(w, np.float32)
  g = group_size(w.shape[-1])
  blocks = w.reshape(*w.shape[:-1], -1, g)
  amax = np.max(np.abs(blocks), axis=-1)
  scale = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
  values = np.clip(np.rint(blocks / scale[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
  return values.reshape(w.shape), scale


def quantize(w: jax.Array, group: int = GROUP) -> tuple[jax.Array, jax.Array]:
  """Device: the same as `quantize_np`, in jnp (blocks of `group` where it divides)."""
  w = w.astype(jnp.float32)
  blocks = w.reshape(*w.shape[:-1], -1, group_size(w.shape[-1], group))
  amax = jnp.max(jnp.abs(blocks), axis=-1)
  scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
  values = jnp.clip(jnp.round(blocks / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return values.reshape(w.shape), scale


def dequantize(values: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """int8 [..., in] and scale [..., in / G] -> [..., in] in `dtype`."""
  blocks = values.reshape(*values.shape[:-1], scale.shape[-1], -1).astype(dtype)
  return (blocks * scale[..., None].astype(dtype)).reshape(values.shape)
