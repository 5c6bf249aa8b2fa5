"""The continuous-batching engine on tiny random models: batch invariance, slot reuse, n > 1,
aborts, per-request errors, metrics and zero compilations after warm-up."""

import functools
import random
import threading
import time

import jax
import numpy as np
import pytest
from conftest import ToyTokenizer, platform_for, run_to_end, tiny_config, tiny_model
from jaxgen import SamplingParams
from jaxgen.decode import compiles
from jaxgen.decode.engine import Engine


def make_engine(slots=4, max_len=128, chunk=32, cfg=None, **kw):
  cfg = cfg or tiny_config()
  return Engine(tiny_model(cfg), ToyTokenizer(cfg.vocab_size), max_batch=slots, max_len=max_len, prefill_chunk=chunk,
                seed=0, **kw)


@functools.cache
def shared_engine(slots: int, impl: str = "default") -> Engine:
  """One engine per (slots, kernel choice) for the module, so its programs compile once; "default"
  is what this machine resolves to, "xla" the plain formulation TPU and GPU run."""
  eng = make_engine(slots=slots, **({} if impl == "default" else {"platform": platform_for(impl)}))
  return eng


def fresh_counts(eng: Engine) -> Engine:
  eng.stats.clear()
  eng.stats.decode_rows.clear()
  return eng


def run(engine, requests):
  """requests: [(prompt ids, SamplingParams)] -> {index: RequestOutput}, added in the given order."""
  ids = {engine.add_request(p, sp): i for i, (p, sp) in enumerate(requests)}
  done = {}
  while engine.has_unfinished():
    for out in engine.step():
      if out.finished:
        done[ids[out.request_id]] = out
  return done


def eight_requests():
  rng = np.random.default_rng(0)
  variety = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=5),
             dict(temperature=1.2, top_p=0.7), dict(temperature=1.0, min_p=0.1),
             dict(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
             dict(temperature=1.0, logit_bias={7: 3.0, 8: -2.0}), dict(temperature=0.7, top_k=50, top_p=0.9)]
  out = []
  for i, kw in enumerate(variety):
    prompt = rng.integers(3, 300, int(rng.integers(1, 70))).tolist()
    out.append((prompt, SamplingParams(max_tokens=int(rng.integers(5, 25)), seed=100 + i, ignore_eos=True, **kw)))
  return out


@pytest.mark.parametrize("impl", ["default", "xla"])
def test_seeded_requests_are_batch_invariant(impl):
  """A seeded request gives the same tokens alone (its decode steps run over one row of the four
  slots), among others (steps over 2 and 4 rows, rows moved down as others finish), shuffled, and
  queued on a 2-slot engine."""
  reqs = eight_requests()
  eng = fresh_counts(shared_engine(4, impl))
  alone = {i: run(eng, [r])[0].token_ids for i, r in enumerate(reqs)}
  assert set(eng.stats.decode_rows) == {1} and eng.stats.moves == 0
  together = {i: o.token_ids for i, o in run(eng, reqs).items()}
  assert {1, 2, 4} <= set(eng.stats.decode_rows) and eng.stats.moves > 0
  order = list(range(8))
  random.Random(1).shuffle(order)
  shuffled = {order[j]: o.token_ids for j, o in run(eng, [reqs[i] for i in order]).items()}
  queued = {i: o.token_ids for i, o in run(shared_engine(2, impl), reqs).items()}
  for i in range(8):
    assert len(alone[i]) == reqs[i][1].max_tokens
    assert together[i] == alone[i], f"request {i} together"
    assert shuffled[i] == alone[i], f"request {i} shuffled"
    assert queued[i] == alone[i], f"request {i} with 2 slots"


