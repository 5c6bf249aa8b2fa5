"""jaxgen: a JAX/XLA compiled inference pipeline for large language models.

Jitted prefill and decode steps over a donated, preallocated KV cache, driven by a host loop
that tokenizes, schedules requests into cache slots, samples, detokenizes, streams and stops.

The names below load on first use, so that importing one host-side module (the scheduler, the
output types) does not start JAX.
"""

import importlib

_EXPORTS = {
    "LLM": "jaxgen.llm",
    "SamplingParams": "jaxgen.decode.params",
    "RequestOutput": "jaxgen.decode.outputs",
    "CompletionOutput": "jaxgen.decode.outputs",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'jaxgen' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value  # later lookups skip this function
  return value


def __dir__():
  return sorted(list(globals()) + __all__)
