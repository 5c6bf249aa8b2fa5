"""Cached prefill (fresh and chunked) + decode steps == one uncached forward, on tiny models.

The sliding window (8) is much shorter than the sequences, so the ring buffer of the local
layers wraps many times, also inside one prefill chunk.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgen.decode import cache as kvc
from jaxgen.decode import steps
from jaxgen.model.config import LOCAL
from conftest import tiny_config, tiny_model


def cached_logits(model, ids, chunks, slots=3, slot=1, max_len=64):
  """Prefills ids[:sum(chunks)] in the given chunk sizes into `slot`, then decodes the rest
  teacher-forced. Returns {position: logits} for each chunk end and each decode step."""
  cfg = model.cfg
  gd, params = nnx.split(model)
  cache = kvc.allocate(cfg, kvc.CacheSpec(slots, max_len))

  @functools.partial(jax.jit, static_argnames="fresh")
  def pre(params, cache, tokens, counts, slots, fresh):
    return steps.prefill_logits(nnx.merge(gd, params), cache, tokens, counts, slots, fresh=fresh)

  @jax.jit
  def dec(params, cache, tokens, active):
    logits, cache, _ = steps.decode_logits(nnx.merge(gd, params), cache, tokens, active)
    return logits, cache

  out, done = {}, 0
  for i, n in enumerate(chunks):
    bucket = 16 if n <= 16 else 32
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :n] = ids[done:done + n]
    logits, cache = pre(params, cache, tokens, np.array([n], np.int32), np.array([slot], np.int32), fresh=i == 0)
    done += n
    out[done - 1] = np.asarray(logits[0])
  active = np.zeros(slots, bool)
  active[slot] = True
  for pos in range(done, len(ids)):
    tokens = np.zeros(slots, np.int32)
    tokens[slot] = ids[pos]
    logits, cache = dec(params, cache, tokens, active)
    out[pos] = np.asarray(logits[slot])
  assert int(cache.lengths[slot]) == len(ids)
  assert all(int(cache.lengths[s]) == 0 for s in range(slots) if s != slot)
  return out


def uncached(model, ids):
  positions = jnp.arange(len(ids))[None]
  return np.asarray(model.logits(model(jnp.asarray([ids]), positions)))[0]


@pytest.mark.parametrize("chunks", [(5,), (20,), (16, 7), (3, 16, 16, 2)])
def test_cached_equals_uncached(chunks):
  model = tiny_model()
  ids = list(np.random.default_rng(1).integers(3, 300, 50))
  ref = uncached(model, ids)
  got = cached_logits(model, ids, chunks)
  assert len(got) == len(chunks) + 50 - sum(chunks)
  for pos, logits in got.items():
    np.testing.assert_allclose(logits, ref[pos], atol=1e-4, rtol=1e-4, err_msg=f"position {pos}")


def test_all_global_layers_and_grouped_heads():
  cfg = tiny_config(sliding_window=None, layer_kinds=("global",) * 4, num_kv_heads=1, qk_norm=False,
                    sandwich_norm=False, norm_offset=0.0, activation="silu", embed_scale=False, query_scale=0.0)
  model = tiny_model(cfg)
  ids = list(np.random.default_rng(2).integers(3, 300, 30))
  ref = uncached(model, ids)
  for pos, logits in cached_logits(model, ids, (9, 16)).items():
    np.testing.assert_allclose(logits, ref[pos], atol=1e-4, rtol=1e-4, err_msg=f"position {pos}")


def test_entry_positions_of_ring_and_full_layers():
  lengths = jnp.array([0, 3, 8, 11])
  ring = np.asarray(kvc.entry_positions(lengths, 4, ring=True))
  np.testing.assert_array_equal(ring, [[-1, -1, -1, -1], [0, 1, 2, -1], [4, 5, 6, 7], [8, 9, 10, 7]])
  full = np.asarray(kvc.entry_positions(lengths, 12, ring=False))
  np.testing.assert_array_equal(full[1], [0, 1, 2] + [-1] * 9)
  np.testing.assert_array_equal(full[3], list(range(11)) + [-1])


def test_cache_sizes_ring_vs_full():
  cfg = tiny_config()  # 4 layers: local, global, local, global; window 8
  spec = kvc.CacheSpec(slots=2, max_len=64)
  per_entry = 2 * cfg.num_kv_heads * cfg.head_dim * 4
  assert spec.bytes_per_slot(cfg) == per_entry * (8 + 64 + 8 + 64 + 4)  # + a scratch entry per layer
  assert spec.total_bytes(cfg) == 2 * spec.bytes_per_slot(cfg)
  shapes = spec.shapes(cfg)
  assert [layer.k.shape[2] for layer in shapes.layers] == [9, 65, 9, 65]
  allocated = kvc.allocate(cfg, spec)
  assert sum(x.nbytes for x in jax.tree.leaves(allocated.layers)) == spec.total_bytes(cfg)


def test_attention_reads_only_up_to_the_longest_row_taking_tokens():
  """The cache block each layer attends to is bounded by the longest row that takes tokens now:
  a finished slot that keeps a long length does not make every later step read its entries."""
  cfg = tiny_config()
  cache = kvc.allocate(cfg, kvc.CacheSpec(3, 64))
  start = jnp.array([5, 40, 12], jnp.int32)  # row 1: a finished request's stale length
  counts = jnp.array([1, 0, 1], jnp.int32)
  hook = steps._CacheHook(cfg, cache, start, counts, start[:, None], fresh=False)
  h = cfg.head_dim
  k = jnp.zeros((3, 1, cfg.num_kv_heads, h))
  for i in range(cfg.num_layers):
    blocks, _ = hook(i, k, k)
    want = min(12, kvc.capacity(cache.layers[i]))
    assert int(blocks[0][3]) == want, (i, int(blocks[0][3]), want)


def test_bench_counts_the_kv_entries_attention_reads():
  """`jaxgen bench`'s MBU counts what attention reads: whole chunks up to the filled length (XLA's
  loop, the scratch entry at most) or just the filled entries (the CPU kernel, in place)."""
  from jaxgen.decode.bench import kv_bytes_read
  from jaxgen.model.layers import attn_chunk, reads_cache_in_place

  cfg = tiny_config()  # window 8: ring layers hold 8 entries (+1 scratch), global ones max_len (+1)
  chunk = attn_chunk(2 * cfg.num_kv_heads, 1)
  max_len = 2 * chunk + 10
  cache = kvc.allocate(cfg, kvc.CacheSpec(2, max_len))
  entry = 2 * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # k and v, 2 rows, float32
  ring = cfg.layer_kinds.count(LOCAL)
  full = cfg.num_layers - ring
  # 5 tokens: ring layers read all 9 entries (smaller than a chunk), global ones one chunk.
  assert kv_bytes_read(cache, 5, in_place=False) == entry * (ring * 9 + full * chunk)
  # One past a chunk: two chunks; at the end, never more than the layer holds.
  assert kv_bytes_read(cache, chunk + 1, in_place=False) == entry * (ring * 9 + full * 2 * chunk)
  assert kv_bytes_read(cache, max_len, in_place=False) == entry * (ring * 9 + full * (max_len + 1))
  # In place: the filled entries, up to a ring's window.
  assert kv_bytes_read(cache, 5, in_place=True) == entry * (ring * 5 + full * 5)
  assert kv_bytes_read(cache, chunk + 1, in_place=True) == entry * (ring * 8 + full * (chunk + 1))
  # Unstated: as this process's decode step does (float32 cache, head dim 16).
  assert kv_bytes_read(cache, 5) == kv_bytes_read(cache, 5, in_place=reads_cache_in_place(np.float32, cfg.head_dim))


def _cache_copies(hlo: str, shapes) -> list[str]:
  """Copy instructions of the entry computation whose result has a cache array's shape."""
  entry = hlo[hlo.index("\nENTRY"):]
  dims = {",".join(map(str, s.shape)) for s in shapes}
  found = []
  for line in entry.splitlines():
    m = re.match(r"\s+%copy[.\d]* = \w+\[([\d,]*)\]", line)
    if m and m.group(1) in dims:
      found.append(line.strip()[:120])
  return found


