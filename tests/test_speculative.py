"""Speculative decoding (n-gram proposals, one verify program): the output is the output of plain
decoding, token for token, for greedy and seeded requests, in any batch; the sampled distribution
is the target's; stops inside an accepted run and max_tokens hold; nothing compiles after warm-up."""

from __future__ import annotations

import json
import math
import random

import jax
import numpy as np
import pytest
from conftest import DATA, ToyTokenizer, run_to_end, tiny_config, tiny_model
from jaxgen.decode import compiles, draft, speculative
from jaxgen.decode.engine import Engine
from jaxgen.decode.params import SamplingParams
from jaxgen.model.transformer import first_layers

CFG = tiny_config(sliding_window=32, max_context=1024)
MODEL = tiny_model(CFG, seed=1)
RNG = np.random.default_rng(0)
PATTERN = [int(x) for x in RNG.integers(3, 300, 12)]
PROMPTS = [PATTERN * 6, [int(x) for x in RNG.integers(3, 300, 40)], PATTERN * 3 + [5, 6], PATTERN[:7] * 5]


# Engines of one size and k share their compiled programs (steps.programs_for): the tests use
# 8 slots and k = 4 unless what they check needs another.
def engine(spec="ngram:4", slots=8, model=MODEL, **kw) -> Engine:
  return Engine(model, ToyTokenizer(model.cfg.vocab_size), max_batch=slots, max_len=256, prefill_chunk=64, seed=0,
                speculative_config=spec, **kw)


run = run_to_end


def assert_same(a, b, tol=1e-4):
  for x, y in zip(a.outputs, b.outputs):
    assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason, y.stop_reason)
    if x.logprobs is not None:
      for px, py in zip(x.logprobs, y.logprobs):
        assert px.keys() == py.keys()
        assert all(abs(px[t].logprob - py[t].logprob) <= tol for t in px)


# ---------------------------------------------------------------------------------- the config
@pytest.mark.parametrize("config,message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an integer >= 1"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method='medusa' is not supported"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model=None: a draft_model needs the draft's path"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, r"unknown fields \['model'\] for method 'ngram'"),
    ({"method": "draft_model", "model": "self", "num_speculative_tokens": 2, "quantization": "int4"},
     "quantization='int4' is not supported"),
    ({"method": "draft_model", "model": "self", "num_speculative_tokens": 2, "draft_layers": 0},
     "draft_layers=0 must be an integer >= 1"),
    ('{"method": "ngram", ', "not valid JSON"),
    ([1, 2], "speculative_config is a list"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, r"unknown fields \['lookahead'\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min=5 exceeds"),
    ({"method": "ngram", "num_speculative_tokens": 40}, "exceeds the limit of 16"),
    ("ngram:x", "write METHOD:K"),
])
def test_bad_configs_name_the_field(config, message):
  with pytest.raises(ValueError, match=message):
    speculative.parse(config)


def test_cli_form_and_dict_form_agree():
  assert speculative.parse("ngram:3") == speculative.parse({"method": "ngram", "num_speculative_tokens": 3})
  assert speculative.parse(None) is None
  assert speculative.parse('{"method": "ngram", "num_speculative_tokens": 3}') == speculative.parse("ngram:3")
  assert speculative.parse("draft_model:2") == speculative.SpecConfig("draft_model", 2, model="self")


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
  h = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
  assert speculative.ngram_proposal(h, 3, 4, 2).tolist() == [7, 8, 5]  # latest earlier "1 2 3"
  assert speculative.ngram_proposal(h, 9, 4, 2).tolist() == [7, 8, 5, 1, 2, 3]  # up to the end
  assert speculative.ngram_proposal(np.array([4, 5, 6, 7]), 3, 3, 1).tolist() == []
  assert speculative.ngram_proposal(np.array([4, 5, 4]), 3, 3, 1).tolist() == [5, 4]  # n = 1
  assert speculative.ngram_proposal(np.array([4, 5, 4]), 3, 3, 2).tolist() == []


def test_a_row_whose_proposals_keep_failing_pauses_then_tries_again():
  row = speculative.RowSpec()
  row.record(4, 0)
  assert row.wants()
  row.record(4, 0)
  paused = [row.wants() for _ in range(5)]
  assert paused == [False] * 4 + [True]
  row.record(4, 2)
  assert row.misses == 0 and row.wants()


