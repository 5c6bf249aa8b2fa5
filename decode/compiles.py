"""Counts XLA compilations and their time, process-wide, from JAX's own monitoring events.

Used to keep compile time out of request metrics, to assert "nothing compiles after warm-up", and
to say where a start went before its first token (`phases`).
"""

from __future__ import annotations

import collections
import threading

import jax

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # a compilation, or its load from the cache
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits",
                 "/jax/compilation_cache/cache_misses": "cache_misses"}
_PHASES = {_TRACE_EVENT: "trace_s", _LOWER_EVENT: "lower_s", _COMPILE_EVENT: "compile_s"}


class _Counter:
  def __init__(self):
    self.count = 0
    self.seconds = 0.0
    self.by_phase: collections.Counter = collections.Counter()
    self._lock = threading.Lock()

  def __call__(self, event: str, duration: float, **_):
    if event in _PHASES:
      with self._lock:
        self.seconds += duration
        self.by_phase[_PHASES[event]] += duration
        if event == _COMPILE_EVENT:
          self.count += 1

  def event(self, event: str, **_):
    if event in _CACHE_EVENTS:
      with self._lock:
        self.by_phase[_CACHE_EVENTS[event]] += 1


COUNTER = _Counter()
jax.monitoring.register_event_duration_secs_listener(COUNTER)
jax.monitoring.register_event_listener(COUNTER.event)


def count() -> int:
  """Backend compilations so far in this process (a program found in the persistent cache counts)."""
  return COUNTER.count


def seconds() -> float:
  """Seconds spent tracing, lowering and compiling so far in this process."""
  return COUNTER.seconds


def phases() -> dict:
  """Seconds so far in this process spent tracing (Python to jaxpr), lowering (to StableHLO) and
  compiling, where compile_s includes loading what the persistent cache held; cache_hits and
  cache_misses count programs looked up there."""
  with COUNTER._lock:
    return {k: COUNTER.by_phase.get(k, 0) for k in ("trace_s", "lower_s", "compile_s", "cache_hits", "cache_misses")}
