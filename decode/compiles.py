"""Counts XLA compilations and their time, process-wide, from JAX's own monitoring events.

Used to keep compile time out of request metrics, to assert "nothing compiles after warm-up", and
to say where a start went before its first token (`phases`). After each compilation (or load from
the persistent cache) the C heap's free pages go back to the OS: loading a program parses several
copies of its serialized form and frees them, and glibc would keep them resident.
"""

from __future__ import annotations

import collections
import threading
import weakref

import jax
from jaxgen.model.platform import return_freed_heap

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
    self.lookups = weakref.WeakKeyDictionary()  # thread -> its latest persistent-cache lookup
    self._lock = threading.Lock()

  def __call__(self, event: str, duration: float, **_):
    if event in _PHASES:
      with self._lock:
        self.seconds += duration
        self.by_phase[_PHASES[event]] += duration
        if event == _COMPILE_EVENT:
          self.count += 1
      if event == _COMPILE_EVENT:
        return_freed_heap()

  def event(self, event: str, **_):
    if event in _CACHE_EVENTS:
      with self._lock:
        self.by_phase[_CACHE_EVENTS[event]] += 1
        self.lookups[threading.current_thread()] = _CACHE_EVENTS[event]


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


def cache_lookup(thread: threading.Thread) -> str | None:
  """How `thread`'s latest persistent-cache lookup went: "cache_hits", "cache_misses", or
  None if it made none (JAX looks a program up after lowering it, before compiling)."""
  with COUNTER._lock:
    return COUNTER.lookups.get(thread)


def persistent_cache_on() -> bool:
  """Whether compiled programs are looked up in (and written to) a persistent cache directory."""
  return bool(jax.config.jax_compilation_cache_dir)