# ------------------------------------------------------------------------------------- engine
def test_greedy_output_is_plain_decodings_batch_one_and_mixed():
  """Greedy with logprobs, alone and in a batch of 8 with seeded, penalised and min_tokens rows (no
  proposals for those), 80 tokens past a ring of 32 (+4 slack): the same tokens and logprobs."""
  greedy = SamplingParams(max_tokens=80, temperature=0.0, logprobs=3, ignore_eos=True)
  # One engine of each kind serves the prompts in turn (each alone in the batch): a request's
  # output depends on no earlier one, and building engines is what costs here.
  spec_eng, plain_eng = engine(), engine(None)
  for p in PROMPTS:
    assert_same(run(spec_eng, [p], greedy)[0], run(plain_eng, [p], greedy)[0])
  assert spec_eng.metrics()["spec_accepted_tokens"] > 0
  mixed = [greedy, SamplingParams(max_tokens=50, temperature=0.7, seed=3, ignore_eos=True),
           SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
           SamplingParams(max_tokens=33, temperature=0.0, min_tokens=20, ignore_eos=True)] * 2
  prompts = PROMPTS * 2
  spec_eng = engine()
  for x, y in zip(run(spec_eng, prompts, mixed), run(engine(None), prompts, mixed)):
    assert_same(x, y)
  m = spec_eng.metrics()
  assert m["spec_draft_tokens"] > m["spec_accepted_tokens"] > 0 and m["spec_mean_accepted_length"] > 1


def test_seeded_samples_do_not_depend_on_speculation_or_k():
  params = [SamplingParams(max_tokens=60, temperature=t, top_p=p, seed=s, ignore_eos=True, n=n)
            for t, p, s, n in ((0.01, 1.0, 1, 1), (0.03, 0.9, 2, 2), (1.0, 1.0, 3, 1), (0.3, 0.8, 4, 1))]
  plain = run(engine(None), PROMPTS, params)
  for spec in ("ngram:1", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}):
    eng = engine(spec)
    for x, y in zip(run(eng, PROMPTS, params), plain):
      assert_same(x, y)
    assert eng.metrics()["spec_accepted_tokens"] > 0


def test_stops_inside_an_accepted_run_and_max_tokens_hold():
  greedy = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)
  ref = run(engine(None), [PROMPTS[0]], greedy)[0]
  text, ids = ref.outputs[0].text, ref.token_ids
  cases = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 2, 5, 13, 37)]
  cases += [SamplingParams(max_tokens=70, temperature=0.0, stop=[text[30:33]], ignore_eos=True),
            SamplingParams(max_tokens=70, temperature=0.0, stop=[text[41:43]], include_stop_str_in_output=True,
                           ignore_eos=True),
            SamplingParams(max_tokens=70, temperature=0.0, stop_token_ids=[ids[25]], ignore_eos=True)]
  spec_eng, plain_eng = engine(), engine(None)  # the cases in turn, each alone in its engine
  for sp in cases:
    got, want = run(spec_eng, [PROMPTS[0]], sp)[0], run(plain_eng, [PROMPTS[0]], sp)[0]
    assert_same(got, want)
    assert len(got.token_ids) <= sp.max_tokens
  assert spec_eng.metrics()["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_nothing_compiles_after_warmup_and_verify_is_counted(method):
  jax.clear_caches()  # fork, move, save and restore are module functions whose jit caches engines share
  eng = engine() if method == "ngram" else engine(DRAFT, draft_model=first_layers(MODEL, 3))
  eng.warmup()
  p, d = eng.runner.programs, eng.runner.drafter
  jitted = [p.prefill_program(True), p.prefill_program(False), p.decode, p.sample, p.verify, p.fork, p.move, p.logits, p.save, p.restore]
  jitted += [d._catch_up, d._propose, d._move] if d else []
  assert sum(f._cache_size() for f in jitted) == eng.num_programs
  before = compiles.count()
  rng = random.Random(1)
  for i in range(30):
    prompt = rng.choice(PROMPTS)[:rng.randint(5, 70)]
    kw = rng.choice([dict(temperature=0.0), dict(temperature=0.8, seed=i, logprobs=2), dict(n=2, temperature=0.5)])
    eng.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True, **kw))
    if i % 4 == 0:
      eng.step()
  while eng.has_unfinished():
    eng.step()
  assert compiles.count() == before
  assert eng.metrics()["spec_verify_steps"] > 0


TEMP = 1.0