def test_a_lone_request_decodes_over_one_row_and_keeps_its_logprobs():
  """A greedy request gives the same tokens and logprobs whether its steps ran over 1 row of 8
  slots or over all 8 rows (7 others running beside it)."""
  eng = make_engine(slots=8)
  prompt = list(range(3, 20))
  params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
  alone = run(eng, [(prompt, params)])[0].outputs[0]
  assert set(eng.stats.decode_rows) == {1}
  others = [(list(range(5, 5 + i)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)) for i in range(1, 8)]
  eng.stats.decode_rows.clear()
  together = run(eng, others + [(prompt, params)])[7].outputs[0]
  assert set(eng.stats.decode_rows) == {8}
  assert together.token_ids == alone.token_ids
  for a, b in zip(alone.logprobs, together.logprobs):  # XLA's matmuls may round differently per row count
    assert a.keys() == b.keys()
    np.testing.assert_allclose([v.logprob for v in a.values()], [b[k].logprob for k in a], atol=1e-5)


def test_freed_slots_are_reused_before_the_longest_request_ends():
  lengths = [40, 3, 5, 2, 7, 3, 9, 4, 2, 6, 3, 5]
  rng = np.random.default_rng(1)
  reqs = [(rng.integers(3, 300, 10).tolist(), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
          for n in lengths]
  eng = fresh_counts(shared_engine(4))
  solo = {i: run(eng, [r])[0].token_ids for i, r in enumerate(reqs)}
  outs = run(eng, reqs)
  longest_end = outs[0].metrics.finished_time
  for i in range(4, 12):
    assert outs[i].metrics.scheduled_time < longest_end, f"request {i} waited for the longest one"
    assert outs[i].metrics.queue_s > 0
  for i in range(12):
    assert outs[i].token_ids == solo[i] and len(outs[i].token_ids) == lengths[i]


def test_n_samples_share_one_prefill():
  eng = fresh_counts(shared_engine(4))
  prompt = list(range(3, 23))  # one prefill chunk
  before = eng.stats.prefill_calls
  out = run(eng, [(prompt, SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True))])[0]
  assert eng.stats.prefill_calls - before == 1
  assert len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
  assert len({tuple(o.token_ids) for o in out.outputs}) == 3
  greedy = run(eng, [(prompt, SamplingParams(n=2, max_tokens=12, temperature=0.0, ignore_eos=True))])[0]
  single = run(eng, [(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))])[0]
  assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == single.token_ids


@pytest.mark.parametrize("kind", ["delta", "final_only"])
def test_output_kinds_carry_what_a_cumulative_request_does(kind):
  """vLLM's output_kind: deltas join up to the cumulative answer, token for token, with their
  logprobs; final_only says nothing until the end. A cumulative output handed out earlier never
  changes later (it is a snapshot)."""
  eng = shared_engine(4)
  prompt = list(range(3, 20))
  params = dict(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, logprobs=2)
  rid = eng.add_request(prompt, SamplingParams(**params))
  other = eng.add_request(prompt, SamplingParams(**params, output_kind=kind))
  seen, pieces = [], []
  while eng.has_unfinished():
    for out in eng.step():
      if out.request_id == rid:
        seen.append((out, list(out.outputs[0].token_ids)))
      else:
        assert out.request_id == other
        pieces.append(out)
  whole = seen[-1][0].outputs[0]
  assert all(list(o.outputs[0].token_ids) == ids for o, ids in seen)  # none changed after it was handed out
  if kind == "final_only":
    assert len(pieces) == 1 and pieces[0].finished and pieces[0].outputs[0].token_ids == whole.token_ids
    return
  assert len(pieces) > 2 and [t for p in pieces for t in p.outputs[0].token_ids] == whole.token_ids
  assert "".join(p.outputs[0].text for p in pieces) == whole.text
  assert [lp for p in pieces for lp in p.outputs[0].logprobs] == whole.logprobs
  assert pieces[-1].finished and pieces[-1].outputs[0].finish_reason == "length"


