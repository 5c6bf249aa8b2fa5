"""Pure building blocks of the decoder: norms, RoPE, activations, masks and attention.

Everything here is a plain function of arrays; the modules in `transformer.py` hold the weights.
Statistics (norms, softmax) are computed in float32 whatever the parameter dtype.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxgen.model import cpu_kernels

# A mask value that survives bf16 and soft-capping, and exp() of which is exactly 0 in float32.
NEG_INF = -2.3819763e38


def attn_chunk(rows: int, queries: int) -> int:
  """Keys per step when `attend` reads a cache block up to its filled length.

  rows: batch x kv heads read together; queries: query tokens per row. Measured on XLA:CPU: a
  decode step over many rows is fastest in 64-key steps (batch 16: 0.8 ms per layer, 2.4 ms in
  256-key steps), one over a few rows in 128-key steps; a prompt chunk's many queries make each
  step a real matmul, which larger steps feed better.
  """
  if queries > 1:
    return 256
  return 128 if rows <= 4 else 64


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
         llama3: tuple[float, float, float, int] | None = None) -> jax.Array:
  """Rotary embedding in the rotate-half layout (first and second halves of H are the pairs).

  x: [B, T, N, H]; positions: [B, T] (int). `scale` divides positions (linear scaling); `llama3`
  rescales the frequencies (`llama3_frequencies` arguments after `inv_freq`).
  """
  h = x.shape[-1]
  inv_freq = 1.0 / (base ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [H/2]
  if llama3 is not None:
    inv_freq = llama3_frequencies(inv_freq, *llama3)
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


@dataclasses.dataclass(frozen=True)
class CausalMask:
  """`attention_mask(q_pos, ., window)` as a function of key positions, its arguments visible (the
  CPU attention kernel applies the same rule itself). q_pos: [B, T]."""

  q_pos: jax.Array
  window: int | None

  def __call__(self, k_pos: jax.Array) -> jax.Array:
    return attention_mask(self.q_pos, k_pos, self.window)


def attend(q: jax.Array, blocks, mask_fn, softcap: float | None, chunk: int | None = None) -> jax.Array:
  """Grouped-query attention over one or more blocks of keys. q: [B, T, N, H] (already scaled).

  blocks: [(k [B, K, S_i, H], v [B, K, S_i, H], key positions [B, S_i][, limit])], e.g. a cache
  and the new tokens: scores are joined, never the keys, so a cache is read where it lies and not
  copied. A block with a `limit` (traced int: no key at index >= limit is visible to any row) is
  read `chunk` keys (default `attn_chunk`) at a time up to the limit (online softmax), so a mostly
  empty cache costs what its filled part does. mask_fn(key positions) -> bool [B, T, S_i]; with a
  `CausalMask`, float32 decode queries and cache, the limited blocks go to `cpu_kernels.
  cache_attention` where it fits the process (same rule, no copies of the cache).
  Returns [B, T, N, H].
  Query head n uses kv head n // G (G = N / K): the G heads and T queries of one kv head are the
  rows of one matmul batched over (B, K).
  """
  b, t, n, h = q.shape
  kh = blocks[0][0].shape[1]
  g = n // kh
  chunk = chunk or attn_chunk(b * kh, t)
  qg = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h)  # [B, K, T*G, H]
  # Scores and softmax in float32. (Asking XLA:CPU for float32 output of float32 inputs still
  # costs ~10x in these batched dots, so the preference is only stated for 16-bit inputs.)
  acc = None if q.dtype == jnp.float32 else jnp.float32

  def scores(k, pos):  # -> [B, K, T*G, S] float32, masked
    dims = (((3,), (3,)), ((0, 1), (0, 1)))
    if t * g < k.shape[2]:
      # Fewer queries than keys (decode): keys on the left. XLA:CPU's batched matmul runs 2-3x
      # faster with the longer side as its rows; the transpose back is of the small result.
      s = jax.lax.dot_general(k.astype(q.dtype), qg, dims, preferred_element_type=acc).swapaxes(2, 3)
    else:
      s = jax.lax.dot_general(qg, k.astype(q.dtype), dims, preferred_element_type=acc)
    if softcap is not None:
      s = jnp.tanh(s / softcap) * softcap
    mask_rows = jnp.repeat(mask_fn(pos), g, axis=1)[:, None]  # [B, 1, T*G, S]: row t*G + g is query t
    return jnp.where(mask_rows, s.astype(jnp.float32), NEG_INF)

  def weighted(p, v):  # [B, K, T*G, S] x [B, K, S, H] -> [B, K, T*G, H] float32
    pv = jax.lax.dot_general(p.astype(q.dtype), v.astype(q.dtype), (((3,), (2,)), ((0, 1), (0, 1))),
                             preferred_element_type=acc)
    return pv.astype(jnp.float32)

  # One softmax over all blocks, kept as a running (max, sum of exp, exp-weighted sum of values)
  # per query row: the plain blocks start it, each limited block is folded in chunk by chunk.
  plain = [blk[:3] for blk in blocks if len(blk) == 3 or blk[3] is None]
  limited = [blk for blk in blocks if len(blk) == 4 and blk[3] is not None]
  zeros = jnp.zeros((b, kh, t * g, 1), jnp.float32)
  run = (zeros + NEG_INF, zeros, jnp.zeros((b, kh, t * g, h), jnp.float32))
  if plain:
    s = jnp.concatenate([scores(k, pos) for k, _, pos in plain], axis=-1)  # [B, K, T*G, sum S_i]
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    total, at = run[2], 0
    for k, v, _ in plain:
      total = total + weighted(p[..., at:at + k.shape[2]], v)
      at += k.shape[2]
    run = (m, jnp.sum(p, axis=-1, keepdims=True), total)
  for k, v, pos, limit in limited:
    if _cpu_attention_fits(qg, k, v, mask_fn):
      q_rows = jnp.repeat(mask_fn.q_pos, g, axis=1)  # [B, T*G]
      run = cpu_kernels.cache_attention(qg, k, v, pos, q_rows, limit, run, mask_fn.window, softcap)
    else:
      run = _online_blocks(run, k, v, pos, limit, min(chunk, k.shape[2]), scores, weighted)
  out = run[2] / run[1]
  return out.reshape(b, kh, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h).astype(q.dtype)


def reads_cache_in_place(dtype, head_dim: int, query_rows: int = 1) -> bool:
  """Whether `attend` folds a limited block (a decode step's cache) in through the CPU attention
  kernel: float32 keys and values, a head dim the kernel's 16-lane vectors divide, decode-sized
  query rows per kv head (a prompt chunk's many rows are real matmuls, which XLA runs well)."""
  return (jnp.dtype(dtype) == jnp.float32 and head_dim % 16 == 0 and query_rows <= cpu_kernels.MAX_ROWS
          and cpu_kernels.fits_this_process())


def _cpu_attention_fits(qg: jax.Array, k: jax.Array, v: jax.Array, mask_fn) -> bool:
  """`reads_cache_in_place` for float32 queries and a mask whose rule the kernel knows."""
  return (isinstance(mask_fn, CausalMask) and qg.dtype == k.dtype == v.dtype
          and reads_cache_in_place(k.dtype, qg.shape[3], qg.shape[2]))


def _online_blocks(run, k, v, pos, limit, c: int, scores, weighted):
  """Folds keys [0, limit) of one block into a running (max, sum, weighted sum), c keys a step.

  The loop runs ceil(limit / c) times. Its last window is moved back to end at the block's end
  when it would overrun (a slice cannot), and keys it already folded in are masked out.
  """
  size = k.shape[2]

  def body(carry):
    i, (m, l, acc) = carry
    at = jnp.minimum(i * c, size - c)
    s = scores(jax.lax.dynamic_slice_in_dim(k, at, c, axis=2), jax.lax.dynamic_slice_in_dim(pos, at, c, axis=1))
    s = jnp.where(at + jnp.arange(c) >= i * c, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - m_new)
    scale = jnp.exp(m - m_new)
    acc = acc * scale + weighted(p, jax.lax.dynamic_slice_in_dim(v, at, c, axis=2))
    return i + 1, (m_new, l * scale + jnp.sum(p, axis=-1, keepdims=True), acc)

  _, run = jax.lax.while_loop(lambda carry: carry[0] * c < limit, body, (jnp.int32(0), run))
  return run


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
  """x @ w.T with the weight stored [out, in]; returns x's dtype.

  Same dtypes: a plain matmul. 16-bit weights under float32 activations (XLA:CPU, where jaxgen
  keeps activations float32) take the formulation measured fastest for the shape (README,
  Performance): a single row (batch-1 decode) upcasts the weight inside the matvec, which XLA
  fuses into one pass over the 16-bit bytes; more rows round the activations to the weight dtype
  and accumulate in float32 on the CPU's bf16 dot units, through jaxgen's own kernel
  (`cpu_kernels`) where it can run, else through XLA's matmul. The other choices are 10-40x slower
  (XLA:CPU's cliffs), so this is a performance decision, not a numerical one.
  """
  if w.dtype == x.dtype:
    return x @ w.T
  rows = math.prod(x.shape[:-1])
  if rows == 1:
    return _materialize(x) @ w.astype(x.dtype).T
  if _cpu_kernel_fits(rows, w):
    y = cpu_kernels.matmul(x.reshape(rows, -1).astype(w.dtype), w)
    return y.reshape(*x.shape[:-1], w.shape[0]).astype(x.dtype)
  dims = (((x.ndim - 1,), (1,)), ((), ()))
  return jax.lax.dot_general(x.astype(w.dtype), w, dims, preferred_element_type=jnp.float32).astype(x.dtype)


def _cpu_kernel_fits(rows: int, w: jax.Array) -> bool:
  """Whether `cpu_kernels.matmul` takes this product: bf16 weights, decode-sized row counts (prompt
  chunks are large matmuls, which XLA runs well), a K the kernel's 32-wide steps divide."""
  return (w.dtype == jnp.bfloat16 and rows <= cpu_kernels.MAX_ROWS and w.shape[1] % 32 == 0
          and cpu_kernels.fits_this_process())


def _materialize(x: jax.Array) -> jax.Array:
  """x, computed once into its own buffer before a fused matvec reads it.

  XLA:CPU fuses the producers of a small vector into the matrix-vector product that consumes it
  and then evaluates them once per output row (10x slower for the attention output feeding `o`).
  A reduction is never fused into its consumer, so x goes through one (an exact identity: x + 0).
  """
  return jnp.sum(jnp.stack([x, jnp.zeros_like(x)]), axis=0)
