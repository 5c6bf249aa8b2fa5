"""Component numerics against numpy: RMSNorm, RoPE, GELU, masks (hand-written), attention."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from jaxgen.model.kernels import cpu_kernels
from jaxgen.model import layers as L
from jaxgen.model.kernels.attention import IMPLS, KVBlock, attention, attention_xla_chunked
from jaxgen.model.platform import REFERENCE

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _fresh_rng():
  """Each test draws from its own seeded generator, whatever ran before it (or was deselected)."""
  global RNG
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
  # Position 0 is the identity; the rotation preserves norms at every position.
  rotated = np.asarray(L.rope(jnp.asarray(x), jnp.asarray(pos), base))
  np.testing.assert_allclose(rotated[:, 0], x[:, 0], atol=1e-6)
  np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
  assert not np.allclose(rotated[:, 1:], x[:, 1:], atol=1e-2)  # and it does rotate


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


def _platform(impl):
  if impl == "cpu" and not cpu_kernels.status().available:
    pytest.skip(f"the CPU kernels cannot run here: {cpu_kernels.status().reason}")
  return dataclasses.replace(REFERENCE, attention=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_attention_matches_numpy(impl):
  b, t, s, n, k, h = 1, 3, 5, 4, 2, 16
  q = RNG.normal(size=(b, t, n, h)).astype(np.float32)
  kk = RNG.normal(size=(b, k, s, h)).astype(np.float32)
  v = RNG.normal(size=(b, k, s, h)).astype(np.float32)
  k_pos = np.array([[0, 1, 2, -1, 3]])  # an empty entry
  q_pos = np.array([[1, 2, 3]])
  mask = (k_pos[:, None] >= 0) & (k_pos[:, None] <= q_pos[:, :, None])
  blocks = [KVBlock(jnp.asarray(kk[:, :, :2]), jnp.asarray(v[:, :, :2]), jnp.asarray(k_pos[:, :2])),  # two blocks
            KVBlock(jnp.asarray(kk[:, :, 2:]), jnp.asarray(v[:, :, 2:]), jnp.asarray(k_pos[:, 2:]))]
  out = np.asarray(attention(jnp.asarray(q), blocks, jnp.asarray(q_pos), None, None, _platform(impl)))
  np.testing.assert_allclose(out, _numpy_attention(q, kk, v, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("limit, chunk", [(13, 4), (12, 4), (3, 8), (20, 6), (1, 3)])
def test_attention_up_to_a_limit_matches_numpy(impl, limit, chunk):
  """A cache block with a limit: keys past it are invisible. XLA:CPU folds the block in `chunk`
  keys at a time (online softmax) and never reads past the chunk that holds the limit, including
  when the last chunk is moved back to fit (20 keys, 6): values there are NaN, so a read would
  show. Chunks of 6 and 8 keys outnumber the 4 query rows (T x G), so their score matmul takes the
  keys-on-the-left form that decode uses; chunks of 3 and 4 take the queries-on-the-left one.
  The batch reads rows 1 and 3 of a 4-row cache (`rows`)."""
  b, t, s, n, k, h = 2, 2, 20, 4, 2, 16
  q = RNG.normal(size=(b, t, n, h)).astype(np.float32)
  kk = RNG.normal(size=(b, k, s + t, h)).astype(np.float32)
  v = RNG.normal(size=(b, k, s + t, h)).astype(np.float32)
  pos = np.where(np.arange(s) < limit, np.arange(s), -1)[None].repeat(b, 0)
  pos[1, limit // 2:] = -1  # a shorter row
  q_pos = limit + np.arange(t)[None].repeat(b, 0)  # the new tokens, after the cache
  k_pos = np.concatenate([pos, q_pos], axis=1)
  mask = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])
  poisoned = v.copy()
  if impl != "xla":  # the reference reads every entry and masks what it may not see
    poisoned[:, :, -(-limit // chunk) * chunk:s] = np.nan
  cache_k = np.zeros((4, k, s, h), np.float32)
  cache_v = np.zeros((4, k, s, h), np.float32)
  cache_k[[1, 3]], cache_v[[1, 3]] = kk[:, :, :s], poisoned[:, :, :s]
  start = jnp.array([limit, limit // 2], jnp.int32)  # what each row held: the positions above (the Pallas kernel's input)
  blocks = [KVBlock(jnp.asarray(cache_k), jnp.asarray(cache_v), jnp.asarray(pos), jnp.int32(limit), jnp.array([1, 3]),
                    start=start),
            KVBlock(jnp.asarray(kk[:, :, s:]), jnp.asarray(v[:, :, s:]), jnp.asarray(q_pos))]
  for softcap in (None, 5.0):
    if impl == "xla_chunked":
      out = attention_xla_chunked(jnp.asarray(q), blocks, jnp.asarray(q_pos), None, softcap, chunk=chunk)
    else:
      out = attention(jnp.asarray(q), blocks, jnp.asarray(q_pos), None, softcap, _platform(impl))
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, kk, v, mask, softcap), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_with_only_a_limited_block(impl):
  b, t, s, n, k, h = 1, 1, 10, 2, 1, 16
  q = RNG.normal(size=(b, t, n, h)).astype(np.float32)
  kk = RNG.normal(size=(b, k, s, h)).astype(np.float32)
  v = RNG.normal(size=(b, k, s, h)).astype(np.float32)
  pos = jnp.arange(s)[None]
  out = attention(jnp.asarray(q), [KVBlock(jnp.asarray(kk), jnp.asarray(v), pos, jnp.int32(s), start=jnp.array([s]))],
                  jnp.array([[s]]),
                  None, None, _platform(impl))
  np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, kk, v, np.ones((b, t, s), bool)), rtol=1e-5, atol=1e-5)