def test_abort_reports_what_was_produced_and_frees_the_slot():
  eng = fresh_counts(shared_engine(1))
  rid = eng.add_request(list(range(3, 20)), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
  other = eng.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
  seen = []
  for _ in range(6):
    seen += eng.step()
  eng.abort(rid)
  outs = {}
  while eng.has_unfinished():
    for o in eng.step():
      outs[o.request_id] = o
  solo = run(eng, [(list(range(3, 20)), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))])[0]
  got = outs[rid].token_ids
  # Six steps produce at most one token each (the first step prefills): what was produced is
  # reported, and it is what the request would have produced alone.
  assert outs[rid].finish_reason == "abort" and 1 <= len(got) <= 6 and got == solo.token_ids[:len(got)]
  assert outs[other].finish_reason == "length" and len(outs[other].token_ids) == 3
  assert all(s is None for s in eng.scheduler.slots)


def test_abort_storm_leaves_the_survivors_exact():
  """Aborts mid chunked prefill, of a waiting request, after an n=2 fork, twice, and of an unknown
  id: the surviving requests produce what they produce alone, and every slot is free afterwards."""
  eng = make_engine(slots=3, max_len=128, chunk=16)
  rng = np.random.default_rng(5)
  survivors = [(rng.integers(3, 300, 20).tolist(), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
               (rng.integers(3, 300, 40).tolist(),
                SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=7, ignore_eos=True))]
  solo = [run(eng, [r])[0].token_ids for r in survivors]
  long_prompt = rng.integers(3, 300, 70).tolist()  # five chunks of 16

  ids = [eng.add_request(*r) for r in survivors]
  in_prefill = eng.add_request(long_prompt, SamplingParams(max_tokens=5))
  forked = eng.add_request([4, 5, 6], SamplingParams(n=2, max_tokens=30, temperature=1.0, seed=3))
  waiting = eng.add_request([7, 8, 9], SamplingParams(max_tokens=30))
  outs = {}

  def step():
    for o in eng.step():
      outs[o.request_id] = o

  step()
  eng.abort(in_prefill)
  eng.abort(in_prefill)
  eng.abort("no-such-request")
  step()
  step()
  eng.abort(waiting)
  eng.abort(forked)
  while eng.has_unfinished():
    step()
  assert [outs[i].outputs[0].token_ids for i in ids] == solo
  assert outs[in_prefill].finish_reason == "abort" and outs[in_prefill].outputs[0].token_ids == []
  assert outs[waiting].finish_reason == "abort"
  assert [c.finish_reason for c in outs[forked].outputs] == ["abort", "abort"]
  assert all(s is None for s in eng.scheduler.slots) and not eng.scheduler.waiting
  assert run(eng, [survivors[1]])[0].token_ids == solo[1]


