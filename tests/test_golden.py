"""The embedded Gemma 3 270M against golden data from HF transformers (float32, same GGUF).

Tolerances: every reference top-32 log-probability within TOP32_TOL absolute at every position;
argmax equal wherever the reference's top-2 margin exceeds 1e-2. bfloat16 weights, int8 weights and
an int8 KV cache: top-1 agreement and mean KL to the float32 (bfloat16 cache) distribution, each
bound at most 3x what was measured (the measurements beside each).

Log-probabilities and KL are computed by XLA in float32 over the whole vocabulary: their own error
(a few 1e-6 at |log p| ~ 20) is under 3% of the tightest bound here. numpy in float64 took 40 s a
pass over the long prompt's 1,177 x 262,144 logits, most of this module's time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.slow

# Measured: 9.0e-5 here, 9.4e-5 in an earlier measurement (float32: jaxgen's CPU kernels and XLA's
# sums, whose order can differ by processor); 3x the larger.
TOP32_TOL = 2.8e-4


_log_softmax = jax.jit(lambda x: jax.nn.log_softmax(x.astype(jnp.float32), axis=-1))
_kl = jax.jit(lambda ref, other: jnp.sum(jnp.exp(ref) * (ref - other), axis=-1))


def log_softmax(x) -> np.ndarray:
  """[T, V] logits -> float32 log-probabilities."""
  return np.asarray(_log_softmax(x))


def kl(ref, other) -> np.ndarray:
  """KL(ref || other) per position [T], from log-probabilities [T, V]."""
  return np.asarray(_kl(ref, other))


@pytest.fixture(scope="module")
def f32_logprobs(llm, golden):
  return {name: log_softmax(llm.logits(g["ids"].tolist())) for name, g in golden.items()}


def test_prompt_ids_match_reference_tokenizer(llm, golden):
  for name, g in golden.items():
    assert llm.tokenizer.encode(str(g["text"]), add_special_tokens=True) == g["ids"].tolist(), name


def test_float32_top32_logprobs_match_reference(f32_logprobs, golden):
  worst = 0.0
  for name, g in golden.items():
    lp = f32_logprobs[name]
    got = np.take_along_axis(lp, g["top_ids"], axis=-1)
    err = np.abs(got - g["top_logprobs"]).max()
    worst = max(worst, err)
    assert err < TOP32_TOL, f"{name}: max |logprob error| {err:.2e} over top-32"
  print(f"worst top-32 log-prob error: {worst:.2e}")


def test_float32_argmax_matches_where_margin_is_clear(f32_logprobs, golden):
  for name, g in golden.items():
    margin = g["top_logprobs"][:, 0] - g["top_logprobs"][:, 1]
    clear = margin > 1e-2
    got = f32_logprobs[name].argmax(-1)
    bad = np.nonzero(clear & (got != g["top_ids"][:, 0]))[0]
    assert bad.size == 0, f"{name}: argmax differs at positions {bad[:10]}"


def _top32_error(lp, g):
  """Per position: the largest |log-prob error| over the reference's top 32."""
  return np.abs(np.take_along_axis(lp, g["top_ids"], axis=-1) - g["top_logprobs"]).max(-1)


