"""Prefix caching: a hit changes no logit beyond float noise and no token, sliding-window rings
included; the store's bookkeeping leaks nothing and respects its budget; nothing compiles."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ToyTokenizer, run_to_end, tiny_config, tiny_model
from flax import nnx
from jaxgen.decode import compiles, prefix
from jaxgen.decode.cache import CacheSpec
from jaxgen.decode.engine import Engine
from jaxgen.decode.params import SamplingParams
from jaxgen.decode.prefix import BLOCK
from jaxgen.decode.steps import (
  decode_logits,
  init_state,
  prefill_logits,
  restore_prefix,
  save_prefix,
)
from jaxgen.model import kv
from jaxgen.model.platform import resolve

WINDOW = 32  # tiny models here have rings of 32 entries: prompts of 100 tokens wrap them three times
LOGPROB_TOL = 1e-4


def ring_config(**kw):
  return tiny_config(sliding_window=WINDOW, max_context=1024, **kw)


MODEL = tiny_model(ring_config(), seed=3)


def engine(on=True, slots=4, max_len=256, chunk=64, cfg=None, **kw) -> Engine:
  model = MODEL if cfg is None else tiny_model(cfg, seed=3)
  return Engine(model, ToyTokenizer(model.cfg.vocab_size), max_batch=slots, max_len=max_len, prefill_chunk=chunk,
                seed=0, enable_prefix_caching=on, **kw)


run = run_to_end


def assert_same(a, b, tol=LOGPROB_TOL):
  """Same tokens, and the chosen and top logprobs of every position within `tol`."""
  for x, y in zip(a.outputs, b.outputs):
    assert x.token_ids == y.token_ids
    assert x.finish_reason == y.finish_reason
    if x.logprobs is not None:
      for px, py in zip(x.logprobs, y.logprobs):
        assert px.keys() == py.keys()
        for t in px:
          assert abs(px[t].logprob - py[t].logprob) <= tol, (t, px[t].logprob, py[t].logprob)


def ids(rng, n):
  return [int(x) for x in rng.integers(3, 300, n)]


# ----------------------------------------------------------------------------------- host parts
def test_chained_hashes_name_the_whole_prefix():
  rng = np.random.default_rng(0)
  a, b = ids(rng, 48), ids(rng, 48)
  same_tail = a[:32] + b[32:]
  ha, hb, hs = prefix.chain(a, 3), prefix.chain(b, 3), prefix.chain(same_tail, 3)
  assert ha[:2] == hs[:2] and ha[2] != hs[2]
  # Block 2 of `b` and of `same_tail` hold the same tokens, after different prefixes.
  assert b[32:48] == same_tail[32:48] and hb[2] != hs[2]
  assert prefix.chain(a, 3) == ha and len(prefix.chain(a[:47], 2)) == 2


def test_lru_evicts_a_chain_from_its_tail_and_never_an_ancestor_in_use():
  index = prefix.PrefixIndex(4)
  a = prefix.chain(list(range(3, 3 + 48)), 3)
  b = prefix.chain(list(range(100, 100 + 32)), 2)
  for i, h in enumerate(a):
    assert index.add(h, set(a)) is not None
  index.touch(a)
  assert index.add(b[0], set(b[:1])) is not None  # the last free block
  assert index.add(b[1], set(b)) is not None  # evicts a's deepest block, not its root
  assert a[2] not in index and a[0] in index and a[1] in index
  assert index.lookup(a) == index.lookup(a[:2]) and len(index.lookup(a)) == 2
  # Saving a chain longer than the store stops instead of evicting its own ancestors.
  c = prefix.chain(list(range(200, 200 + 96)), 6)
  got = [index.add(h, set(c)) for h in c]
  assert None in got and all(x is not None for x in got[:got.index(None)])
  assert index.evictions >= 1
  index.check()


# --------------------------------------------------------------------------------- device parts
@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_save_then_restore_rebuilds_the_row_a_prefill_leaves_rings_included(cache_dtype):
  """Row 0 prefills 112 tokens in chunks of 16 (a ring of 32 wraps), saving each chunk's block;
  restoring P tokens into row 1 gives, entry for entry, what prefilling those P tokens leaves in
  row 2: bit for bit, whether P ends inside the first window or after the ring wrapped."""
  cfg = MODEL.cfg
  spec = CacheSpec(slots=3, max_len=128, dtype=cache_dtype)
  platform = resolve("float32", cache_dtype=cache_dtype)
  store = prefix.allocate(cfg, prefix.StoreSpec(9, cache_dtype))
  state = init_state(cfg, spec)
  tokens = ids(np.random.default_rng(1), 112)
  table = np.full(8, 8, np.int32)
  fill = jax.jit(lambda c, t, s, fresh: prefill_logits(MODEL, c, t, jnp.array([16]), s, fresh=fresh,
                                                       platform=platform)[1], static_argnames="fresh")
  for i in range(7):
    chunk = jnp.array([tokens[16 * i:16 * (i + 1)]], jnp.int32)
    state = state.replace(cache=fill(state.cache, chunk, jnp.array([0]), i == 0))
    store = save_prefix(state, store, 0, 16 * i, jnp.array([i], jnp.int32))
    table[i] = i
  for p in (16, 32, 48, 96):
    row2 = init_state(cfg, spec).cache
    for i in range(p // 16):
      row2 = fill(row2, jnp.array([tokens[16 * i:16 * (i + 1)]], jnp.int32), jnp.array([2]), i == 0)
    got = restore_prefix(state, store, 1, jnp.asarray(table), p, jnp.zeros(128, jnp.int32)).cache
    assert int(got.lengths[1]) == p
    for layer, want in zip(got.layers, row2.layers):
      size = kv.capacity(layer)
      held = np.asarray(kv.entry_positions(jnp.array([p]), size, ring=True)[0]) >= 0
      for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a[1, :, :size])[:, held], np.asarray(b[2, :, :size])[:, held])


# ------------------------------------------------------------------------------------- engine
def test_a_hit_changes_no_token_and_no_logprob_beyond_float_noise():
  """B shares 75 tokens with A (a hit that ends mid-block, 64 tokens, after the ring wrapped);
  C shares 20 (a hit of 16 that ends inside the first window). Greedy and seeded samples, with
  logprobs, equal those of the same engine without the cache."""
  rng = np.random.default_rng(2)
  a = ids(rng, 100)
  b, c = a[:75] + ids(rng, 30), a[:20] + ids(rng, 40)
  eng = engine()
  greedy = SamplingParams(max_tokens=12, logprobs=5, temperature=0.0, ignore_eos=True)
  seeded = SamplingParams(max_tokens=12, logprobs=5, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
  cold = []
  for p in (b, c):
    for sp in (greedy, seeded):
      eng.reset_prefix_cache()
      cold.append(run(eng, [p], sp)[0])
  assert all(o.num_cached_tokens == 0 for o in cold)
  hot = []
  for p in (b, c):
    for sp in (greedy, seeded):
      eng.reset_prefix_cache()
      run(eng, [a], greedy)
      hot.append(run(eng, [p], sp)[0])
  assert [o.num_cached_tokens for o in hot] == [64, 64, 16, 16]
  for x, y in zip(hot, cold):
    assert_same(x, y)


def test_repeated_prompt_reuses_all_but_its_last_block_and_n_samples_share_it():
  rng = np.random.default_rng(3)
  p = ids(rng, 80)  # 5 full blocks: the last token's block is never reused
  eng = engine()
  first = run(eng, [p], SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=5, ignore_eos=True))[0]
  again = run(eng, [p], SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=5, ignore_eos=True))[0]
  assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64
  assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
  off = run(engine(on=False), [p], SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=5, ignore_eos=True))[0]
  assert off.num_cached_tokens is None


def test_a_conversation_reuses_the_earlier_turns_and_the_reply():
  """Turn 2's prompt is turn 1's prompt, its reply and a new message: everything up to the block
  holding the reply's last fed token is reused."""
  rng = np.random.default_rng(4)
  turn1 = ids(rng, 40)
  out1 = run(eng := engine(), [turn1], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
  turn2 = turn1 + out1.token_ids + ids(rng, 10)
  out2 = run(eng, [turn2], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
  assert out2.num_cached_tokens == (len(turn1) + len(out1.token_ids) - 1) // BLOCK * BLOCK == 48
  cold = run(engine(on=False), [turn2], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
  assert out2.token_ids == cold.token_ids


def test_metrics_count_hits_tokens_and_evictions():
  rng = np.random.default_rng(5)
  shared = ids(rng, 64)
  eng = engine(prefix_cache_tokens=8 * BLOCK)  # 7 usable blocks and one scratch
  run(eng, [shared + ids(rng, 5) for _ in range(3)], SamplingParams(max_tokens=2, ignore_eos=True))
  m = eng.metrics()
  assert m["prefix_cache"] and m["prefix_cache_blocks"] == 7 and m["prefix_cache_block_size"] == BLOCK
  assert m["prefix_cache_queries"] == 3 and m["prefix_cache_hits"] == 2
  assert m["prefix_cache_hit_tokens"] == 2 * 64 and m["prefix_cache_query_tokens"] == 3 * 69
  assert m["prefix_cache_hit_rate"] == pytest.approx(128 / 207)
  assert m["prefix_cache_blocks_used"] <= 7
  run(eng, [ids(rng, 100) for _ in range(2)], SamplingParams(max_tokens=2, ignore_eos=True))
  assert eng.metrics()["prefix_cache_evictions"] > 0
  eng.scheduler.index.check()


def test_budget_and_model_limits_are_explained_not_ignored():
  with pytest.raises(ValueError, match=r"prefix_cache_tokens=-1 must be >= 0"):
    engine(prefix_cache_tokens=-1)
  tiny_budget = engine(prefix_cache_tokens=BLOCK)
  assert tiny_budget.scheduler.index is None and "buys no block" in tiny_budget.config.prefix_note
  short_window = engine(cfg=tiny_config(sliding_window=8))
  assert short_window.scheduler.index is None and "shorter than a block" in short_window.metrics()["prefix_cache_note"]
  assert engine(on=False).metrics()["prefix_cache"] is False
  # The chunk fits the smallest ring, on a block boundary.
  assert engine(chunk=100).config.chunk == WINDOW and engine(on=False, chunk=100).config.chunk == 100


def test_store_allocation_is_what_the_budget_and_plan_say():
  eng = engine(prefix_cache_tokens=1000)
  allocated = sum(a.nbytes for a in jax.tree.leaves(eng.runner.store))
  assert allocated == eng.config.store.total_bytes(MODEL.cfg) == eng.metrics()["prefix_cache_bytes"]
  assert eng.config.store.blocks == 1000 // BLOCK
  assert allocated <= 1000 * prefix.bytes_per_block(MODEL.cfg, "float32") / BLOCK
  # Every layer, ring layers too, keeps every block: a cached token costs a global layer's bytes.
  per_token = 2 * MODEL.cfg.num_layers * MODEL.cfg.num_kv_heads * MODEL.cfg.head_dim * 4
  assert prefix.bytes_per_block(MODEL.cfg, "float32") == BLOCK * per_token
  # The default when the device does not report its memory: as many bytes as the KV cache.
  eng = engine()
  assert abs(eng.config.store.total_bytes(MODEL.cfg) - eng.config.cache.total_bytes(MODEL.cfg)) <= \
      prefix.bytes_per_block(MODEL.cfg, "float32")


def test_warmup_compiles_save_and_restore_too():
  jax.clear_caches()
  eng = engine(slots=2, max_len=128, chunk=32)
  eng.warmup()
  p = eng.runner.programs
  jitted = [p.prefill_program(True), p.prefill_program(False), p.decode, p.sample, p.fork, p.move, p.logits, p.save,
            p.restore]
  assert sum(f._cache_size() for f in jitted) == eng.num_programs


@pytest.mark.slow
def test_randomized_shared_prefixes_with_evictions_and_aborts_equal_the_uncached_run():
  """200 requests over 10 shared prefixes with random suffixes and mixed sampling, under a store
  of 12 blocks (evictions every few requests), with aborts: every completed output equals the
  run without the cache, nothing compiles after warm-up, no slot or block is leaked."""
  rng = random.Random(7)
  nrng = np.random.default_rng(7)
  prefixes = [ids(nrng, rng.randint(10, 90)) for _ in range(10)]
  work = []
  for i in range(200):
    prompt = prefixes[rng.randrange(10)] + ids(nrng, rng.randint(1, 30))
    kw = rng.choice([dict(temperature=0.0), dict(temperature=0.8, seed=i), dict(temperature=1.0, top_k=5, seed=i, n=2),
                     dict(logprobs=2), dict(repetition_penalty=1.3, temperature=0.5, seed=i)])
    work.append((prompt, SamplingParams(max_tokens=rng.randint(1, 6), ignore_eos=True, **kw), i % 9 == 4))

  def serve(eng):
    outs, live = {}, []
    for i, (prompt, sp, abort) in enumerate(work):
      rid = eng.add_request(prompt, sp, request_id=str(i))
      if abort:
        live.append(rid)
      if i % 3 == 0:
        for out in eng.step():
          outs[out.request_id] = out
      if i % 9 == 6 and live:
        eng.abort(live.pop(0))
    while eng.has_unfinished():
      for out in eng.step():
        outs[out.request_id] = out
    return outs

  # The same chunk for both, so the runs differ only by what the cache reuses.
  hot_eng = engine(slots=4, max_len=160, chunk=32, prefix_cache_tokens=13 * BLOCK)
  hot_eng.warmup()
  before = compiles.count()
  hot = serve(hot_eng)
  assert compiles.count() == before, f"{compiles.count() - before} programs compiled after warm-up"
  cold = serve(engine(on=False, slots=4, max_len=160, chunk=32))
  m = hot_eng.metrics()
  assert m["prefix_cache_hits"] > 50 and m["prefix_cache_evictions"] > 20
  compared = 0
  for rid, out in hot.items():
    if out.finish_reason == "abort" or cold[rid].finish_reason == "abort":
      continue
    assert_same(out, cold[rid])
    compared += 1
  assert compared > 150
  assert all(s is None for s in hot_eng.scheduler.slots) and not hot_eng.requests
  hot_eng.scheduler.index.check()
  assert len(hot_eng.scheduler.index) <= 12


# ------------------------------------------------------------------------------ embedded model
def _long_ids(golden):
  ids = golden["long"]["ids"].tolist()
  return ids + golden["code"]["ids"].tolist()[1:] + golden["list"]["ids"].tolist()[1:]


@pytest.mark.slow
@pytest.mark.parametrize("shared", [1100, 300], ids=["ring-wrapped", "inside-window"])
def test_embedded_model_logits_after_a_hit_equal_one_uncached_pass(llm, golden, shared):
  """Gemma 3 270M (rings of 512): prompt A of 1,200 tokens is prefilled in chunks of 256 and its
  blocks saved; prompt B shares `shared` tokens with it (a hit ending mid-block: 1,088 tokens,
  after the rings wrapped; or 288, inside the first window), restores them, prefills the rest and
  decodes 16 tokens teacher-forced. Every logit equals one uncached pass over B within 1e-4."""
  ids = _long_ids(golden)
  a = ids[:1200]
  b = ids[:shared] + ids[1200:1200 + 100]
  model, cfg, platform = llm.model, llm.cfg, llm.platform
  gd, params = nnx.split(model)
  pre = jax.jit(lambda p, c, t, n, s, fresh: prefill_logits(nnx.merge(gd, p), c, t, n, s, fresh=fresh,
                                                            platform=platform), static_argnums=5)
  dec = jax.jit(lambda p, c, t, act: decode_logits(nnx.merge(gd, p), c, t, act, limit=1536, platform=platform)[:2])
  spec = CacheSpec(slots=4, max_len=1536)
  state = init_state(cfg, spec)
  store = prefix.allocate(cfg, prefix.StoreSpec(1536 // BLOCK + 1, "float32"))
  scratch = 1536 // BLOCK

  def prefill(cache, tokens, slot, start):
    logits = None
    for s in range(start, len(tokens), 256):
      n = min(256, len(tokens) - s)
      chunk = np.zeros((1, 256), np.int32)
      chunk[0, :n] = tokens[s:s + n]
      logits, cache = pre(params, cache, chunk, np.array([n], np.int32), np.array([slot], np.int32), s == 0)
    return logits, cache

  for s in range(0, 1200, 256):  # A, saving each chunk's full blocks as the engine does
    _, cache = prefill(state.cache, a[:s + 256], 0, s)
    state = state.replace(cache=cache)
    blocks = np.full(16, scratch, np.int32)
    full = range(s // BLOCK, min(s + 256, 1200) // BLOCK)
    blocks[:len(full)] = list(full)
    store = save_prefix(state, store, 0, s, jnp.asarray(blocks))
  p = shared // BLOCK * BLOCK
  table = np.full(1536 // BLOCK, scratch, np.int32)
  table[:p // BLOCK] = np.arange(p // BLOCK)
  tokens = np.zeros(1536, np.int32)
  tokens[:p] = b[:p]
  state = restore_prefix(state, store, 2, jnp.asarray(table), p, jnp.asarray(tokens))
  prompt = b[:-16]
  last, cache = prefill(state.cache, prompt, 2, p)
  ref = llm.logits(b)
  np.testing.assert_allclose(np.asarray(last[0]), ref[len(prompt) - 1], atol=1e-4, rtol=1e-4)
  active = np.zeros(3, bool)
  active[2] = True
  for pos in range(len(prompt), len(b)):
    step = np.zeros(3, np.int32)
    step[2] = b[pos]
    logits, cache = dec(params, cache, step, active)
    np.testing.assert_allclose(np.asarray(logits[2]), ref[pos], atol=1e-4, rtol=1e-4, err_msg=f"position {pos}")


@pytest.mark.slow
def test_embedded_model_hits_change_no_token(llm, golden):
  """Through the engine: greedy (with logprobs) and seeded outputs of prompts that share 1,100 or
  300 tokens with a 1,200-token prompt are the same after a hit as without one."""
  ids = _long_ids(golden)
  a = ids[:1200]
  greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)
  seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
  try:
    for shared, hit in ((1100, 1088), (300, 288)):
      b = ids[:shared] + ids[1200:1260]
      llm.reset_prefix_cache()
      cold = llm.generate([b, b], [greedy, seeded], use_tqdm=False)
      llm.reset_prefix_cache()
      llm.generate(a, SamplingParams(max_tokens=1), use_tqdm=False)
      hot = llm.generate([b, b], [greedy, seeded], use_tqdm=False)
      assert [o.num_cached_tokens for o in cold] == [0, len(b) - 1 - (len(b) - 1) % BLOCK]
      assert [o.num_cached_tokens for o in hot] == [hit, len(b) - 1 - (len(b) - 1) % BLOCK]
      for x, y in zip(hot, cold):
        assert_same(x, y)
  finally:
    llm.reset_prefix_cache()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:the model has no chat template")
def test_embedded_model_chat_turn_two_reuses_turn_one(llm):
  llm.reset_prefix_cache()
  params = SamplingParams(max_tokens=24, temperature=0.0)
  conv = [{"role": "user", "content": "Name three rivers of Europe."}]
  first = llm.chat(conv, params, use_tqdm=False)[0]
  conv += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Which is longest?"}]
  second = llm.chat(conv, params, use_tqdm=False)[0]
  assert second.num_cached_tokens >= (len(first.prompt_token_ids) + len(first.token_ids) - 1) // BLOCK * BLOCK - BLOCK
  assert second.num_cached_tokens > len(first.prompt_token_ids)
  llm.reset_prefix_cache()