def test_decode_step_updates_the_cache_in_place():
  """The compiled decode step writes the new entries into the donated cache without copying it
  (XLA copies every layer when it cannot order the write after attention's reads)."""
  from conftest import ToyTokenizer
  from jaxgen.decode.engine import Engine

  cfg = tiny_config()
  eng = Engine(tiny_model(cfg), ToyTokenizer(cfg.vocab_size), max_batch=2, max_len=64)
  hlo = eng.programs.decode.lower(eng.params, eng.state, np.ones(2, np.bool_), np.bool_(False)).compile().as_text()
  layers = eng.state.cache.layers
  assert _cache_copies(hlo, [l.k for l in layers]) == []


def test_a_row_with_a_non_finite_attention_output_spoils_only_its_own_cache_entries():
  cfg = tiny_config()
  cache = kvc.allocate(cfg, kvc.CacheSpec(2, 16))
  start = jnp.array([3, 5], jnp.int32)
  hook = steps._CacheHook(cfg, cache, start, jnp.ones(2, jnp.int32), start[:, None], fresh=False)
  k = jnp.ones((2, 1, cfg.num_kv_heads, cfg.head_dim))
  _, store = hook(0, k, k)
  after = jnp.zeros((2, 1, cfg.num_heads, cfg.head_dim)).at[0].set(jnp.nan)
  store(after)
  written = hook.layers[0].k[1, :, 5]  # row 1's new entry
  np.testing.assert_array_equal(np.asarray(written), 1.0)
