"""Cached prefill (fresh and chunked) + decode steps == one uncached forward, on tiny models,
through every attention implementation (the plain formulation TPU and GPU run, XLA:CPU's chunked
loop, the CPU kernel) and in the accelerators' dtypes (bf16 activations with a bf16 cache).

The sliding window (8) is much shorter than the sequences, so the ring buffer of the local
layers wraps many times, also inside one prefill chunk.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import platform_for, tiny_config, tiny_model
from flax import nnx
from jaxgen.decode import cache as kvc
from jaxgen.decode import steps
from jaxgen.model import kv, quant
from jaxgen.model.batch import BatchMeta
from jaxgen.model.config import LOCAL
from jaxgen.model.platform import REFERENCE

IMPLS = ["xla", "xla_chunked", "cpu"]


def cached_logits(model, ids, chunks, platform, slots=3, slot=1, max_len=64, cache_dtype="float32"):
  """Prefills ids[:sum(chunks)] in the given chunk sizes into `slot`, then decodes the rest
  teacher-forced. Returns {position: logits} for each chunk end and each decode step."""
  cfg = model.cfg
  gd, params = nnx.split(model)
  cache = kvc.allocate(cfg, kvc.CacheSpec(slots, max_len, cache_dtype))

  @functools.partial(jax.jit, static_argnames="fresh")
  def pre(params, cache, tokens, counts, slots, fresh):
    return steps.prefill_logits(nnx.merge(gd, params), cache, tokens, counts, slots, fresh=fresh, platform=platform)

  @jax.jit
  def dec(params, cache, tokens, active):
    logits, cache, _ = steps.decode_logits(nnx.merge(gd, params), cache, tokens, active, limit=max_len,
                                           platform=platform)
    return logits, cache

  out, done = {}, 0
  for i, n in enumerate(chunks):
    bucket = 16 if n <= 16 else 32
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :n] = ids[done:done + n]
    logits, cache = pre(params, cache, tokens, np.array([n], np.int32), np.array([slot], np.int32), fresh=i == 0)
    done += n
    out[done - 1] = np.asarray(logits[0])
  rows = slot + 1  # a decode step covers the lowest rows holding the running one
  active = np.zeros(rows, bool)
  active[slot] = True
  for pos in range(done, len(ids)):
    tokens = np.zeros(rows, np.int32)
    tokens[slot] = ids[pos]
    logits, cache = dec(params, cache, tokens, active)
    out[pos] = np.asarray(logits[slot])
  assert int(cache.lengths[slot]) == len(ids)
  assert all(int(cache.lengths[s]) == 0 for s in range(slots) if s != slot)
  return out


def uncached(model, ids):
  positions = jnp.arange(len(ids))[None]
  return np.asarray(model.logits(model(jnp.asarray([ids]), positions)[0]))[0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chunks", [(5,), (20,), (16, 7), (3, 16, 16, 2)])
def test_cached_equals_uncached(chunks, impl):
  model = tiny_model()
  ids = list(np.random.default_rng(1).integers(3, 300, 50))
  ref = uncached(model, ids)
  got = cached_logits(model, ids, chunks, platform_for(impl))
  assert len(got) == len(chunks) + 50 - sum(chunks)
  for pos, logits in got.items():
    np.testing.assert_allclose(logits, ref[pos], atol=1e-4, rtol=1e-4, err_msg=f"position {pos}")


@pytest.mark.parametrize("impl", IMPLS)
def test_all_global_layers_and_grouped_heads(impl):
  cfg = tiny_config(sliding_window=None, layer_kinds=("global",) * 4, num_kv_heads=1, qk_norm=False,
                    sandwich_norm=False, norm_offset=0.0, activation="silu", embed_scale=False, query_scale=0.0)
  model = tiny_model(cfg)
  ids = list(np.random.default_rng(2).integers(3, 300, 30))
  ref = uncached(model, ids)
  for pos, logits in cached_logits(model, ids, (9, 16), platform_for(impl)).items():
    np.testing.assert_allclose(logits, ref[pos], atol=1e-4, rtol=1e-4, err_msg=f"position {pos}")


@pytest.mark.parametrize("chunks", [(5,), (16, 7)])
def test_accelerator_dtypes_cached_equal_uncached(chunks):
  """bf16 weights, bf16 activations and a bf16 cache through the plain formulation, as TPU and GPU
  run: cached logits equal the uncached bf16 pass (same rounding points) within bf16 tolerance,
  and pick the same top token wherever the uncached pass is decisive."""
  model = tiny_model(dtype=jnp.bfloat16)
  ids = list(np.random.default_rng(3).integers(3, 300, 40))
  ref = uncached(model, ids)
  got = cached_logits(model, ids, chunks, REFERENCE, cache_dtype="bfloat16")
  for pos, logits in got.items():
    np.testing.assert_allclose(logits, ref[pos], atol=0.05, rtol=0.02, err_msg=f"position {pos}")
    top2 = np.sort(ref[pos])[-2:]
    if top2[1] - top2[0] > 0.1:
      assert logits.argmax() == ref[pos].argmax(), pos


def test_entry_positions_of_ring_and_full_layers():
  lengths = jnp.array([0, 3, 8, 11])
  ring = np.asarray(kv.entry_positions(lengths, 4, ring=True))
  np.testing.assert_array_equal(ring, [[-1, -1, -1, -1], [0, 1, 2, -1], [4, 5, 6, 7], [8, 9, 10, 7]])
  full = np.asarray(kv.entry_positions(lengths, 12, ring=False))
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
  rows = BatchMeta(jnp.array([5, 40, 12], jnp.int32), jnp.array([1, 0, 1], jnp.int32))  # row 1: stale
  for i, kind in enumerate(cfg.layer_kinds):
    block = kv.held(cache.layers[i], rows, kind == LOCAL)
    want = min(12, kv.capacity(cache.layers[i]))
    assert int(block.limit) == want, (i, int(block.limit), want)
  # The control: with row 1 taking a token, its length counts.
  block = kv.held(cache.layers[1], rows._replace(count=jnp.array([1, 1, 1], jnp.int32)), False)
  assert int(block.limit) == 40


@pytest.mark.parametrize("impl", IMPLS)
def test_bench_counts_the_kv_entries_attention_reads(impl):
  """`jaxgen bench`'s MBU counts what attention reads: whole chunks up to the filled length (XLA:CPU's
  loop, the scratch entry at most), just the filled entries (the CPU kernel), or every entry (the
  plain formulation); a step over fewer rows than slots reads only those rows."""
  from jaxgen.bench import kv_bytes_read
  from jaxgen.model.kernels.attention import cpu_chunk

  cfg = tiny_config()  # window 8: ring layers hold 8 entries (+1 scratch), global ones max_len (+1)
  chunk = cpu_chunk(2 * cfg.num_kv_heads, 1)
  max_len = 2 * chunk + 10
  cache = kvc.allocate(cfg, kvc.CacheSpec(2, max_len))
  entry = 2 * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # k and v, 2 rows, float32
  ring = cfg.layer_kinds.count(LOCAL)
  full = cfg.num_layers - ring
  p = platform_for(impl)
  for length, want_chunked, want_kernel in [
      (5, ring * 9 + full * chunk, ring * 5 + full * 5),  # ring layers: all 9 entries (less than a chunk)
      (chunk + 1, ring * 9 + full * 2 * chunk, ring * 8 + full * (chunk + 1)),
      (max_len, ring * 9 + full * (max_len + 1), ring * 8 + full * max_len)]:  # never more than a layer holds
    want = {"xla": ring * 9 + full * (max_len + 1), "xla_chunked": want_chunked, "cpu": want_kernel}[impl]
    assert kv_bytes_read(cache, length, p) == entry * want, length
    assert kv_bytes_read(cache, length, p, rows=1) == entry * want // 2


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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows", [1, 2])
def test_decode_step_updates_the_cache_in_place(impl, rows):
  """The compiled decode step writes the new entries into the donated cache without copying it
  (XLA copies every layer when it cannot order the write after attention's reads), whether it
  covers every slot or the lowest rows only."""
  from conftest import ToyTokenizer
  from jaxgen.decode.engine import Engine

  cfg = tiny_config()
  eng = Engine(tiny_model(cfg), ToyTokenizer(cfg.vocab_size), max_batch=2, max_len=64, platform=platform_for(impl))
  hlo = eng.runner.programs.decode.lower(eng.runner.params, eng.runner.state, np.ones(rows, np.bool_)).compile().as_text()
  layers = eng.runner.state.cache.layers
  assert _cache_copies(hlo, [l.k for l in layers]) == []


def test_the_copy_detector_sees_a_copied_cache():
  """The positive control of the test above: a program that reads a layer after writing it must
  keep the old one, so XLA copies it; the detector must say so."""
  cfg = tiny_config()
  cache = kvc.allocate(cfg, kvc.CacheSpec(2, 64))

  def both(layer):
    new = layer.k.at[:, :, 3].set(1.0)
    return new, layer.k.sum()

  hlo = jax.jit(both, donate_argnums=0).lower(cache.layers[1]).compile().as_text()
  assert _cache_copies(hlo, [cache.layers[1].k])


def test_a_row_with_a_non_finite_attention_output_spoils_only_its_own_cache_entries():
  cfg = tiny_config()
  cache = kvc.allocate(cfg, kvc.CacheSpec(2, 16))
  rows = BatchMeta(jnp.array([3, 5], jnp.int32), jnp.ones(2, jnp.int32))
  k = jnp.ones((2, 1, cfg.num_kv_heads, cfg.head_dim))
  after = jnp.zeros((2, 1, cfg.num_heads, cfg.head_dim)).at[0].set(jnp.nan)
  written = kv.write(cache.layers[0], k, k, rows, after)
  np.testing.assert_array_equal(np.asarray(written.k[1, :, 5]), 1.0)  # row 1's new entry
  assert np.isnan(np.asarray(written.k[0, :, 3])).all()  # row 0's: the zero it carries is NaN


# ------------------------------------------------------------------------------- int8 entries
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chunks", [(5,), (16, 7), (3, 16, 16, 2)])
def test_int8_cache_stays_close_to_the_float_cache(chunks, impl):
  """Chunked prefill and decode over an int8 cache (rings of 8 wrapped several times), on every
  attention implementation: within a few percent of the float32 cache, same greedy choice
  wherever the float cache is decisive."""
  model = tiny_model()
  ids = list(np.random.default_rng(1).integers(3, 300, 50))
  ref = cached_logits(model, ids, chunks, platform_for(impl))
  got = cached_logits(model, ids, chunks, platform_for(impl), cache_dtype="int8")
  assert got.keys() == ref.keys()
  for pos in ref:
    scale = np.abs(ref[pos]).max()
    np.testing.assert_allclose(got[pos], ref[pos], atol=0.03 * scale, rtol=0, err_msg=f"position {pos}")
    top2 = np.sort(ref[pos])[-2:]
    if top2[1] - top2[0] > 0.05 * scale:
      assert got[pos].argmax() == ref[pos].argmax(), pos


def test_int8_entries_read_back_within_half_a_step_in_their_ring_slots():
  cfg = tiny_config()
  spec = kvc.CacheSpec(2, 16, "int8")
  cache = kvc.allocate(cfg, spec)
  layer = cache.layers[0]  # a ring of 8
  assert layer.k.dtype == jnp.int8 and layer.k_scale.shape == (2, cfg.num_kv_heads, 9, 1)  # H=16: one block
  rng = np.random.default_rng(4)
  k = jnp.asarray(rng.normal(size=(1, 11, cfg.num_kv_heads, cfg.head_dim)) * 3, jnp.float32)
  v = jnp.asarray(rng.normal(size=(1, 11, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
  rows = BatchMeta(jnp.array([0], jnp.int32), jnp.array([11], jnp.int32), jnp.array([1], jnp.int32))
  layer = kv.write(layer, k, v, rows, after=jnp.zeros((1, 11, 4, 16)))
  block = kv.held(layer, BatchMeta(jnp.array([11], jnp.int32), jnp.array([1], jnp.int32), jnp.array([1], jnp.int32)),
                  ring=True)
  got_k = np.asarray(quant.dequantize(block.k[1], block.k_scale[1], jnp.float32))  # [K, 9, H]
  pos = np.asarray(block.pos[0])
  for j in range(8):  # entry j holds the latest position p < 11 with p % 8 == j
    p = pos[j]
    assert p == max(q for q in range(11) if q % 8 == j)
    want = np.asarray(k[0, p])  # [K, H]
    step = np.asarray(block.k_scale[1, :, j])  # [K, 1]
    assert np.all(np.abs(got_k[:, j] - want) <= step / 2 + 1e-7)
  assert not np.asarray(layer.k[0]).any()  # row 0 untouched
  assert spec.bytes_per_slot(cfg) == sum(x.nbytes for x in jax.tree.leaves(cache.layers)) // 2
