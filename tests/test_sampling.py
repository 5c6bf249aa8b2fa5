"""Sampling laws on fixed logits, against a numpy reference of vLLM's definitions.

Each distribution test draws many times (one row per draw, each with its own seed-derived key)
and applies a chi-square test at p = 1e-6 (seeded: deterministic, never flaky). The candidate
path (kept set inside the top 64) and the exact full-vocabulary path are both exercised.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxgen.decode import sampling as S

V = 1000
DRAWS = 20_000


def row_params(b, **kw):
  base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
              frequency_penalty=0.0, min_tokens=0, prompt_len=0)
  base.update(kw)
  f = {k: jnp.full((b,), v, jnp.int32 if k in ("top_k", "min_tokens", "prompt_len") else jnp.float32)
       for k, v in base.items()}
  keys = np.stack([np.zeros(b, np.uint32), np.arange(b, dtype=np.uint32)], axis=1)
  return S.RowParams(bias_ids=-jnp.ones((b, S.MAX_LOGIT_BIAS), jnp.int32),
                     bias_values=jnp.zeros((b, S.MAX_LOGIT_BIAS), jnp.float32),
                     ban_ids=-jnp.ones((b, S.MAX_STOP_IDS), jnp.int32), key=jnp.asarray(keys), **f)


def state(params, b, seen=None, counts=None):
  return S.SamplerState(params, jnp.zeros((b,), jnp.int32),
                        jnp.zeros((b, V), bool) if seen is None else seen,
                        jnp.zeros((b, V), jnp.int32) if counts is None else counts)


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
  """vLLM's order: temperature, min_p, top_k, top_p (on the renormalised survivors)."""
  z = logits / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  p = np.where(p >= min_p * p.max(), p, 0.0)
  order = np.argsort(-p, kind="stable")
  if top_k > 0:
    p[order[top_k:]] = 0.0
  p /= p.sum()
  sorted_p = p[order]
  before = np.cumsum(sorted_p) - sorted_p
  drop = order[before >= top_p]
  p[drop] = 0.0
  return p / p.sum()


def draw(logits, **kw):
  params = row_params(DRAWS, **kw)
  x = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (DRAWS, V))
  out = jax.jit(S.sample)(x, state(params, DRAWS), jnp.full((DRAWS,), 7, jnp.int32), jnp.bool_(False))
  return np.bincount(np.asarray(out.tokens), minlength=V)


def chi_square_ok(counts, probs):
  support = probs > 0
  assert counts[~support].sum() == 0, f"drew tokens outside the support: {np.nonzero(counts * ~support)[0][:10]}"
  expected = probs[support] * counts.sum()
  # Merge rare cells so every expected count is >= 5.
  order = np.argsort(expected)
  e, c = expected[order], counts[support][order]
  cut = np.searchsorted(np.cumsum(e), 5.0) + 1
  e = np.concatenate([[e[:cut].sum()], e[cut:]])
  c = np.concatenate([[c[:cut].sum()], c[cut:]])
  stat = ((c - e) ** 2 / e).sum()
  df = max(len(e) - 1, 1)
  z = 4.753  # p = 1e-6, Wilson-Hilferty
  crit = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
  assert stat < crit, f"chi-square {stat:.1f} >= {crit:.1f} (df={df})"


PEAKED = np.random.default_rng(0).normal(0, 3, V)
FLAT = np.random.default_rng(1).normal(0, 0.3, V)

CASES = [
    ("temperature", PEAKED, dict(temperature=0.7)),
    ("hot", FLAT, dict(temperature=1.5)),
    ("top_k_candidates", PEAKED, dict(top_k=10)),
    ("top_k_full_vocab", FLAT, dict(top_k=300)),
    ("top_p_candidates", PEAKED, dict(top_p=0.8)),
    ("top_p_full_vocab", FLAT, dict(top_p=0.9)),
    ("min_p", PEAKED, dict(min_p=0.05)),
    ("min_p_flat", FLAT, dict(min_p=0.5)),
    ("combined", PEAKED, dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01)),
    ("combined_full", FLAT, dict(temperature=1.2, top_k=500, top_p=0.7, min_p=0.2)),
]


