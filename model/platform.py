"""The `Platform`: where the programs run and how, decided once when an engine is built.

It names the backend and device, the activation and cache dtypes, the largest prefill chunk, and
which implementation serves each kernel op (`matmul.IMPLS`, `attention.IMPLS`), each with the
reason it was chosen. `resolve()` reads the devices and probes the CPU kernels (which may build
them, once per process); it must run outside any trace. The model's functions take the resolved
`Platform` as a static argument and never look at the devices themselves.

On TPU and GPU everything runs the plain XLA formulation in the weights' dtype. On XLA:CPU the
activations are float32 whatever the weights' dtype (its 16-bit elementwise code is slow), the
cache is float32, and the ops go to jaxgen's CPU kernels where they can run, else to XLA:CPU's
own fastest formulations.
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys

import jax
import jax.numpy as jnp
from jaxgen.model.kernels import cpu_kernels

DTYPES = ("float32", "bfloat16", "float16")
CACHE_DTYPES = DTYPES + ("int8",)  # int8: with float32 scales per block of 16 (`model.kv`)
CHOICES = ("auto", "xla", "cpu")  # what a user may ask for, per op
ATTENTION_CHOICES = CHOICES + ("pallas",)  # attention also has a Pallas kernel (TPU, GPU; interpreted on CPU)


@dataclasses.dataclass(frozen=True)
class KernelMesh:
  """How a kernel's operands split over a mesh, for kernels wrapped in `shard_map`: the mesh (its
  axes and sizes, no devices) and the mesh axes that split the cache's rows (slots) and its kv
  heads (None: not split). Set by the engine's config from the sharding rules; the model does
  not decide a layout."""

  mesh: jax.sharding.AbstractMesh
  rows: str | None
  heads: str | None


@dataclasses.dataclass(frozen=True)
class Platform:
  """Hashable, so that the compiled programs can take it as a static argument."""

  backend: str = "cpu"  # jax.default_backend()
  device_kind: str = ""
  devices: int = 1  # devices one program spans
  activation_dtype: str | None = None  # None: the weights' dtype
  cache_dtype: str = "float32"
  prefill_chunk: int = 512  # the largest prompt chunk one prefill program takes
  matmul: str = "xla"  # a key of matmul.IMPLS
  attention: str = "xla"  # a key of attention.IMPLS
  reasons: tuple[tuple[str, str], ...] = ()  # (op, why this implementation)
  cpu_kernels: cpu_kernels.Status | None = None  # on CPU: whether jaxgen's kernels run here, and why
  emulated: bool = False  # the backend's choices, run on this CPU (Pallas interpreted): `LLM(emulate=...)`
  kernel_mesh: KernelMesh | None = None  # over several devices: how the Pallas kernel's operands split

  @property
  def kernels(self) -> dict[str, str]:
    return {"matmul": self.matmul, "attention": self.attention}

  @property
  def cache_align(self) -> int:
    """Entries a cache layer's length is a multiple of: the sublane tile of the cache dtype on
    TPU and GPU (8 rows of 32 bits, packed: 16 of bf16, 32 of int8), none on CPU."""
    if self.backend in ("cpu", "any"):
      return 1
    return 32 // jnp.dtype(self.cache_dtype).itemsize

  def why(self, op: str) -> str:
    return dict(self.reasons).get(op, "")

  def compute_dtype(self, weight_dtype) -> jnp.dtype:
    return jnp.dtype(self.activation_dtype or weight_dtype)

  def describe(self) -> dict:
    """A JSON-ready summary (`jaxgen info`, `llm.platform`)."""
    return dict(backend=self.backend, device_kind=self.device_kind, devices=self.devices,
                activation_dtype=self.activation_dtype, cache_dtype=self.cache_dtype,
                prefill_chunk=self.prefill_chunk, kernels=self.kernels, reasons=dict(self.reasons),
                emulated=self.emulated,
                cpu_kernels=None if self.cpu_kernels is None else dataclasses.asdict(self.cpu_kernels))


# The plain formulation everywhere, in the weights' dtype: the reference, and what TPU and GPU run.
REFERENCE = Platform(backend="any", matmul="xla", attention="xla",
                     reasons=(("matmul", "reference"), ("attention", "reference")))


def resolve(weight_dtype: str, *, cache_dtype: str | None = None, devices: int = 1, matmul: str = "auto",
            attention: str = "auto", prefill_chunk: int | None = None,
            kernels: cpu_kernels.Status | None = None, quantization: str | None = None,
            backend: str | None = None, device_kind: str | None = None, emulate: str | None = None) -> Platform:
  """The platform for an engine over `devices` devices of the default backend, weights in `weight_dtype`.

  matmul / attention: "auto" (the fastest that runs here), "xla" (the plain formulation: what TPU
  and GPU run; on CPU the float32 activations stay), or "cpu" (jaxgen's CPU kernels; a ValueError
  where they cannot run); attention also "pallas" (`pallas_kernels`; interpret mode on CPU).
  "auto" takes the Pallas kernel on TPU with a float cache (on a mesh, per shard: the engine's
  config sets `kernel_mesh`), the plain formulation on GPU and for an int8 cache (each with its
  reason). kernels: the CPU kernels' status
  (default: `cpu_kernels.status()`).
  quantization: the weights' (`ModelConfig.weight_quant`): int8 weights take the CPU kernels'
  int8 matmul where they run, whatever `weight_dtype` (the dtype of norms and activations).
  backend, device_kind: another machine's (`jaxgen plan` compiles for a TPU it does not have);
  default: this process's devices. emulate: "tpu" or "gpu": what that backend would choose (the
  weights' dtype for activations and cache, plain XLA ops, an aligned cache), run here on the
  CPU, Pallas in interpret mode: the accelerators' numerics checked without one.
  """
  if emulate is not None:
    if emulate not in ("tpu", "gpu"):
      raise ValueError(f"emulate={emulate!r} is not supported; choose 'tpu' or 'gpu'")
    kind = {"tpu": "TPU v5 lite", "gpu": "NVIDIA H100 80GB HBM3"}[emulate]
    platform = resolve(weight_dtype, cache_dtype=cache_dtype, devices=devices, matmul=matmul, attention=attention,
                       prefill_chunk=prefill_chunk, quantization=quantization, backend=emulate,
                       device_kind=f"{kind} (emulated on {jax.default_backend()})")
    return dataclasses.replace(platform, emulated=True)
  for name, value, choices in (("matmul", matmul, CHOICES), ("attention", attention, ATTENTION_CHOICES)):
    if value not in choices:
      raise ValueError(f"{name}_impl={value!r} is not supported; choose one of {list(choices)}")
  if weight_dtype not in DTYPES:
    raise ValueError(f"dtype={weight_dtype!r} is not supported; use one of {list(DTYPES)}")
  if cache_dtype is not None and cache_dtype not in CACHE_DTYPES:
    raise ValueError(f"cache_dtype={cache_dtype!r} is not supported; use one of {list(CACHE_DTYPES)}")
  backend = backend or jax.default_backend()
  kind = device_kind if device_kind is not None else jax.devices(backend)[0].device_kind
  if backend != "cpu":
    for name, value in (("matmul", matmul), ("attention", attention)):
      if value == "cpu":
        raise ValueError(f"{name}_impl='cpu' needs the CPU backend; this process runs on {backend}")
    cache_dtype = cache_dtype or weight_dtype
    if attention == "pallas" and backend != "tpu" and cache_dtype == "int8":
      raise ValueError("attention_impl='pallas' on GPU reads a float cache; with cache_dtype='int8' use "
                       "attention_impl='xla' or 'auto'")
    if attention == "pallas":
      att, att_why = "pallas", "asked for (attention_impl='pallas'): Pallas kernel, each row read to its length"
    elif attention == "auto" and backend == "tpu" and cache_dtype != "int8":
      att, att_why = "pallas", "Pallas kernel streams each row's cache blocks up to its length (XLA reads it whole)"
      if devices > 1:
        att_why += "; on the mesh, per shard of slots and kv heads (shard_map)"
    else:
      why = {"xla": "asked for (attention_impl='xla')",
             "gpu": "the Pallas kernel is written for TPU (scalar-prefetch grid); GPU keeps XLA's fused attention",
             "int8": "an int8 cache's scales [.., S, H/16]: a lane dim Mosaic pads to 128 (a relayout copy per step)"}
      reason = "xla" if attention == "xla" else "gpu" if backend != "tpu" else "int8"
      att, att_why = "xla", f"plain XLA formulation over the whole cache: {why[reason]}"
    return Platform(backend, kind, devices, None, cache_dtype, prefill_chunk or 1024, "xla", att,
                    (("matmul", f"plain XLA formulation: {weight_dtype} is native on {backend}"),
                     ("attention", att_why)))
  cache_dtype = cache_dtype or "float32"
  if devices > 1:
    usable = cpu_kernels.Status(False, f"custom calls have no sharding rule; this engine spans {devices} devices")
  else:
    usable = kernels or cpu_kernels.status()
  if (matmul == "cpu" or attention == "cpu") and not usable.available:
    raise ValueError(f"the CPU kernels were asked for but cannot run: {usable.reason}")
  sixteen = jnp.dtype(weight_dtype).itemsize == 2
  if quantization == "int8" and matmul != "xla" and usable.available:
    mm, mm_why = "cpu", "CPU kernel reads the int8 blocks as stored (float32 activations, FMAs)"
  elif not sixteen:
    mm, mm_why = "xla", f"{weight_dtype} weights: XLA's own matmul"
  elif matmul == "xla":
    mm, mm_why = "xla", "asked for (matmul_impl='xla'): weights widened to float32 before each matmul"
  elif usable.available and weight_dtype == "bfloat16":
    mm, mm_why = "cpu", "CPU kernel for 2-32 rows of bf16 weights (XLA's fused upcast matvec for 1 row, its matmul above)"
  else:
    mm = "xla_cpu"
    mm_why = (f"XLA:CPU's fastest formulation per shape for {weight_dtype} weights"
              + ("" if usable.available else f" (CPU kernels: {usable.reason})"))
  if attention == "xla":
    att, att_why = "xla", "asked for (attention_impl='xla'): the plain formulation over the whole cache"
  elif attention == "pallas":
    att, att_why = "pallas", "asked for (attention_impl='pallas'): the Pallas kernel in interpret mode (slow; tests)"
  elif usable.available and cache_dtype == "float32":
    att, att_why = "cpu", "CPU kernel reads a float32 cache in place up to its filled length"
  else:
    att = "xla_chunked"
    att_why = ("XLA:CPU reads the cache in chunks up to its filled length"
               + ("" if usable.available else f" (CPU kernels: {usable.reason})"))
  return Platform(backend, kind, devices, "float32", cache_dtype, prefill_chunk or 256, mm, att,
                  (("matmul", mm_why), ("attention", att_why)), usable)


def return_freed_heap() -> None:
  """Hands the C heap's free pages back to the OS (glibc keeps them otherwise). A start frees a lot
  that the peak would count on top of the weights: building a 262k-token tokenizer from its JSON
  or converting a GGUF ~200 MB, loading a compiled program its serialized copies (~60 MB for the
  270M model's prefill or decode)."""
  if sys.platform.startswith("linux"):
    try:
      ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
      pass
