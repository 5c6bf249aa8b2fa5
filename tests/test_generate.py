"""Compiled generation on the embedded model: cache invariant, golden greedy continuations,
seeds, stop rules and bad input (each a ValueError naming the field, the LLM usable after)."""


import jax
import numpy as np
import pytest
from conftest import platform_for
from flax import nnx
from jaxgen import SamplingParams
from jaxgen.decode import cache as kvc
from jaxgen.decode import steps
from jaxgen.model.platform import REFERENCE

pytestmark = pytest.mark.slow

# The bf16 cached run against the float32 reference: the largest |log-prob error| over the
# reference's top 32, measured 0.285 (positions 599 to 607 of the long prompt; 0.11 to 0.18 at all
# but one), bf16 rounding depending on the processor: 2.8x. The top token must agree wherever the
# reference's top-2 margin exceeds REF_MARGIN nats (positions 602 to 606; measured: all 9 agree).
REF_TOL = 0.8
REF_MARGIN = 0.5


def _cached_run(model, platform, ids, prompt_len, slot=2, slots=4, chunk=256, max_len=1536, cache_dtype="float32"):
  """Prefills ids[:prompt_len] into `slot` in chunks, then decodes the rest teacher-forced.
  Returns (logits at the end of the prompt, [logits of each decode step])."""
  gd, params = nnx.split(model)
  pre = jax.jit(lambda p, c, t, n, s, fresh: steps.prefill_logits(nnx.merge(gd, p), c, t, n, s, fresh=fresh,
                                                                  platform=platform), static_argnums=5)
  dec = jax.jit(lambda p, c, t, a: steps.decode_logits(nnx.merge(gd, p), c, t, a, limit=max_len,
                                                       platform=platform)[:2])
  cache = kvc.allocate(model.cfg, kvc.CacheSpec(slots, max_len, cache_dtype))
  done = 0
  while done < prompt_len:
    n = min(chunk, prompt_len - done)
    tokens = np.zeros((1, chunk), np.int32)
    tokens[0, :n] = ids[done:done + n]
    logits, cache = pre(params, cache, tokens, np.array([n], np.int32), np.array([slot], np.int32), done == 0)
    done += n
  last, decoded = np.asarray(logits[0]), []
  active = np.zeros(slot + 1, bool)  # a step over the lowest rows holding the running one
  active[slot] = True
  for pos in range(prompt_len, len(ids)):
    tokens = np.zeros(slot + 1, np.int32)
    tokens[slot] = ids[pos]
    logits, cache = dec(params, cache, tokens, active)
    decoded.append(np.asarray(logits[slot]))
  return last, decoded


def _long_ids(golden):
  ids = golden["long"]["ids"].tolist()
  return (ids + golden["code"]["ids"].tolist()[1:] + golden["list"]["ids"].tolist()[1:])[:1200 + 64]


@pytest.fixture(scope="module")
def uncached_long(llm, golden):
  """One uncached pass over the long ids: the logits of positions 1,199 on (both kernels' runs
  compare with it)."""
  ids = _long_ids(golden)
  assert len(ids) == 1264
  return llm.logits(ids)[1199:]


@pytest.mark.parametrize("impl", ["default", "xla"])
def test_prefill_then_decode_equals_uncached_across_the_ring(llm, golden, uncached_long, impl):
  """1,200 prompt tokens (chunked prefill, ring of 512 wrapped) + 64 decode steps vs one pass, on
  this machine's kernels and on the plain formulation TPU and GPU run."""
  platform = llm.platform if impl == "default" else platform_for("xla")
  last, decoded = _cached_run(llm.model, platform, _long_ids(golden), 1200)
  # float32 sums in other orders: the worst of the 65 x 262,144 logits measured 1.2e-4 apart.
  np.testing.assert_allclose(last, uncached_long[0], atol=2e-4, rtol=1e-4)
  for i, logits in enumerate(decoded, start=1):
    np.testing.assert_allclose(logits, uncached_long[i], atol=2e-4, rtol=1e-4, err_msg=f"position {1199 + i}")