def test_a_stream_left_early_aborts_its_request():
  from jaxgen.llm import Stream

  eng = make_engine(slots=2, max_len=128)
  request = ([9, 10, 11], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
  solo = run(eng, [request])[0].token_ids
  stream = Stream(eng, eng.add_request(*request))
  for _ in range(3):
    next(stream)
  stream.close()
  final = [o for o in eng.step() if o.request_id == stream.request_id]  # the abort is reported next step
  assert len(final) == 1 and final[0].finished and final[0].finish_reason == "abort"
  got = final[0].outputs[0].token_ids
  assert 3 <= len(got) < 30 and got == solo[:len(got)]
  assert all(s is None for s in eng.scheduler.slots) and not eng.has_unfinished()
  assert run(eng, [request])[0].token_ids == solo


def test_bad_request_is_rejected_alone():
  eng = make_engine(slots=2, max_len=64)
  reqs = eight_requests()[:3]
  solo = {i: run(eng, [r])[0].token_ids for i, r in enumerate(reqs)}
  ids = [eng.add_request(p, sp) for p, sp in reqs[:2]]
  eng.step()
  for bad, match in [(([3] * 64, SamplingParams()), "prompt has 64 tokens; the context limit is max_len=64"),
                     (([3, 4], SamplingParams(n=3)), r"n=3 exceeds the engine's max_batch=2"),
                     (([3, 4], SamplingParams(logit_bias={999: 1.0})), r"logit_bias=999 .*\[0, 300\)"),
                     (([3, 400], SamplingParams()), r"token id 400 at index 1 is outside the vocabulary \[0, 300\)")]:
    with pytest.raises(ValueError, match=match):
      eng.add_request(*bad)
  with pytest.raises(ValueError, match=r"SamplingParams.logprobs=50"):
    eng.add_request([3, 4], SamplingParams(logprobs=50))
  ids.append(eng.add_request(*reqs[2]))
  outs = {}
  while eng.has_unfinished():
    for o in eng.step():
      outs[o.request_id] = o
  assert [outs[r].token_ids for r in ids] == [solo[0], solo[1], solo[2]]


def test_metrics_snapshot():
  eng = fresh_counts(shared_engine(2))
  run(eng, eight_requests()[:4])
  m = eng.metrics()
  assert m["running"] == 0 and m["waiting"] == 0 and m["slots"] == 2
  # What the device holds for the cache, counted from the arrays themselves.
  held = sum(x.nbytes for x in jax.tree.leaves(eng.runner.state.cache.layers))
  assert m["kv_cache_bytes_allocated"] == held > 0
  assert m["prefill_tokens"] > 0 and m["decode_tokens"] > 0
  assert m["prefill_tok_s"] > 0 and m["decode_tok_s"] > 0
  eng.add_request([3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
  eng.step()
  eng.step()
  m = eng.metrics()
  assert m["running"] == 1 and 0 < m["kv_cache_bytes_in_use"] <= m["kv_cache_bytes_allocated"]
  assert m["slot_occupancy"] == 0.5


def test_nothing_compiles_after_warmup():
  cfg = tiny_config(max_context=4096)
  eng = make_engine(slots=4, max_len=3200, chunk=256, cfg=cfg)
  eng.warmup()
  before = compiles.count()
  rng = random.Random(0)
  pending = []
  for i in range(100):
    n = rng.choice([1, 2, 15, 16, 17, 100, 255, 256, 257, 600, 1500, 3000, rng.randint(1, 3000)])
    kw = rng.choice([dict(temperature=0.0), dict(temperature=1.0, top_k=5, seed=i), dict(top_p=0.8, min_p=0.05),
                     dict(repetition_penalty=1.2, logprobs=3), dict(n=2, temperature=0.5), dict(logit_bias={5: 2.0})])
    rid = eng.add_request([rng.randint(3, 299) for _ in range(n)], SamplingParams(max_tokens=rng.randint(1, 6), **kw))
    pending.append(rid)
    if i % 7 == 3:
      eng.abort(pending[rng.randrange(len(pending))])
    if i % 3 == 0:
      eng.step()
  while eng.has_unfinished():
    eng.step()
  assert compiles.count() == before, f"{compiles.count() - before} programs compiled after warm-up"


def test_warmup_compiles_a_number_of_programs_that_grows_with_log2_of_max_batch():
  """Warm-up compiles `num_programs` programs, counted in the jit caches of the engine's programs
  themselves: at 8 slots four more than at 2 (decode and the sampler over 4 and 8 rows), not six
  more forks."""
  counted = {}
  for slots in (2, 8):
    jax.clear_caches()  # fork and move are jitted module functions whose caches engines share
    eng = make_engine(slots=slots, max_len=64, chunk=32)
    eng.warmup()
    p = eng.runner.programs
    jitted = [p.prefill_program(True), p.prefill_program(False), p.decode, p.sample, p.fork, p.move, p.logits]
    counted[slots] = sum(f._cache_size() for f in jitted)
    assert counted[slots] == eng.num_programs
  assert counted[8] - counted[2] == 4


def test_the_decode_program_built_ahead_is_the_one_the_first_decode_step_runs():
  """`build_decode_ahead` traces the first decode program and loads it on a thread; the first
  decode step then builds nothing, and the tokens are those of an engine that built it itself."""
  params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
  want = run(make_engine(slots=2, max_len=64, chunk=32), [([5, 6, 7, 8], params)])[0].outputs[0].token_ids
  eng = make_engine(slots=2, max_len=64, chunk=32)
  eng.build_decode_ahead()
  assert eng.runner.ahead is not None
  rid = eng.add_request([5, 6, 7, 8], params)
  assert [len(o.outputs[0].token_ids) for o in eng.step()] == [1]
  eng.runner.await_ahead()  # as the first decode step does (no persistent cache here: nothing waited so far)
  before = compiles.count()
  outs = eng.step()
  assert compiles.count() == before, "the first decode step built its program again"
  while eng.has_unfinished():
    outs += eng.step()
  assert [o for o in outs if o.request_id == rid and o.finished][0].outputs[0].token_ids == want


def test_the_first_prefill_waits_for_a_load_ahead_but_not_for_a_compilation(monkeypatch):
  """A decode program loading from the persistent cache is waited for before the first prefill
  runs (the weights are not yet resident); one compiling from scratch is not, and the first decode
  step waits for it instead."""
  eng = make_engine(slots=2, max_len=64, chunk=32)
  monkeypatch.setattr(compiles, "persistent_cache_on", lambda: True)
  for lookup, waits in (("cache_hits", True), ("cache_misses", False)):
    release = threading.Event()
    eng.runner.ahead = threading.Thread(target=release.wait, args=(30,))
    eng.runner.ahead.start()
    monkeypatch.setattr(compiles, "cache_lookup", lambda thread, lookup=lookup: lookup)
    threading.Timer(0.3, release.set).start()
    t0 = time.perf_counter()
    eng.runner.await_ahead(unless_compiling=True)
    assert (time.perf_counter() - t0 >= 0.25) == waits, lookup
    assert (eng.runner.ahead is None) == waits
    eng.runner.await_ahead()  # what the first decode step does
    assert eng.runner.ahead is None


def test_every_program_build_hands_the_freed_heap_back(monkeypatch):
  """A program's load parses copies of it and frees them (~60 MB for the embedded model's
  prefill): after each compilation or load `compiles` hands the C heap's free pages back."""
  calls = []
  monkeypatch.setattr(compiles, "return_freed_heap", lambda: calls.append(1))
  jax.jit(lambda x: x * 3 + 1).lower(np.float32(1)).compile()
  assert calls


def test_first_tokens_go_out_before_the_first_decode_program_is_built():
  """Without warm-up, the step that prefills a request returns its first token at once, and
  only the next step builds (traces and compiles) the decode program: the first token does not
  wait for a program it does not need."""
  jax.clear_caches()  # engines of one config share their programs: an earlier test's may be built
  eng = make_engine(slots=2, max_len=64, chunk=32)
  eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
  outs = eng.step()
  assert [len(o.outputs[0].token_ids) for o in outs] == [1]
  assert eng.runner.programs.decode._cache_size() == 0, "the first step built a decode program"
  before = compiles.count()
  outs = eng.step()
  assert compiles.count() > before and eng.runner.programs.decode._cache_size() == 1
  while eng.has_unfinished():
    outs = eng.step() or outs
  assert [len(o.outputs[0].token_ids) for o in outs] == [3] and outs[0].finished


def test_a_prompt_draws_once_after_its_last_chunk(monkeypatch):
  """A 100-token prompt in chunks of 32 is four prefill dispatches and one sampling: the earlier
  chunks draw nothing (their draw would be discarded), and the output is plain greedy decoding's."""
  eng = make_engine(slots=1, chunk=32)
  ref = run_to_end(make_engine(slots=1, chunk=128), [list(range(3, 103))],
                   SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
  programs = eng.runner.programs
  calls = {"prefill": 0, "sample": 0}
  for name in calls:
    original = getattr(programs, name)

    def counted(*args, _name=name, _original=original, **kw):
      calls[_name] += 1
      return _original(*args, **kw)

    monkeypatch.setattr(programs, name, counted)
  eng.add_request(list(range(3, 103)), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
  while eng.has_unfinished():
    eng.step()
  assert calls == {"prefill": 4, "sample": 1}
  monkeypatch.undo()
  assert run_to_end(eng, [list(range(3, 103))], SamplingParams(max_tokens=4, temperature=0.0,
                                                                ignore_eos=True))[0].token_ids == ref[0].token_ids