@pytest.mark.slow
@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_the_sampled_distribution_is_the_targets(top_p):
  """A 16-token vocabulary (logits spread by a larger embedding), temperature 1, 3000 seeds: the
  third token after a repetitive prompt (drawn where proposals are accepted and rejected) follows
  the model's own conditional distribution given the first two (chi-square, p = 0.001)."""
  cfg = tiny_config(vocab_size=16, sliding_window=32)
  model = tiny_model(cfg, seed=5)
  model.embed.set_value(model.embed.get_value() * 12)
  eng = engine("ngram:3", model=model)
  # The model's own greedy loop as the prompt: n-gram proposals then match often, not always.
  prompt = [3, 4, 5, 6] + run(eng, [[3, 4, 5, 6]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].token_ids
  outs = run(eng, [prompt] * 3000, [SamplingParams(max_tokens=3, temperature=TEMP, top_p=top_p, seed=s,
                                                   ignore_eos=True) for s in range(3000)])
  m = eng.metrics()
  assert m["spec_accepted_tokens"] > 300 and m["spec_draft_tokens"] - m["spec_accepted_tokens"] > 300
  pairs: dict[tuple, list] = {}
  for o in outs:
    pairs.setdefault(tuple(o.token_ids[:2]), []).append(o.token_ids[2])
  (t0, t1), third = max(pairs.items(), key=lambda kv: len(kv[1]))
  assert len(third) > 300
  logits = np.asarray(eng.runner.programs.logits(eng.runner.params, np.array([prompt + [t0, t1] + [0] * 32], np.int32)))
  x = logits[0, len(prompt) + 1] / TEMP
  probs = np.exp(x - x.max())
  probs /= probs.sum()
  order = np.argsort(-probs)
  keep = np.zeros_like(probs, bool)
  keep[order[(np.cumsum(probs[order]) - probs[order]) < top_p]] = True
  probs = np.where(keep, probs, 0) / probs[keep].sum()
  counts = np.bincount(third, minlength=16)
  assert counts[~keep].sum() == 0
  expected = probs * len(third)
  cells = expected > 0
  stat = float(np.sum((counts[cells] - expected[cells]) ** 2 / expected[cells]))
  df = int(cells.sum()) - 1
  # Wilson-Hilferty: the chi-square quantile at 1 - 0.001 (z = 3.09).
  critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
  assert stat < critical, (stat, critical, counts.tolist(), expected.round(1).tolist())


# -------------------------------------------------------------------------------- draft model
DRAFT = {"method": "draft_model", "model": "self", "num_speculative_tokens": 4}
DRAFTS = {"itself": MODEL, "first_3_layers": first_layers(MODEL, 3), "unrelated": tiny_model(CFG, seed=7)}


def test_first_layers_share_the_arrays_and_compute_the_prefix_of_the_model():
  cut = first_layers(MODEL, 2)
  assert cut.cfg.num_layers == 2 and cut.cfg.layer_kinds == CFG.layer_kinds[:2]
  assert cut.layers[1].q.get_value() is MODEL.layers[1].q.get_value()
  tokens = np.array([PROMPTS[1][:16]])
  positions = np.arange(16)[None]
  full = first_layers(MODEL, CFG.num_layers)
  assert np.array_equal(full(tokens, positions)[0], MODEL(tokens, positions)[0])
  with pytest.raises(ValueError, match="draft_layers=5 must be between 1 and the model's 4 layers"):
    first_layers(MODEL, 5)


def test_a_draft_must_share_the_vocabulary_and_be_given():
  with pytest.raises(ValueError, match="vocab_size=16; the target's is 300"):
    engine(DRAFT, draft_model=tiny_model(tiny_config(vocab_size=16)))
  with pytest.raises(ValueError, match="needs the draft model"):
    engine(DRAFT)
  with pytest.raises(ValueError, match="does not use one"):
    engine("ngram:2", draft_model=MODEL)


@pytest.mark.parametrize("name", list(DRAFTS))
def test_draft_model_output_is_plain_decodings(name):
  """A draft that is the model, its first 3 layers, or an unrelated model of the same vocabulary:
  greedy (with logprobs), seeded, penalised, min_tokens and n = 2 rows in one batch of 8, past the
  rings, give plain decoding's tokens; the draft's cache rows move with compaction."""
  params = [SamplingParams(max_tokens=25, temperature=0.0, n=2, ignore_eos=True),  # lowest rows finish first
            SamplingParams(max_tokens=33, temperature=0.0, min_tokens=20, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
            SamplingParams(max_tokens=50, temperature=0.7, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=80, temperature=0.0, logprobs=2, ignore_eos=True)]
  prompts = PROMPTS + PROMPTS[:1]
  eng = engine(DRAFT, draft_model=DRAFTS[name])
  for x, y in zip(run(eng, prompts, params), run(engine(None), prompts, params)):
    assert_same(x, y)
  m = eng.metrics()
  assert m["spec_draft_tokens"] > 0 and m["row_moves"] > 0
  if name == "itself":
    assert m["spec_acceptance_rate"] > 0.6, m


def test_draft_model_seeded_samples_and_stops_hold():
  greedy = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)
  ref = run(engine(None), [PROMPTS[0]], greedy)[0]
  text = ref.outputs[0].text
  cases = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 13)]
  cases += [SamplingParams(max_tokens=70, temperature=0.0, stop=[text[30:33]], ignore_eos=True),
            SamplingParams(max_tokens=60, temperature=0.05, top_p=0.9, seed=5, ignore_eos=True)]
  spec_eng, plain_eng = engine(DRAFT, draft_model=MODEL), engine(None)
  for sp in cases:
    got, want = run(spec_eng, [PROMPTS[0]], sp)[0], run(plain_eng, [PROMPTS[0]], sp)[0]
    assert_same(got, want)
    assert len(got.token_ids) <= sp.max_tokens