@pytest.mark.parametrize("name,logits,kw", CASES, ids=[c[0] for c in CASES])
def test_sampling_law(name, logits, kw):
  chi_square_ok(draw(logits, **kw), reference(logits, **kw))


def test_greedy_rows_take_the_argmax_and_ignore_filters():
  logits = jnp.asarray(np.random.default_rng(3).normal(size=(4, V)), jnp.float32)
  out = S.sample(logits, state(row_params(4, temperature=0.0, top_p=0.5), 4), jnp.zeros(4, jnp.int32), jnp.bool_(False))
  np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(logits), -1))


def test_same_key_same_draw_different_positions_differ():
  logits = jnp.broadcast_to(jnp.asarray(FLAT, jnp.float32), (2, V))
  p = row_params(2, temperature=1.0)
  p = p.replace(key=jnp.asarray([[0, 42], [0, 42]], jnp.uint32))
  sample = jax.jit(S.sample)
  a = sample(logits, state(p, 2), jnp.array([5, 5]), jnp.bool_(False)).tokens
  assert int(a[0]) == int(a[1])
  draws = {int(sample(logits, state(p, 2), jnp.array([i, i]), jnp.bool_(False)).tokens[0]) for i in range(20)}
  assert len(draws) > 5


def test_helpers_match_numpy():
  x = np.random.default_rng(4).normal(size=(3, 1500)).astype(np.float32)
  np.testing.assert_array_equal(S.argmax(jnp.asarray(x)), x.argmax(-1))
  vals, ids = S.top_candidates(jnp.asarray(x), 20)
  np.testing.assert_array_equal(ids, np.argsort(-x, -1)[:, :20])
  np.testing.assert_allclose(vals, -np.sort(-x, -1)[:, :20])


def test_penalties_and_bias_match_numpy():
  rng = np.random.default_rng(5)
  b = 3
  logits = rng.normal(0, 2, (b, V)).astype(np.float32)
  seen = rng.random((b, V)) < 0.05
  counts = (rng.random((b, V)) < 0.05) * rng.integers(1, 4, (b, V))
  rep, pres, freq = np.array([1.3, 1.0, 0.8]), np.array([0.5, 0.0, -0.4]), np.array([0.2, 0.7, 0.0])
  p = row_params(b).replace(repetition_penalty=jnp.asarray(rep, jnp.float32), presence_penalty=jnp.asarray(pres, jnp.float32),
                            frequency_penalty=jnp.asarray(freq, jnp.float32))
  got = np.asarray(S.penalize(jnp.asarray(logits), p, jnp.asarray(seen), jnp.asarray(counts, jnp.int32)))
  want = logits.copy()
  for r in range(b):
    hit = seen[r] | (counts[r] > 0)
    want[r] = np.where(hit, np.where(want[r] > 0, want[r] / rep[r], want[r] * rep[r]), want[r])
    want[r] -= freq[r] * counts[r] + pres[r] * (counts[r] > 0)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

  bias_ids = -np.ones((b, S.MAX_LOGIT_BIAS), np.int32)
  bias_vals = np.zeros((b, S.MAX_LOGIT_BIAS), np.float32)
  bias_ids[0, :2], bias_vals[0, :2] = [7, 9], [5.0, -100.0]
  ban = -np.ones((b, S.MAX_STOP_IDS), np.int32)
  ban[:, 0] = 1
  p = p.replace(bias_ids=jnp.asarray(bias_ids), bias_values=jnp.asarray(bias_vals), ban_ids=jnp.asarray(ban),
                min_tokens=jnp.asarray([3, 3, 0], jnp.int32))
  got = np.asarray(S._bias_and_bans(jnp.asarray(logits), p, jnp.asarray([1, 5, 0])))
  want = logits.copy()
  want[0, 7] += 5.0
  want[0, 9] -= 100.0
  want[0, 1] = S.NEG_INF  # row 0 generated 1 < min_tokens 3: EOS banned
  np.testing.assert_array_equal(got, want)