def test_accelerator_dtypes_prefill_then_decode_equal_uncached_and_stay_near_the_reference(llm_bf16, golden):
  """bf16 weights, activations and cache through the plain formulation (as TPU and GPU run): 600
  prompt tokens (the ring wrapped) and 8 decode steps.

  Self-consistency: against the uncached bf16 pass, which rounds at the same points but in other
  orders: the logits within 0.5 (4 bf16 steps at their magnitude), KL(uncached || cached) <= 1e-2
  per position, and the same top token wherever the uncached pass is decisive. (How XLA:CPU rounds
  bf16 sums depends on the processor: the worst position's KL measured 2.8e-3 on one machine's CPU
  and 5.3e-3 on another's, the logits' worst difference 0.375 on both. Logits one position off give
  KLs from 0.8 to 18.)

  Against the independent reference (HF transformers, float32, the same positions of the long golden
  prompt): the cached bf16 log-probs of the reference's top 32 within REF_TOL, and the same top token
  wherever the reference's top-2 margin exceeds REF_MARGIN."""
  g = golden["long"]
  ids = _long_ids(golden)[:608]
  assert ids == g["ids"].tolist()[:608]
  model = llm_bf16.model
  gd, params = nnx.split(model)
  tokens = np.zeros((1, 1024), np.int32)
  tokens[0, :608] = ids
  ref = np.asarray(jax.jit(lambda p, t: steps.uncached_logits(gd, p, t, platform=REFERENCE))(params, tokens))[0, :608]
  last, decoded = _cached_run(model, REFERENCE, ids, 600, cache_dtype="bfloat16", max_len=640, slots=3)
  worst, kls, ref_err = 0.0, [], 0.0
  for pos, logits in [(599, last)] + list(enumerate(decoded, start=600)):
    worst = max(worst, float(np.abs(logits - ref[pos]).max()))
    lp, lq = _log_softmax(ref[pos]), _log_softmax(logits)
    kls.append(float((np.exp(lp) * (lp - lq)).sum()))
    top2 = np.sort(ref[pos])[-2:]
    if top2[1] - top2[0] > 0.5:
      assert logits.argmax() == ref[pos].argmax(), pos
    ref_err = max(ref_err, float(np.abs(lq[g["top_ids"][pos]] - g["top_logprobs"][pos]).max()))
    if g["top_logprobs"][pos, 0] - g["top_logprobs"][pos, 1] > REF_MARGIN:
      assert logits.argmax() == g["top_ids"][pos, 0], pos
  print(f"bf16 cached vs uncached: max |logit diff| {worst:.3f}, KL max {max(kls):.2e} mean {np.mean(kls):.2e}; "
        f"vs the float32 reference: max top-32 |log-prob error| {ref_err:.3f}")
  assert worst <= 0.5 and max(kls) <= 1e-2, (worst, max(kls))
  assert ref_err <= REF_TOL, ref_err


def _log_softmax(x):
  x = x.astype(np.float64) - x.max()
  return x - np.log(np.exp(x).sum())


def test_greedy_reproduces_golden_continuations(llm, golden):
  names = list(golden)
  outs = llm.generate([golden[n]["ids"].tolist() for n in names],
                      SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
  compared = 0
  for name, out in zip(names, outs):
    g = golden[name]
    want, margin = g["greedy_ids"].tolist(), g["greedy_margin"]
    unclear = np.nonzero(margin < 1e-2)[0]
    upto = int(unclear[0]) if unclear.size else len(want)
    assert out.token_ids[:upto] == want[:upto], f"{name}: differs before the first unclear step {upto}"
    assert out.finish_reason == "length" and len(out.token_ids) == 32
    compared += upto
  assert compared >= 100, f"only {compared} tokens were decisive enough to compare"


def test_seeds_temperature_zero_and_top_k_one(llm):
  prompt = "Once upon a time"
  greedy = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
  k1 = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.9, top_k=1, seed=3), use_tqdm=False)[0]
  assert k1.token_ids == greedy.token_ids
  a = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7), use_tqdm=False)[0]
  b = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7), use_tqdm=False)[0]
  c = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=8), use_tqdm=False)[0]
  assert a.token_ids == b.token_ids and a.text == b.text
  assert a.token_ids != c.token_ids


def test_stop_rules(llm):
  prompt = "The capital of France is Paris. The capital of Germany is"
  base = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
  assert base.finish_reason == "length" and len(base.token_ids) == 10
  toks = base.token_ids

  # A stop token id: generation ends on it, the id is the last one, its text is not in the output.
  out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[toks[3]]), use_tqdm=False)[0]
  assert out.finish_reason == "stop" and out.token_ids == toks[:4] and out.outputs[0].stop_reason == toks[3]

  # A stop string spanning the boundary of two tokens.
  pieces = [llm.tokenizer.decode([t]) for t in toks]
  i = next(j for j in range(2, 9) if len(pieces[j]) >= 2 and len(pieces[j + 1]) >= 1 and pieces[j].strip())
  stop = pieces[i][-2:] + pieces[i + 1][:1]
  text_before = "".join(pieces[:i]) + pieces[i][:-2]
  out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, stop=[stop]), use_tqdm=False)[0]
  assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
  assert out.text == llm.tokenizer.decode(toks[:i + 2])[:len(text_before)]
  assert stop not in out.text
  inc = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, stop=[stop], include_stop_str_in_output=True),
                     use_tqdm=False)[0]
  assert inc.text.endswith(stop)

  # EOS, made certain with a logit bias, is held back by min_tokens and then ends generation.
  out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, min_tokens=3, logit_bias={1: 100.0}),
                     use_tqdm=False)[0]
  assert out.finish_reason == "stop" and len(out.token_ids) == 4 and out.token_ids[-1] == 1
  ignored = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0, logit_bias={1: 100.0}, ignore_eos=True),
                         use_tqdm=False)[0]
  assert ignored.finish_reason == "length" and ignored.token_ids == [1] * 5


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=float("inf")), "min_p"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=float("-inf")), "frequency_penalty"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
    SamplingParams(**kwargs)