def test_long_prompt_crosses_the_sliding_window(llm, f32_logprobs, golden):
  """The long golden prompt exercises the ring layers' window: jaxgen matches the reference past
  the window, and the same weights with a wider window (every other part of the model unchanged)
  match it inside the window only. A window ignored or off by one would fail the golden tests."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  from jaxgen.model.params import logits_fn

  g, w = golden["long"], llm.cfg.sliding_window
  assert len(g["ids"]) > 2 * w, (len(g["ids"]), w)
  top = jnp.asarray(g["top_ids"])

  def top32_logprobs(cfg):
    forward = logits_fn(cfg, jnp.float32)  # the plain XLA path, one uncached pass
    fn = jax.jit(lambda tree, ids: jnp.take_along_axis(jax.nn.log_softmax(forward(tree, ids)[0]), top, axis=-1))
    return np.asarray(fn(llm.weights(), np.asarray(g["ids"], np.int32)[None])).astype(np.float64)

  ours = _top32_error(f32_logprobs["long"], g)
  wide = np.abs(top32_logprobs(dataclasses.replace(llm.cfg, sliding_window=2 * w)) - g["top_logprobs"]).max(-1)
  print(f"window {w}: max top-32 error inside {ours[:w].max():.2e} (jaxgen) {wide[:w].max():.2e} (window {2 * w}); "
        f"past it {ours[w:].max():.2e} (jaxgen), window {2 * w}: min {wide[w:].min():.2e}, "
        f"median {np.median(wide[w:]):.2e}, max {wide[w:].max():.2e}")
  # Measured: jaxgen 6.6e-5 inside the window and 9.0e-5 past it; the wider window 6.6e-5 inside
  # (the same function there) and past it 0.086 at least (300x TOP32_TOL), median 7.4 nats. (A
  # window one entry wider in jaxgen's mask gives 0.2 past it.)
  assert ours[:w].max() < TOP32_TOL and ours[w:].max() < TOP32_TOL
  assert wide[:w].max() < TOP32_TOL
  assert np.all(wide[w:] > TOP32_TOL) and np.median(wide[w:]) > 1.0


# (positions, mean KL bound): measured 1.4e-4 nats here and 1e-4 in an earlier measurement at 256
# positions, 2.0e-4 in both at 32 (XLA's bf16 dot and jaxgen's kernel round differently, and how
# XLA:CPU rounds bf16 depends on the processor); each bound under 3x the larger.
@pytest.mark.parametrize("positions,kl_bound", [(256, 4e-4), (32, 5.8e-4)])
def test_bfloat16_weights_stay_close(llm_bf16, f32_logprobs, golden, positions, kl_bound):
  # 32 positions or fewer: every projection has decode-sized row counts, so on a CPU with AVX-512
  # BF16 the whole pass runs on jaxgen's bf16 kernel (tests/test_cpu_kernels.py), not XLA's matmul.
  agree, total, kls = 0, 0, []
  for name, g in golden.items():
    ids = g["ids"].tolist()[:positions]
    lp16 = log_softmax(llm_bf16.logits(ids))
    lp32 = f32_logprobs[name][:len(ids)]
    agree += int((lp16.argmax(-1) == lp32.argmax(-1)).sum())
    total += len(ids)
    kls.append(kl(lp32, lp16))
  top1 = agree / total
  mean_kl = float(np.concatenate(kls).mean())
  print(f"bfloat16 vs float32 ({positions} positions): top-1 agreement {top1:.3f}, mean KL {mean_kl:.5f} nats")
  # Top-1 agreement measured 0.994 at 256 positions, 1.000 at 32 (3x the disagreement: 0.982). A
  # real loss of precision (a float16 accumulator, a dropped norm offset) fails.
  assert top1 >= 0.985 and mean_kl < kl_bound, (top1, mean_kl)


def test_logits_rejects_out_of_vocabulary_ids(llm):
  v = llm.cfg.vocab_size
  with pytest.raises(ValueError, match=rf"token id {v} .*\[0, {v}\)"):
    llm.logits([2, 100, v])
  with pytest.raises(ValueError, match="token id -1"):
    llm.logits([-1])


def _agreement(f32_logprobs, golden, logits_of):
  """(top-1 agreement with float32, mean KL(float32 || other) in nats) over every golden position."""
  agree, total, kls = 0, 0, []
  for name, g in golden.items():
    lp = log_softmax(logits_of(g["ids"].tolist()))
    ref = f32_logprobs[name]
    agree += int((lp.argmax(-1) == ref.argmax(-1)).sum())
    total += len(lp)
    kls.append(kl(ref, lp))
  return agree / total, float(np.concatenate(kls).mean())


def test_int8_weights_stay_close_to_float32(f32_logprobs, golden):
  """int8 projection and embedding weights (a scale per block of 32), float32 activations,
  over every position of every golden prompt (the long one past the sliding window included)."""
  from jaxgen import LLM

  llm_int8 = LLM(dtype="float32", quantization="int8", max_len=256, max_batch=1, seed=0)
  top1, kl = _agreement(f32_logprobs, golden, llm_int8.logits)
  print(f"int8 weights vs float32: top-1 agreement {top1:.4f}, mean KL {kl:.5f} nats")
  # Measured: top-1 0.981 (1,393 of 1,420 positions), mean KL 7.1e-4 nats (float32 activations).
  assert top1 >= 0.98 and kl <= 2e-3, (top1, kl)


DECODED = 48  # per prompt: the decode steps are most of this test's time


def test_int8_kv_cache_stays_close_to_bfloat16(llm_bf16, golden):
  """bf16 weights; each prompt prefilled in chunks of 64 (each chunk reads what the earlier ones
  cached) but for its last DECODED tokens (a short prompt: its second half), decoded teacher-forced, every step reading the cache:
  int8 entries (a scale per key and value vector) against bfloat16 entries, at the end of the
  prefill and at every decoded position. The long prompt's decode steps read rings wrapped twice."""
  from test_generate import _cached_run

  agree, total, kls = 0, 0, []
  for name, g in golden.items():
    ids = g["ids"].tolist()
    prefilled = max(len(ids) - DECODED, len(ids) // 2)  # short prompts: their second half
    runs = [_cached_run(llm_bf16.model, llm_bf16.platform, ids, prefilled, slot=0, slots=1, chunk=64,
                        max_len=1536, cache_dtype=dt) for dt in ("bfloat16", "int8")]
    ref = log_softmax(np.stack([runs[0][0], *runs[0][1]]))
    got = log_softmax(np.stack([runs[1][0], *runs[1][1]]))
    agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
    total += len(ref)
    kls.append(kl(ref, got))
  top1, mean_kl = agree / total, float(np.concatenate(kls).mean())
  print(f"int8 KV vs bfloat16 KV ({total} positions): top-1 agreement {top1:.4f}, mean KL {mean_kl:.5f} nats")
  # Measured: top-1 1.0 (177 of 177), mean KL 2.4e-4 nats; over the second half of every prompt
  # (718 positions) top-1 0.990 and 2.3e-4, here and in an earlier measurement (bf16 activations,
  # whose XLA:CPU rounding depends on the processor). Bounds: 3x that 1% of top tokens differing
  # (at most 3 of 177) and under 3x the KL.
  assert top1 >= 0.98 and mean_kl <= 6.5e-4, (top1, mean_kl)
