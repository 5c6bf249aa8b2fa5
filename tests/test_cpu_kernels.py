"""The CPU kernels (model/kernels/cpu_kernels.cc) against float64 numpy, where `matmul` and `attention` use
them, and the fallback when they cannot be built.

Both operands are bf16, so every product is exact in float32; the kernel sums them in float32 in
its own order. Tolerance: 1e-6 of sum |x||w| per output (float32 rounding over K <= 2048 terms
stays below ~3e-7 of that sum).
"""

import json
import os
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxgen.model import quant
from jaxgen.model.kernels import cpu_kernels
from jaxgen.model import platform as platforms
from jaxgen.model.kernels.attention import KVBlock, attention, attention_xla_chunked
from jaxgen.model.kernels.matmul import matmul, project

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _fresh_rng():
  """Each test draws from its own seeded generator, whatever ran before it (or was deselected)."""
  global RNG
  RNG = np.random.default_rng(0)


def _cpu_has_bf16_dots() -> bool:
  try:
    with open("/proc/cpuinfo") as f:
      flags = f.read()
      return "avx512_bf16" in flags and "avx512_vnni" in flags
  except OSError:
    return False


CAN_RUN = (platform.machine().lower() in ("x86_64", "amd64") and _cpu_has_bf16_dots()
           and (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")) is not None and jax.default_backend() == "cpu"
           and os.environ.get("JAXGEN_CPU_KERNELS", "1") != "0")
needs_kernel = pytest.mark.skipif(not CAN_RUN, reason="needs AVX-512 BF16 and VNNI, a C++ compiler and XLA:CPU")


def _bf16(shape, scale=1.0):
  return jnp.asarray(RNG.normal(size=shape) * scale, jnp.bfloat16)


def test_kernel_is_available_wherever_it_can_run():
  # A machine that can run the kernel must get it: otherwise batched bf16 decode silently falls
  # back to XLA's slower matmul.
  assert cpu_kernels.status().available == CAN_RUN, cpu_kernels.status().reason


def kernel_platform(dtype="bfloat16"):
  return platforms.resolve(dtype)


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (2, 5, 64), (3, 7, 96), (4, 4, 640), (5, 9, 640),
                                   (16, 1536, 640), (17, 30, 1024), (32, 640, 2048)])
def test_kernel_matches_float64(m, n, k):
  x, w = _bf16((m, k)), _bf16((n, k), 0.05)
  got = np.asarray(jax.jit(cpu_kernels.matmul)(x, w))
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = x64 @ w64.T
  bound = 1e-6 * (np.abs(x64) @ np.abs(w64).T)
  assert got.dtype == np.float32 and got.shape == (m, n)
  assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


@needs_kernel
def test_kernel_splits_a_large_weight_over_threads_without_gaps():
  # Enough weight rows for several work chunks per thread, and a ragged last chunk.
  m, n, k = 8, 40_003, 64
  x, w = _bf16((m, k)), _bf16((n, k), 0.05)
  got = np.asarray(jax.jit(cpu_kernels.matmul)(x, w))
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows,uses", [(1, False), (4, True), (cpu_kernels.MAX_ROWS, True),
                                       (cpu_kernels.MAX_ROWS + 1, False)])
def test_matmul_takes_the_kernel_for_decode_sized_bf16_products(rows, uses):
  x = jnp.asarray(RNG.normal(size=(rows, 1, 64)), jnp.float32)
  w = _bf16((48, 64), 0.05)
  p = kernel_platform()
  assert p.matmul == "cpu"
  hlo = jax.jit(lambda x, w: matmul(x, w, p)).lower(x, w).as_text()
  assert (cpu_kernels.MATMUL in hlo) == uses
  got = np.asarray(matmul(x, w, p))
  # Multi-row products round the activations to bf16 first (the kernel and XLA alike).
  xr = np.asarray(x.astype(jnp.bfloat16) if rows > 1 else x, np.float64)
  want = xr @ np.asarray(w, np.float64).T
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_float32_weights_keep_xla():
  x = jnp.asarray(RNG.normal(size=(4, 64)), jnp.float32)
  w = jnp.asarray(RNG.normal(size=(48, 64)), jnp.float32)
  p = kernel_platform("float32")
  assert p.matmul == "xla"
  assert cpu_kernels.MATMUL not in jax.jit(lambda x, w: matmul(x, w, p)).lower(x, w).as_text()


