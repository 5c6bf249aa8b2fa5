"""Pure building blocks of the decoder: norms, RoPE, activations and the attention mask.

Everything here is a plain function of arrays; the modules in `transformer.py` hold the weights,
`kernels/attention/` and `kernels/matmul/` the kernel ops. Statistics (norms, softmax) are computed in
float32 whatever the parameter dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A mask value that survives bf16 and soft-capping, and exp() of which is exactly 0 in float32.
NEG_INF = -2.3819763e38


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float) -> jax.Array:
  """x * rsqrt(mean(x^2) + eps) * (offset + w) over the last axis, in float32."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * (offset + w.astype(jnp.float32))).astype(x.dtype)


def gelu_tanh(x: jax.Array) -> jax.Array:
  """GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`)."""
  return jax.nn.gelu(x, approximate=True)


ACTIVATIONS = {"gelu_tanh": gelu_tanh, "silu": jax.nn.silu}


def llama3_frequencies(inv_freq: jax.Array, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original_context: int) -> jax.Array:
  """Llama 3.1's RoPE scaling: long wavelengths slowed by `factor`, short ones kept, a blend between.

  A wavelength above original_context / low_freq_factor is divided by `factor`; one below
  original_context / high_freq_factor is unchanged; in between the frequency interpolates linearly
  in original_context / wavelength from the scaled to the unscaled value.
  """
  wavelen = 2 * jnp.pi / inv_freq
  ratio = original_context / wavelen  # how many wavelengths fit in the original context
  blend = jnp.clip((ratio - low_freq_factor) / (high_freq_factor - low_freq_factor), 0.0, 1.0)
  return (1 - blend) * inv_freq / factor + blend * inv_freq


def rope(x: jax.Array, positions: jax.Array, base: float, scale: float = 1.0,
         llama3: tuple[float, float, float, int] | None = None,
         factors: tuple[float, ...] | None = None) -> jax.Array:
  """Rotary embedding in the rotate-half layout (first and second halves of H are the pairs).

  x: [B, T, N, H]; positions: [B, T] (int). `scale` divides positions (linear scaling); `llama3`
  rescales the frequencies (`llama3_frequencies` arguments after `inv_freq`); `factors` [H/2]
  divides each frequency (llama.cpp's `rope_freqs` tensor, the same scaling precomputed).
  """
  h = x.shape[-1]
  inv_freq = 1.0 / (base ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [H/2]
  if llama3 is not None:
    inv_freq = llama3_frequencies(inv_freq, *llama3)
  if factors is not None:
    inv_freq = inv_freq / jnp.asarray(factors, jnp.float32)
  angles = positions.astype(jnp.float32)[..., None] / scale * inv_freq  # [B, T, H/2]
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]  # [B, T, 1, H/2]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
  """Which keys each query may see. q_pos: [B, T], k_pos: [B, S] (-1 marks an empty slot).

  Causal: k <= q. Sliding window of W: additionally q - k < W (the query plus W-1 keys before it).
  Returns bool [B, T, S].
  """
  q, k = q_pos[:, :, None], k_pos[:, None, :]
  mask = (k >= 0) & (k <= q)
  if window is not None:
    mask &= q - k < window
  return mask
