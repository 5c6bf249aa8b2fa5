"""CPU kernels for XLA:CPU (`cpu_kernels.cc`), a plug-in behind `matmul` and `attention`.

A batched decode step on a CPU spent most of its time in two places where XLA's generic code is
weak: a few activation rows times every 16-bit weight (XLA:CPU's bf16 matmul runs at ~60-75% of
its large-matmul rate there), and attention over the cache in small chunks (each chunk copied out
of the cache, plus per-op overhead at every step of the loop). `matmul` and `cache_attention` do
those two jobs on AVX-512 (BF16) instructions, reading weights and cache where they lie.
`int8_matmul` multiplies by int8 weights in blocks of 32 (`model.quant`) without the dequantized
copy of the weight that XLA:CPU writes before a matmul of more than one row (any row count), in
integer dot products over activations split into two int8 parts per group of 4 (see the kernel).

`status()` decides once per process, outside any trace, whether they can run here: an x86-64 CPU
with AVX-512 BF16 and VNNI, a C++ compiler, `JAXGEN_CPU_KERNELS` not set to 0, and a build that succeeds.
The shared library is built once per source and jaxlib version into the user's cache directory
(`$XDG_CACHE_HOME/jaxgen`, default `~/.cache/jaxgen`) with the FFI headers jaxlib ships. The
`Platform` chooses them (and says why not, when not); they have no sharding rule, so a
multi-device engine keeps XLA's formulation.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

MATMUL = "jaxgen_bf16_matmul"
INT8_MATMUL = "jaxgen_int8_matmul"
ATTENTION = "jaxgen_cache_attention"
MAX_ROWS = 32  # rows a call takes: decode batches (matmul), query rows per kv head (attention);
# beyond, XLA's own matmul keeps up (docs/performance.md)
_SOURCE = pathlib.Path(__file__).with_name("cpu_kernels.cc")
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni"]


@dataclasses.dataclass(frozen=True)
class Status:
  """Whether the kernels run in this process, and why (or why not), in words."""

  available: bool
  reason: str
  fault: bool = False  # True: this machine could run them but something failed (worth showing)


def cache_dir() -> pathlib.Path:
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(root) / "jaxgen"


def _build(compiler: str, directory: pathlib.Path) -> pathlib.Path:
  source = _SOURCE.read_bytes()
  key = hashlib.sha256(source + jax.__version__.encode() + " ".join(_FLAGS).encode()).hexdigest()[:16]
  lib = directory / f"cpu_kernels-{key}.so"
  if lib.exists():
    return lib
  lib.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # build aside, then move: safe under races
    out = pathlib.Path(tmp) / lib.name
    cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    os.replace(out, lib)
  return lib


def probe(compiler: str | None = None, directory: pathlib.Path | None = None) -> Status:
  """Builds (or finds) the kernels, loads them and registers them with XLA. Not cached: see `status`."""
  if os.environ.get("JAXGEN_CPU_KERNELS", "1") == "0":
    return Status(False, "turned off by JAXGEN_CPU_KERNELS=0")
  machine = platform.machine().lower()
  if machine not in ("x86_64", "amd64"):
    return Status(False, f"they are written for x86-64 (AVX-512 BF16 and VNNI); this machine is {machine}")
  compiler = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
  if compiler is None:
    return Status(False, "no C++ compiler found to build them (install g++ or set CXX)", fault=True)
  try:
    lib = ctypes.CDLL(str(_build(compiler, directory or cache_dir())))
  except (OSError, subprocess.CalledProcessError) as e:
    detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines()
    return Status(False, f"building them with {compiler} failed: {detail[-1][-300:] if detail else e}", fault=True)
  if not lib.jaxgen_bf16_matmul_supported():
    return Status(False, "this CPU lacks AVX-512 BF16 or VNNI instructions")
  jax.ffi.register_ffi_target(MATMUL, jax.ffi.pycapsule(lib.JaxgenBf16Matmul), platform="cpu")
  jax.ffi.register_ffi_target(INT8_MATMUL, jax.ffi.pycapsule(lib.JaxgenInt8Matmul), platform="cpu")
  jax.ffi.register_ffi_target(ATTENTION, jax.ffi.pycapsule(lib.JaxgenCacheAttention), platform="cpu")
  return Status(True, f"built with {os.path.basename(compiler)}, AVX-512 BF16 and VNNI present")


_status: list[Status] = []  # probe()'s answer, once found
_status_lock = threading.Lock()


def status() -> Status:
  """`probe()`, once per process (a process's CPU and its registered targets never change); waits
  for a build `prepare()` started."""
  with _status_lock:
    if not _status:
      _status.append(probe())
    return _status[0]


def prepare() -> None:
  """Starts `status()` on a thread where it may have work to do: the first build runs a compiler
  for seconds, in a process of its own, while the caller reads weights. Only on the CPU backend."""
  if not _status and jax.default_backend() == "cpu":
    threading.Thread(target=status, name="jaxgen-cpu-kernels", daemon=True).start()


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [M, K] bf16 . w [N, K]^T bf16 -> float32 [M, N] (K a multiple of 32)."""
  m, n = x.shape[0], w.shape[0]
  return jax.ffi.ffi_call(MATMUL, jax.ShapeDtypeStruct((m, n), jnp.float32))(x, w)


def int8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
  """x [M, K] float32 . (w [N, K] int8 in blocks of 32 with scale [N, K / 32] float32)^T -> float32 [M, N]."""
  m, n = x.shape[0], w.shape[0]
  return jax.ffi.ffi_call(INT8_MATMUL, jax.ShapeDtypeStruct((m, n), jnp.float32))(x, w, scale)


def cache_attention(q, k, v, k_pos, q_pos, limit, run, window: int | None, softcap: float | None):
  """Folds keys [0, limit) of a float32 cache block into a running softmax state.

  q [B, K, R, H] float32 (scaled; R query rows per kv head, H a multiple of 16); k, v [B', K, S, H]
  float32 with B' >= B (the first B rows are read, where they lie); k_pos [B, S] int32 (-1: empty);
  q_pos [B, R] int32; limit: int32 scalar; run = (max [B, K, R, 1], sum of exp [B, K, R, 1],
  weighted values [B, K, R, H]) float32. Visibility and soft-capping as in `attention`. Returns the
  new run.
  """
  m, l, acc = run
  b, kh, r, h = q.shape
  state = jax.ShapeDtypeStruct((b, kh, r), jnp.float32)
  m, l, acc = jax.ffi.ffi_call(ATTENTION, (state, state, jax.ShapeDtypeStruct(acc.shape, jnp.float32)))(
      q, k, v, k_pos.astype(jnp.int32), q_pos.astype(jnp.int32), jnp.asarray(limit, jnp.int32),
      m[..., 0], l[..., 0], acc, window=np.int64(window or 0), softcap=np.float32(softcap or 0.0))
  return m[..., None], l[..., None], acc
