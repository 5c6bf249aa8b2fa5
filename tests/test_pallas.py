"""The Pallas ragged cache-attention kernel (interpret mode on this CPU) against the plain-XLA
reference: ragged rows (length 0 included), rows read through an index, a wrapped ring with its
window, soft-capping, GQA ratios 1/2/4/8, several queries per row, an int8 cache; then the
embedded model's golden greedy continuations through it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jaxgen import LLM, SamplingParams
from jaxgen.model.kernels import attention as A
from jaxgen.model import quant
from jaxgen.model.kernels.attention import KVBlock
from jaxgen.model.kv import entry_positions

TOL = 1e-5  # float32


def blocks_for(rng, *, b, t, n, kh, h, size, lengths, ring, int8=False):
  q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
  k = rng.normal(size=(b + 1, kh, size, h)).astype(np.float32)
  v = rng.normal(size=(b + 1, kh, size, h)).astype(np.float32)
  scales = {}
  if int8:
    (k, ks), (v, vs) = quant.quantize(jnp.asarray(k), quant.KV_GROUP), quant.quantize(jnp.asarray(v), quant.KV_GROUP)
    scales = dict(k_scale=ks, v_scale=vs)
  rows = jnp.asarray(rng.permutation(b + 1)[:b], jnp.int32)  # the batch's rows sit anywhere in the cache
  lengths = jnp.asarray(lengths, jnp.int32)
  pos = entry_positions(lengths, size, ring)
  q_pos = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  limit = jnp.minimum(jnp.max(lengths), size)
  fresh = KVBlock(jnp.asarray(rng.normal(size=(b, kh, t, h)), jnp.float32),
                  jnp.asarray(rng.normal(size=(b, kh, t, h)), jnp.float32), q_pos)
  held = KVBlock(jnp.asarray(k), jnp.asarray(v), pos, limit, rows, **scales, start=lengths, ring=size if ring else None)
  return q, [held, fresh], q_pos


@pytest.mark.parametrize("n,kh", [(4, 4), (4, 2), (8, 2), (8, 1)], ids=["gqa1", "gqa2", "gqa4", "gqa8"])
@pytest.mark.parametrize("t", [1, 3])
def test_ragged_rows_match_the_reference(n, kh, t):
  rng = np.random.default_rng(n * 10 + kh + t)
  q, blocks, q_pos = blocks_for(rng, b=4, t=t, n=n, kh=kh, h=32, size=300, lengths=[0, 1, 137, 290], ring=False)
  want = A.attention_xla(q, blocks, q_pos, None, None)
  got = A.attention_pallas(q, blocks, q_pos, None, None)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_a_wrapped_ring_with_its_window_and_softcap(softcap):
  rng = np.random.default_rng(7)
  # A ring of 64 entries: rows that wrapped (1000, 65), one that did not (30), one empty (0).
  q, blocks, q_pos = blocks_for(rng, b=4, t=1, n=4, kh=2, h=16, size=64, lengths=[1000, 65, 30, 0], ring=True)
  want = A.attention_xla(q, blocks, q_pos, 64, softcap)
  got = A.attention_pallas(q, blocks, q_pos, 64, softcap)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_an_int8_cache_is_dequantized_as_the_reference_does():
  rng = np.random.default_rng(3)
  q, blocks, q_pos = blocks_for(rng, b=3, t=1, n=8, kh=2, h=32, size=200, lengths=[5, 0, 180], ring=False, int8=True)
  want = A.attention_xla(q, blocks, q_pos, None, 30.0)
  got = A.attention_pallas(q, blocks, q_pos, None, 30.0)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("n,kh,t,ring,softcap", [(4, 4, 1, False, None), (8, 2, 3, False, None), (8, 1, 1, False, 20.0),
                                               (4, 2, 1, True, None), (4, 2, 2, True, 20.0)])
def test_the_gpu_kernel_matches_the_reference(n, kh, t, ring, softcap):
  """The GPU variant (`pallas_gpu.py`, a loop over each row's cache blocks), interpreted: what an
  emulated GPU platform with attention_impl="pallas" runs. Measured 7e-7 to 3e-6."""
  from jaxgen.model.platform import Platform

  rng = np.random.default_rng(n + kh + t)
  size, window = (64, 64) if ring else (300, None)
  q, blocks, q_pos = blocks_for(rng, b=4, t=t, n=n, kh=kh, h=32, size=size,
                                lengths=[1000, 65, 30, 0] if ring else [0, 1, 137, 290], ring=ring)
  want = A.attention_xla(q, blocks, q_pos, window, softcap)
  got = A.attention_pallas(q, blocks, q_pos, window, softcap, Platform(backend="gpu", emulated=True, attention="pallas"))
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_a_mesh_without_its_kernel_layout_is_a_clear_error():
  """Several devices and no `kernel_mesh`: XLA cannot partition a kernel, so it would gather the
  cache; refused instead (EngineConfig.resolve sets the layout from the rules table)."""
  from jaxgen.model.platform import Platform

  rng = np.random.default_rng(1)
  q, blocks, q_pos = blocks_for(rng, b=2, t=1, n=4, kh=2, h=16, size=64, lengths=[3, 9], ring=False)
  with pytest.raises(ValueError, match="over 8 devices needs Platform.kernel_mesh"):
    A.attention_pallas(q, blocks, q_pos, None, None, Platform(devices=8, attention="pallas"))


def test_unknown_impl_is_refused_naming_the_choices():
  with pytest.raises(ValueError, match="pallas"):
    LLM(attention_impl="triton")
  with pytest.raises(ValueError, match="matmul_impl='pallas'"):
    LLM(matmul_impl="pallas")


@pytest.mark.slow
def test_embedded_model_reproduces_the_golden_continuations(golden):
  llm = LLM(attention_impl="pallas", max_len=1536, max_batch=1, prefill_chunk=256)
  assert llm.platform.attention == "pallas"
  for name in ("english", "long"):  # "long" is 1,177 tokens: past the 512-token window of the ring layers
    ids = golden[name]["ids"].tolist()
    out = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert out.token_ids == golden[name]["greedy_ids"][:8].tolist(), name


@pytest.mark.slow
def test_the_device_check_script_is_green_on_cpu(tmp_path):
  """benchmarks/accelerator.py --tiny: the script a lent TPU or GPU runs, kept working here."""
  import json
  import pathlib
  import subprocess
  import sys

  script = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "accelerator.py"
  out = tmp_path / "acc.json"
  proc = subprocess.run([sys.executable, str(script), "--tiny", "--out", str(out)], capture_output=True, text=True,
                        timeout=400)
  assert proc.returncode == 0, proc.stderr[-4000:]
  r = json.loads(out.read_text())
  assert r["kernel_max_abs_diff"]["float32"] <= 1e-5 and r["kernel_max_abs_diff"]["bfloat16"] <= 2e-2
  assert r["greedy_tokens_agree_xla_pallas"] is True