def test_bad_prompts_raise_and_leave_the_llm_usable(llm):
  v = llm.cfg.vocab_size
  with pytest.raises(ValueError, match="prompts is empty"):
    llm.generate([])
  with pytest.raises(ValueError, match=rf"prompt has {llm.max_len + 5} tokens; the context limit is max_len={llm.max_len}"):
    llm.generate([[2] * (llm.max_len + 5)])
  with pytest.raises(ValueError, match=rf"prompt 0: token id {v} at index 2 is outside the vocabulary"):
    llm.generate([[2, 5, v]])
  with pytest.raises(ValueError, match=rf"stop_token_ids=.*\[0, {v}\)"):
    llm.generate("hi", SamplingParams(stop_token_ids=[v + 3]))
  with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
    llm.generate([[2, 3], []])
  with pytest.raises(ValueError, match=r"prompt 1: token id at index 1 is 3\.5 \(float\); token ids must be integers"):
    llm.generate([[2, 3], [2, 3.5]])
  with pytest.raises(ValueError, match=r"prompt 0: token id at index 0 is None \(NoneType\)"):
    llm.generate([[None]])
  with pytest.raises(ValueError, match=r"token id at index 1 is True \(bool\)"):
    llm.logits([2, True])
  assert not llm.engine.has_unfinished()
  out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
  assert len(out.token_ids) == 3


def test_stream_yields_the_same_text_as_generate(llm):
  params = SamplingParams(max_tokens=16, temperature=0.0)
  full = llm.generate("Write a haiku about the sea:", params, use_tqdm=False)[0]
  stream = llm.stream("Write a haiku about the sea:", params)
  deltas = list(stream)
  assert "".join(deltas) == full.text
  assert len(deltas) > 1
  assert stream.output.finished and stream.output.text == full.text
  m = stream.output.metrics
  assert m.ttft_s > 0 and m.generated_tokens == len(full.token_ids) and m.prefill_s > 0 and m.decode_s > 0
  assert len(m.inter_token_latencies) == m.generated_tokens - 1


def test_logprobs_are_those_of_the_raw_model_distribution(llm):
  prompt = llm.tokenizer.encode("The largest planet in the solar system is", add_special_tokens=True)
  out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=1.0, seed=11, logprobs=5), use_tqdm=False)[0]
  first = out.outputs[0].logprobs[0]
  logits = llm.logits(prompt)[-1].astype(np.float64)
  ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
  top = np.argsort(-ref)[:5]
  ranked = sorted((lp for lp in first.values() if lp.rank is not None), key=lambda lp: lp.rank)
  assert [lp.token_id for lp in ranked] == top.tolist()
  np.testing.assert_allclose([lp.logprob for lp in ranked], ref[top], atol=1e-4)
  chosen = out.token_ids[0]
  np.testing.assert_allclose(first[chosen].logprob, ref[chosen], atol=1e-4)
  total = sum(step[t].logprob for step, t in zip(out.outputs[0].logprobs, out.token_ids))
  np.testing.assert_allclose(out.outputs[0].cumulative_logprob, total, rtol=1e-6)


def test_logits_compiles_once_per_bucket_not_per_length(llm, golden):
  """11 prompt lengths share the few buckets of `LLM.logits` (powers of two and halfway between);
  a second pass compiles nothing."""
  from jaxgen.decode import compiles
  from jaxgen.decode.buckets import bucket

  ids = golden["long"]["ids"].tolist()
  lengths = list(range(3, 143, 14)) + [136]
  assert len(lengths) == 11
  before = compiles.count()
  first = {n: llm.logits(ids[:n]) for n in lengths}
  buckets = {bucket(n, llm.logits_buckets): n for n in lengths}  # one length per bucket
  assert sorted(buckets) == [16, 24, 32, 48, 64, 96, 128, 192]
  assert compiles.count() - before <= len(buckets)
  before = compiles.count()
  for n in buckets.values():
    np.testing.assert_array_equal(llm.logits(ids[:n]), first[n])
  assert compiles.count() == before
  # Padding to the bucket changes nothing: a length's logits are the longer prompt's prefix.
  np.testing.assert_allclose(first[17][:17], first[136][:17], atol=1e-4, rtol=1e-4)
