"""`jaxgen info`: what this machine runs and how, without loading a model.

Versions, backend and devices, the `Platform` an engine would get (the implementation serving
each kernel op and why, activation and cache dtypes, the largest prefill chunk), how many
programs its warm-up compiles, and the persistent compilation cache directory.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform as host

import flax
import jax
import jaxlib
from jaxgen.decode.config import program_count
from jaxgen.llm import DEFAULT_COMPILATION_CACHE
from jaxgen.model import platform as platforms
from jaxgen.model.kernels.matmul import INT8_REASONS


def gather(dtype: str = "float32", max_batch: int = 8) -> dict:
  p = platforms.resolve(dtype)
  q = platforms.resolve(dtype, quantization="int8")  # what `quantization="int8"` would get
  cache = jax.config.jax_compilation_cache_dir or DEFAULT_COMPILATION_CACHE
  return dict(
      jaxgen=importlib.metadata.version("jaxgen"), jax=jax.__version__, jaxlib=jaxlib.__version__,
      flax=flax.__version__, python=host.python_version(), machine=host.machine(),
      backend=p.backend, devices=[str(d) for d in jax.devices()], device_kind=p.device_kind,
      dtype=dtype, kernels=p.kernels, reasons=dict(p.reasons),
      int8_matmul=dict(impl=q.matmul, reason=INT8_REASONS[q.matmul]),
      cpu_kernels=None if p.cpu_kernels is None else dict(available=p.cpu_kernels.available,
                                                          reason=p.cpu_kernels.reason),
      activation_dtype=p.activation_dtype or dtype, cache_dtype=p.cache_dtype, prefill_chunk=p.prefill_chunk,
      programs=dict(max_batch=max_batch, count=program_count(max_batch, p.prefill_chunk, prefix_caching=True)),
      compilation_cache_dir=cache)


def run(a) -> int:
  report = gather(a.dtype, a.max_batch)
  if a.json:
    print(json.dumps(report, indent=1))
    return 0
  print(f"jaxgen {report['jaxgen']}  jax {report['jax']}  jaxlib {report['jaxlib']}  flax {report['flax']}  "
        f"python {report['python']} ({report['machine']})")
  print(f"backend: {report['backend']}, {len(report['devices'])} device(s): {report['device_kind']}")
  print(f"weights {report['dtype']}: activations {report['activation_dtype']}, KV cache {report['cache_dtype']}, "
        f"prefill chunks up to {report['prefill_chunk']} tokens")
  for op, impl in report["kernels"].items():
    print(f"  {op:<10} {impl:<12} {report['reasons'].get(op, '')}")
  print(f"  {'int8 matmul':<10} {report['int8_matmul']['impl']:<12} {report['int8_matmul']['reason']}")
  if report["cpu_kernels"] is not None:
    state = "available" if report["cpu_kernels"]["available"] else "not used"
    print(f"  CPU kernels {state}: {report['cpu_kernels']['reason']}")
  progs = report["programs"]
  print(f"warm-up compiles {progs['count']} programs at max_batch={progs['max_batch']} "
        "(prefill per prompt bucket, decode per row bucket, fork, move, logits, prefix save and restore)")
  print(f"compilation cache: {report['compilation_cache_dir']}")
  return 0
