"""Component numerics against numpy: RMSNorm, RoPE, GELU, masks (hand-written), attention."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.model import layers as L

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_numpy(offset):
  x = RNG.normal(size=(2, 3, 8)).astype(np.float32)
  w = RNG.normal(size=(8,)).astype(np.float32)
  want = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * (offset + w)
  np.testing.assert_allclose(L.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6, offset), want, rtol=1e-5, atol=1e-6)


def test_rope_matches_numpy_rotate_half():
  b, t, n, h = 1, 5, 2, 8
  x = RNG.normal(size=(b, t, n, h)).astype(np.float32)
  pos = np.array([[0, 1, 2, 7, 100]])
  base, scale = 10_000.0, 2.0
  inv = 1.0 / base ** (np.arange(0, h, 2) / h)
  ang = (pos[..., None] / scale) * inv  # [B, T, H/2]
  cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
  x1, x2 = x[..., : h // 2], x[..., h // 2:]
  want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  np.testing.assert_allclose(L.rope(jnp.asarray(x), jnp.asarray(pos), base, scale), want, rtol=1e-5, atol=1e-5)
  # Position 0 is the identity; the rotation preserves norms.
  np.testing.assert_allclose(np.asarray(L.rope(jnp.asarray(x), jnp.asarray(pos), base))[:, 0], x[:, 0], atol=1e-6)


def test_gelu_tanh_matches_numpy():
  x = np.linspace(-6, 6, 101).astype(np.float32)
  want = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
  np.testing.assert_allclose(L.gelu_tanh(jnp.asarray(x)), want, rtol=1e-5, atol=1e-6)


def test_causal_mask_hand_written():
  pos = jnp.arange(4)[None]
  want = np.array([[1, 0, 0, 0],
                   [1, 1, 0, 0],
                   [1, 1, 1, 0],
                   [1, 1, 1, 1]], bool)
  np.testing.assert_array_equal(L.attention_mask(pos, pos, None)[0], want)


def test_sliding_window_mask_hand_written():
  # Window 3: a query sees itself and the 2 keys before it.
  pos = jnp.arange(6)[None]
  want = np.array([[1, 0, 0, 0, 0, 0],
                   [1, 1, 0, 0, 0, 0],
                   [1, 1, 1, 0, 0, 0],
                   [0, 1, 1, 1, 0, 0],
                   [0, 0, 1, 1, 1, 0],
                   [0, 0, 0, 1, 1, 1]], bool)
  np.testing.assert_array_equal(L.attention_mask(pos, pos, 3)[0], want)


def test_mask_ignores_empty_entries_and_future_positions():
  q = jnp.array([[5]])
  k = jnp.array([[3, -1, 5, 6, 4]])  # -1: an empty cache entry; 6: after the query
  np.testing.assert_array_equal(L.attention_mask(q, k, None)[0, 0], [1, 0, 1, 0, 1])
  np.testing.assert_array_equal(L.attention_mask(q, k, 2)[0, 0], [0, 0, 1, 0, 1])


def _numpy_attention(q, kk, v, mask, softcap=None):
  """q [B,T,N,H], kk/v [B,K,S,H], mask [B,T,S] -> [B,T,N,H]."""
  b, t, n, h = q.shape
  g = n // kk.shape[1]
  out = np.zeros_like(q)
  for r in range(b):
    for head in range(n):
      sc = q[r, :, head] @ kk[r, head // g].T
      if softcap is not None:
        sc = np.tanh(sc / softcap) * softcap
      sc = np.where(mask[r], sc, -np.inf)
      p = np.exp(sc - sc.max(-1, keepdims=True))
      out[r, :, head] = (p / p.sum(-1, keepdims=True)) @ v[r, head // g]
  return out


def test_grouped_attention_matches_numpy():
  b, t, s, n, k, h = 1, 3, 5, 4, 2, 8
  q = RNG.normal(size=(b, t, n, h)).astype(np.float32)
  kk = RNG.normal(size=(b, k, s, h)).astype(np.float32)
  v = RNG.normal(size=(b, k, s, h)).astype(np.float32)
  mask = RNG.random((b, t, s)) > 0.3
  mask[..., 0] = True
  pos = jnp.broadcast_to(jnp.arange(s), (b, s))
  blocks = [(jnp.asarray(kk[:, :, :2]), jnp.asarray(v[:, :, :2]), pos[:, :2]),  # split in two blocks
            (jnp.asarray(kk[:, :, 2:]), jnp.asarray(v[:, :, 2:]), pos[:, 2:])]
  mask_fn = lambda k_pos: jnp.asarray(mask)[:, :, k_pos[0]]  # noqa: E731
  out = np.asarray(L.attend(jnp.asarray(q), blocks, mask_fn, None))
  np.testing.assert_allclose(out, _numpy_attention(q, kk, v, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("limit, chunk", [(13, 4), (12, 4), (3, 8), (20, 6), (1, 3)])
def test_attention_read_in_chunks_up_to_a_limit_matches_numpy(limit, chunk):
  """A cache block with a limit is folded in `chunk` keys at a time (online softmax); keys past
  the limit are never read, including when the last chunk is moved back to fit (20 keys, 6).
  Chunks of 6 and 8 keys outnumber the 4 query rows (T x G), so their score matmul takes the
  keys-on-the-left form that decode uses; chunks of 3 and 4 take the queries-on-the-left one."""
  b, t, s, n, k, h = 2, 2, 20, 4, 2, 8
  q = RNG.normal(size=(b, t, n, h)).astype(np.float32)
  kk = RNG.normal(size=(b, k, s + t, h)).astype(np.float32)
  v = RNG.normal(size=(b, k, s + t, h)).astype(np.float32)
  pos = np.where(np.arange(s) < limit, np.arange(s), -1)[None].repeat(b, 0)
  pos[1, limit // 2:] = -1  # a shorter row
  q_pos = limit + np.arange(t)[None].repeat(b, 0)  # the new tokens, after the cache
  k_pos = np.concatenate([pos, q_pos], axis=1)
  mask = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])
  # Past the chunk that holds the limit, values are NaN: reading them would make the output NaN.
  v[:, :, -(-limit // chunk) * chunk:s] = np.nan
  blocks = [(jnp.asarray(kk[:, :, :s]), jnp.asarray(v[:, :, :s]), jnp.asarray(pos), jnp.int32(limit)),
            (jnp.asarray(kk[:, :, s:]), jnp.asarray(v[:, :, s:]), jnp.asarray(q_pos))]
  for softcap in (None, 5.0):
    out = np.asarray(L.attend(jnp.asarray(q), blocks, lambda kp: L.attention_mask(jnp.asarray(q_pos), kp, None),
                              softcap, chunk=chunk))
    np.testing.assert_allclose(out, _numpy_attention(q, kk, np.nan_to_num(v), mask, softcap), rtol=1e-5, atol=1e-5)


def test_attention_with_only_a_chunked_block():
  b, t, s, n, k, h = 1, 1, 10, 2, 1, 4
  q = RNG.normal(size=(b, t, n, h)).astype(np.float32)
  kk = RNG.normal(size=(b, k, s, h)).astype(np.float32)
  v = RNG.normal(size=(b, k, s, h)).astype(np.float32)
  pos = jnp.arange(s)[None]
  out = L.attend(jnp.asarray(q), [(jnp.asarray(kk), jnp.asarray(v), pos, jnp.int32(s))],
                 lambda p: jnp.ones((b, t, p.shape[1]), bool), None, chunk=4)
  np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, kk, v, np.ones((b, t, s), bool)), rtol=1e-5, atol=1e-5)