@needs_kernel
@pytest.mark.slow  # a subprocess
def test_switch_turns_the_kernel_off():
  code = "from jaxgen.model.kernels import cpu_kernels; print(cpu_kernels.status())"
  env = dict(os.environ, JAXGEN_CPU_KERNELS="0")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  assert "available=False" in out.stdout and "JAXGEN_CPU_KERNELS=0" in out.stdout


def _numpy_cached_attention(q, kk, v, k_pos, q_pos, window, softcap):
  """q [B,T,N,H]; kk, v [B,K,S,H]; k_pos [B,S]; q_pos [B,T] -> [B,T,N,H] in float64."""
  b, t, n, h = q.shape
  g = n // kk.shape[1]
  out = np.zeros(q.shape, np.float64)
  for r in range(b):
    for i in range(t):
      vis = (k_pos[r] >= 0) & (k_pos[r] <= q_pos[r, i])
      if window:
        vis &= q_pos[r, i] - k_pos[r] < window
      for head in range(n):
        sc = kk[r, head // g].astype(np.float64) @ q[r, i, head].astype(np.float64)
        if softcap:
          sc = np.tanh(sc / softcap) * softcap
        sc = np.where(vis, sc, -np.inf)
        p = np.exp(sc - sc.max())
        out[r, i, head] = (p / p.sum()) @ np.nan_to_num(v[r, head // g]).astype(np.float64)
  return out


@needs_kernel
@pytest.mark.parametrize("limit,window,softcap", [(37, None, None), (37, 8, None), (64, None, 5.0), (1, None, None),
                                                  (100, 30, 50.0)])
def test_cache_attention_matches_numpy_and_xla(limit, window, softcap):
  """A decode step's cache block through the kernel and through XLA's chunked loop: both equal
  float64 numpy. Rows differ in length and one has a hole; the new token is a second block. The
  batch is the first 3 rows of a 4-row cache (as a decode step over the lowest rows). For the
  kernel, values past the limit are NaN, so reading them would show (XLA's loop reads whole
  chunks, so it gets them zeroed)."""
  b, t, s, n, k, h = 3, 1, 100, 8, 2, 32
  q = RNG.normal(size=(b, t, n, h)).astype(np.float32)
  kk = RNG.normal(size=(b + 1, k, s + t, h)).astype(np.float32)
  v = RNG.normal(size=(b + 1, k, s + t, h)).astype(np.float32)
  v[:, :, limit:s] = np.nan
  pos = np.where(np.arange(s) < limit, np.arange(s), -1)[None].repeat(b, 0).astype(np.int32)
  pos[1, limit // 2:] = -1  # a shorter row
  pos[2, limit // 3] = -1  # an empty entry inside a row
  q_pos = np.array([[limit], [limit // 2], [limit]], np.int32)
  blocks = [KVBlock(jnp.asarray(kk[:, :, :s]), jnp.asarray(v[:, :, :s]), jnp.asarray(pos), jnp.int32(limit)),
            KVBlock(jnp.asarray(kk[:b, :, s:]), jnp.asarray(v[:b, :, s:]), jnp.asarray(q_pos))]
  p = kernel_platform("float32")
  assert p.attention == "cpu"
  fn = jax.jit(lambda q, blocks: attention(q, blocks, jnp.asarray(q_pos), window, softcap, p))
  assert cpu_kernels.ATTENTION in fn.lower(jnp.asarray(q), blocks).as_text()
  got = np.asarray(fn(jnp.asarray(q), blocks))
  clean = [blocks[0]._replace(v=jnp.nan_to_num(blocks[0].v)), blocks[1]]
  xla = np.asarray(attention_xla_chunked(jnp.asarray(q), clean, jnp.asarray(q_pos), window, softcap))
  want = _numpy_cached_attention(q, kk[:b], v[:b], np.concatenate([pos, q_pos], 1), q_pos, window, softcap)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------- the fallback
def test_a_failed_build_is_a_reason_not_a_crash(tmp_path):
  """No compiler, or one that fails: the status says why, and the platform falls back to XLA:CPU's
  formulations (which the cache and generation tests run as well)."""
  broken = tmp_path / "cxx"
  broken.write_text("#!/bin/sh\necho 'fatal error: immintrin.h: No such file' >&2\nexit 1\n")
  broken.chmod(0o755)
  status = cpu_kernels.probe(compiler=str(broken), directory=tmp_path / "cache")
  if platform.machine().lower() in ("x86_64", "amd64") and os.environ.get("JAXGEN_CPU_KERNELS", "1") != "0":
    assert not status.available and status.fault
    assert "failed" in status.reason and "immintrin.h" in status.reason
  p = platforms.resolve("bfloat16", kernels=status)
  assert p.kernels == {"matmul": "xla_cpu", "attention": "xla_chunked"}
  assert status.reason in p.why("matmul") and status.reason in p.why("attention")
  with pytest.raises(ValueError, match="CPU kernels were asked for but cannot run"):
    platforms.resolve("bfloat16", attention="cpu", kernels=status)


@pytest.mark.slow  # a subprocess
def test_no_compiler_shows_in_jaxgen_info_and_generation_still_runs(tmp_path):
  """A fresh cache directory and no compiler: `jaxgen info --json` names the reason and the XLA
  implementations; a tiny model still generates."""
  env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), XDG_CACHE_HOME=str(tmp_path))
  out = subprocess.run([sys.executable, "-m", "jaxgen.cli", "info", "--json", "--dtype", "bfloat16"], env=env,
                       capture_output=True, text=True, check=True)
  report = json.loads(out.stdout)
  assert report["backend"] == "cpu" and report["devices"] and report["kernels"]["attention"] == "xla_chunked"
  if CAN_RUN:
    assert "failed" in report["cpu_kernels"]["reason"] and not report["cpu_kernels"]["available"]
  assert report["kernels"]["matmul"] == "xla_cpu" and "CPU kernels:" in report["reasons"]["matmul"]


# ---------------------------------------------------------------------------------- int8 matmul
def _int8_activations(x: np.ndarray) -> np.ndarray:
  """The int8 kernel's rounding of float32 activations [M, K], written independently in numpy:
  groups of 4 with step d = max |x| / 127, t = x * (127 / max |x|); hi = round(t),
  lo = 2 * clip(round(128 * (t - hi)), -63, 63) (half to even throughout); x ~ d * (hi + lo / 256)."""
  g = x.reshape(x.shape[0], -1, 4)
  amax = np.abs(g).max(-1, keepdims=True)
  with np.errstate(divide="ignore"):
    inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
  t = (g * inv).astype(np.float32)
  hi = np.rint(t)
  lo = 2 * np.clip(np.rint((t - hi) * np.float32(128)), -63, 63)
  assert np.all(np.abs(hi) <= 127) and np.all(np.abs(lo) <= 126)
  d = (amax * (np.float32(1) / np.float32(127))).astype(np.float32)
  return ((hi.astype(np.float64) + lo / 256.0) * d).reshape(x.shape)


def _rounding_bound(x: np.ndarray, w64: np.ndarray) -> np.ndarray:
  """What the int8 kernel's rounding of the activations may move x . w^T: each activation by at
  most 1/128 of its group's step (max |x| / 127), times |w|."""
  amax = np.abs(x.reshape(x.shape[0], -1, 4)).max(-1, keepdims=True)
  step = np.broadcast_to(amax / (127.0 * 128.0), (x.shape[0], x.shape[1] // 4, 4)).reshape(x.shape)
  return step.astype(np.float64) @ np.abs(w64).T


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (2, 5, 64), (4, 4, 640), (5, 9, 96), (17, 30, 1024), (32, 7, 2048)])
def test_int8_kernel_matches_its_rounding_of_the_activations(m, n, k):
  """Against float64 on the same int8 activations (tight: only the order of float32 sums differs),
  and against the exact product within the activations' rounding bound. K = 32 and 96 end in half
  of the kernel's 64-wide step; row 0 has an outlier 1000x the rest."""
  assert cpu_kernels.status().available  # builds and registers the kernels in this process
  x = RNG.normal(size=(m, k)).astype(np.float32)
  x[0, 1] *= 1000.0
  values, scale = quant.quantize_np(RNG.normal(size=(n, k)).astype(np.float32) * 0.05)
  got = np.asarray(jax.jit(cpu_kernels.int8_matmul)(x, values, scale))
  w64 = (values.reshape(n, -1, 32).astype(np.float64) * scale[..., None]).reshape(n, k)
  rounded = _int8_activations(x)
  want = rounded @ w64.T
  bound = 1e-6 * (np.abs(rounded) @ np.abs(w64).T) + 1e-30
  assert got.dtype == np.float32 and got.shape == (m, n)
  assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))
  exact = x.astype(np.float64) @ w64.T
  assert np.all(np.abs(got - exact) <= 1.001 * _rounding_bound(x, w64) + bound)


@needs_kernel
def test_int8_kernel_takes_zero_rows_and_exact_cases():
  """A zero activation row gives zeros (no 0/0); activations that are multiples of their group's
  step (integers, max |x| = 127 in each group: lo = 0) and weights that are small integers with
  power-of-two scales come out exact."""
  assert cpu_kernels.status().available
  k = 128
  x = RNG.integers(-127, 128, size=(3, k)).astype(np.float32)
  x.reshape(3, -1, 4)[..., 0] = 127.0
  x[1] = 0.0
  values = RNG.integers(-127, 128, size=(6, k)).astype(np.int8)
  scale = np.full((6, k // 32), 0.25, np.float32)
  got = np.asarray(jax.jit(cpu_kernels.int8_matmul)(x, values, scale))
  want = x.astype(np.float64) @ (values.astype(np.float64) * 0.25).T
  assert np.all(np.isfinite(got)) and np.all(got[1] == 0.0)
  np.testing.assert_array_equal(got, want.astype(np.float32))


@needs_kernel
@pytest.mark.parametrize("rows,inputs,uses", [(1, 64, True), (8, 64, True), (33, 64, True), (256, 64, True),
                                              (8, 40, False)])  # 40 inputs: one scale per row, not blocks
def test_int8_products_take_the_kernel_where_the_blocks_are_32(rows, inputs, uses):
  p = platforms.resolve("float32", quantization="int8")
  assert p.matmul == "cpu"
  x = jnp.asarray(RNG.normal(size=(rows, 1, inputs)), jnp.float32)
  values, scale = quant.quantize(jnp.asarray(RNG.normal(size=(48, inputs)), jnp.float32))
  hlo = jax.jit(lambda x, w, s: project(x, w, s, p)).lower(x, values, scale).as_text()
  assert (cpu_kernels.INT8_MATMUL in hlo) == uses
  got = np.asarray(project(x, values, scale, p)).reshape(rows, -1)
  want = np.asarray(project(x, values, scale, platforms.REFERENCE)).reshape(rows, -1)  # dequantize, XLA
  if uses:  # the kernel rounds the activations to two int8 parts in groups of 4 (see the tests above)
    w64 = np.asarray(quant.dequantize(values, scale, jnp.float32), np.float64)
    x2 = np.asarray(x, np.float32).reshape(rows, -1)
    assert np.all(np.abs(got - want) <= 1.001 * _rounding_bound(x2, w64) + 1e-5)
  else:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