@pytest.mark.slow
def test_a_real_draft_checkpoint_of_another_architecture():
  """Tiny Gemma 3 target, tiny Gemma 2 draft (same tokenizer), both read from HF files through
  LLM: greedy output equals plain decoding's; a Llama draft (another vocabulary) is refused."""
  from jaxgen import LLM

  hf = DATA / "hf"
  prompts = ["The capital of France is", "def fibonacci(n): return"]
  greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
  plain = LLM(str(hf / "gemma3"), max_batch=2, max_len=256, seed=0)
  spec = LLM(str(hf / "gemma3"), max_batch=2, max_len=256, seed=0, speculative_config=dict(
      DRAFT, model=str(hf / "gemma2"), num_speculative_tokens=3))
  for x, y in zip(spec.generate(prompts, greedy, use_tqdm=False), plain.generate(prompts, greedy, use_tqdm=False)):
    assert x.outputs[0].token_ids == y.outputs[0].token_ids
  assert spec.engine.metrics()["spec_accepted_tokens"] > 0
  with pytest.raises(ValueError, match="vocab_size=345; the target's is 381"):
    draft.load(speculative.parse(dict(DRAFT, model=str(hf / "llama"))), plain.model, None, plain.tokenizer,
               "float32")


@pytest.mark.slow
def test_embedded_model_self_drafting_int8_is_token_for_token_plain(llm, golden):
  """Gemma 3 270M drafting for itself with int8 weights, on the golden prompts (one 1,177 tokens
  long: rings of 512 wrapped) greedy, all in one batch with two seeded rows and a row held to a
  JSON schema (the draft's proposals cut to what its grammar allows, a mask per position in
  verify): every row equals plain decoding token for token, and most proposals are accepted. (The n-gram proposer and rows alone are the
  tiny models' tests; verify is one program whatever proposes.)"""
  prompts = [g["ids"].tolist() for g in golden.values()]
  greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
  seeded = SamplingParams(max_tokens=32, temperature=0.7, seed=9, ignore_eos=True)
  schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
            "additionalProperties": False}
  held = SamplingParams(max_tokens=32, temperature=0.0, structured_outputs={"json": schema})
  params = [greedy] * len(prompts) + [seeded] * 2 + [held]
  prompts = prompts + prompts[:2] + ["A person as JSON:"]
  plain = llm.generate(prompts, params, use_tqdm=False)
  config = speculative.parse(dict(DRAFT, quantization="int8"))
  model = draft.load(config, llm.model, None, llm.tokenizer, "float32")
  assert model.cfg.weight_quant == "int8"
  eng = Engine(llm.model, llm.tokenizer, max_batch=8, max_len=1536, prefill_chunk=256, platform=llm.platform,
               speculative_config=config, draft_model=model, seed=0)
  outs = run(eng, prompts, params)
  for x, y in zip(outs, plain):
    assert x.token_ids == y.token_ids
  assert outs[-1].metrics.spec_accepted_tokens > 0  # the constrained row proposed, and was right
  assert json.loads(plain[-1].outputs[0].text)["name"] and plain[-1].outputs[0].finish_reason == "stop"
  m = eng.metrics()
  # Measured 0.685 (the seeded rows draw at temperature 0.7 and accept fewer greedy proposals); a
  # draft that proposed at random would be accepted about 1 time in 262,144.
  assert m["spec_acceptance_rate"] > 0.5, m
