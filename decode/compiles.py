"""Counts XLA compilations and their time, process-wide, from JAX's own monitoring events.

Used to keep compile time out of request metrics and to assert "nothing compiles after warm-up".
"""

from __future__ import annotations

import threading

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_TIME_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    _COMPILE_EVENT,
)


class _Counter:
  def __init__(self):
    self.count = 0
    self.seconds = 0.0
    self._lock = threading.Lock()

  def __call__(self, event: str, duration: float, **_):
    if event in _TIME_EVENTS:
      with self._lock:
        self.seconds += duration
        if event == _COMPILE_EVENT:
          self.count += 1


COUNTER = _Counter()
jax.monitoring.register_event_duration_secs_listener(COUNTER)


def count() -> int:
  """Backend compilations so far in this process."""
  return COUNTER.count


def seconds() -> float:
  """Seconds spent tracing, lowering and compiling so far in this process."""
  return COUNTER.seconds
