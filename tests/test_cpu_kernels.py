"""The CPU bf16 matmul kernel (model/cpu_kernels.cc) against float64 numpy, and where `linear` uses it.

Both operands are bf16, so every product is exact in float32; the kernel sums them in float32 in
its own order. Tolerance: 1e-6 of sum |x||w| per output (float32 rounding over K <= 2048 terms
stays below ~3e-7 of that sum).
"""

import os
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.model import cpu_kernels
from jaxgen.model import layers as L

RNG = np.random.default_rng(0)


def _cpu_has_bf16_dots() -> bool:
  try:
    with open("/proc/cpuinfo") as f:
      return "avx512_bf16" in f.read()
  except OSError:
    return False


CAN_RUN = (platform.machine().lower() in ("x86_64", "amd64") and _cpu_has_bf16_dots()
           and (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")) is not None and jax.default_backend() == "cpu"
           and os.environ.get("JAXGEN_CPU_KERNELS", "1") != "0")
needs_kernel = pytest.mark.skipif(not CAN_RUN, reason="needs x86-64 with AVX-512 BF16, a C++ compiler and XLA:CPU")


def _bf16(shape, scale=1.0):
  return jnp.asarray(RNG.normal(size=shape) * scale, jnp.bfloat16)


def test_kernel_is_available_wherever_it_can_run():
  # A machine that can run the kernel must get it: otherwise batched bf16 decode silently falls
  # back to XLA's slower matmul.
  assert cpu_kernels.available() == CAN_RUN


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
def test_linear_takes_the_kernel_for_decode_sized_bf16_products(rows, uses):
  x = jnp.asarray(RNG.normal(size=(rows, 1, 64)), jnp.float32)
  w = _bf16((48, 64), 0.05)
  hlo = jax.jit(L.linear).lower(x, w).as_text()
  assert (cpu_kernels.MATMUL in hlo) == uses
  got = np.asarray(L.linear(x, w))
  # Multi-row products round the activations to bf16 first (the kernel and XLA alike).
  xr = np.asarray(x.astype(jnp.bfloat16) if rows > 1 else x, np.float64)
  want = xr @ np.asarray(w, np.float64).T
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_linear_keeps_xla_for_float32_weights():
  x = jnp.asarray(RNG.normal(size=(4, 64)), jnp.float32)
  w = jnp.asarray(RNG.normal(size=(48, 64)), jnp.float32)
  assert cpu_kernels.MATMUL not in jax.jit(L.linear).lower(x, w).as_text()


@needs_kernel
def test_switch_turns_the_kernel_off():
  code = "from jaxgen.model import cpu_kernels; print(cpu_kernels.available())"
  env = dict(os.environ, JAXGEN_CPU_KERNELS="0")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"


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
  """A decode step's cache block through the kernel (`CausalMask`) and through XLA's chunked loop
  (a plain mask function): both equal float64 numpy. Rows differ in length and one has a hole;
  the new token is a second block. For the kernel, values past the limit are NaN, so reading them
  would show (XLA's loop reads whole chunks, so it gets them zeroed)."""
  b, t, s, n, k, h = 3, 1, 100, 8, 2, 32
  q = RNG.normal(size=(b, t, n, h)).astype(np.float32)
  kk = RNG.normal(size=(b, k, s + t, h)).astype(np.float32)
  v = RNG.normal(size=(b, k, s + t, h)).astype(np.float32)
  v[:, :, limit:s] = np.nan
  pos = np.where(np.arange(s) < limit, np.arange(s), -1)[None].repeat(b, 0).astype(np.int32)
  pos[1, limit // 2:] = -1  # a shorter row
  pos[2, limit // 3] = -1  # an empty entry inside a row
  q_pos = np.array([[limit], [limit // 2], [limit]], np.int32)
  blocks = [(jnp.asarray(kk[:, :, :s]), jnp.asarray(v[:, :, :s]), jnp.asarray(pos), jnp.int32(limit)),
            (jnp.asarray(kk[:, :, s:]), jnp.asarray(v[:, :, s:]), jnp.asarray(q_pos))]
  mask = L.CausalMask(jnp.asarray(q_pos), window)
  fn = jax.jit(lambda q, blocks: L.attend(q, blocks, mask, softcap))
  assert cpu_kernels.ATTENTION in fn.lower(jnp.asarray(q), blocks).as_text()
  got = np.asarray(fn(jnp.asarray(q), blocks))
  clean = [(blocks[0][0], jnp.nan_to_num(blocks[0][1]), *blocks[0][2:]), blocks[1]]
  xla = np.asarray(L.attend(jnp.asarray(q), clean, lambda kp: mask(kp), softcap))
  want = _numpy_cached_attention(q, kk, v, np.concatenate([pos, q_pos], 1), q_pos, window, softcap)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-5)
