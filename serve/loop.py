"""The engine loop: one thread owns the engine; HTTP handlers reach it through a bounded inbox.

A handler checks and tokenizes its request on its own thread (`Engine.check_request`), reserves
room (`submit` refuses at once when `max_batch + max_queue` requests are already in), and gets
every update of its requests back through a callback. Between engine steps the loop adds what was
submitted and aborts what was cancelled, so the engine is only ever touched from this thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from typing import Callable, Sequence

from jaxgen.decode import compiles
from jaxgen.decode.engine import Engine
from jaxgen.decode.outputs import RequestOutput
from jaxgen.decode.params import SamplingParams

log = logging.getLogger("jaxgen.serve")

# sink(prompt index, its latest RequestOutput or None, error or None); runs on the loop thread
Sink = Callable[[int, RequestOutput | None, BaseException | None], None]


class QueueFull(Exception):
  """No room: max_batch + max_queue requests are already running or waiting."""


class Closed(Exception):
  """The loop is stopping (SIGTERM): it admits nothing new."""


class EngineLoop:
  """Runs `engine` on a thread of its own: `start()`, `submit()`, `abort()`, `stop()`.

  max_queue: requests allowed to wait for a slot; beyond max_batch + max_queue, `submit` raises
  QueueFull. warmup: compile every program before `ready` is set (nothing compiles later).
  on_finish(output): called on the loop thread once per finished request (metrics).
  When the loop itself fails (not one step: those fail their requests only), `error` holds why,
  every request submitted gets that error, `submit` raises Closed, and `stopped` is set.
  """

  def __init__(self, engine: Engine, *, max_queue: int, warmup: bool = True,
               on_finish: Callable[[RequestOutput], None] | None = None):
    if max_queue < 0:
      raise ValueError(f"max_queue={max_queue} must be >= 0")
    self.engine, self.warmup, self.on_finish = engine, warmup, on_finish
    self.capacity = engine.config.max_batch + max_queue
    self.ready = threading.Event()
    self.snapshot: dict = engine.metrics()  # the engine's metrics after the latest step
    self.compiles_at_ready: int | None = None
    self.error: BaseException | None = None  # why the loop thread died, if it did
    self.stopped = threading.Event()  # the loop thread ended (stopped, or died of `error`)
    self._lock = threading.Lock()
    self._accepted = 0  # submitted and not yet finished
    self._queued = 0  # submitted and not yet handed to the engine (in the inbox)
    self._closed = False
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._sinks: dict[str, tuple[Sink, int]] = {}
    self._thread = threading.Thread(target=self._run, name="jaxgen-engine-loop", daemon=True)

  # ------------------------------------------------------------------------- from other threads
  def start(self) -> None:
    self._thread.start()

  @property
  def unfinished(self) -> int:
    """Requests submitted and not yet finished (running, prefilling or waiting)."""
    return self._accepted

  @property
  def waiting(self) -> int:
    """Requests not yet given a slot: in the inbox or the engine's queue."""
    return self._queued + self.snapshot.get("waiting", 0)

  def submit(self, prompts: Sequence[list[int]], params: SamplingParams, sink: Sink) -> list[str]:
    """Queues one request per prompt (checked token ids); their ids. QueueFull or Closed: nothing queued."""
    with self._lock:
      if self.error is not None:
        raise Closed(f"the engine loop stopped ({type(self.error).__name__}: {self.error}); this server serves "
                     "nothing more and must be restarted")
      if self._closed:
        raise Closed("the server is shutting down and admits no new requests")
      if self._accepted + len(prompts) > self.capacity:
        raise QueueFull(f"{self._accepted} requests are running or waiting; the limit is {self.capacity} "
                        "(max_batch + max_queue): retry later")
      self._accepted += len(prompts)
      self._queued += len(prompts)
      rids = [uuid.uuid4().hex for _ in prompts]
      self._inbox.put(("add", rids, list(prompts), params, sink))  # under the lock: never behind a "stop"
    return rids

  def abort(self, rids: Sequence[str]) -> None:
    """Aborts requests (finish_reason "abort", slot freed); finished or unknown ids are ignored."""
    self._inbox.put(("abort", list(rids)))

  def close(self) -> None:
    """Admits nothing new; what was submitted runs to the end."""
    with self._lock:
      self._closed = True

  @property
  def closed(self) -> bool:
    return self._closed

  def stop(self, timeout: float | None = None) -> None:
    """Aborts what is left, then ends the thread."""
    self.close()
    self._inbox.put(("stop",))
    if self._thread.is_alive():
      self._thread.join(timeout)

  # ---------------------------------------------------------------------------- the loop thread
  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def _run(self) -> None:
    try:
      self._serve()
    except BaseException as e:  # the loop itself failed: no request may wait for it forever
      log.exception("the engine loop stopped")
      with self._lock:  # after this no submit can reach the inbox, so draining it fails every request
        self.error, self._closed = e, True
      self._fail_all(e)
      self._fail_inbox(e)
    finally:
      self.stopped.set()

  def _serve(self) -> None:
    if self.warmup:
      try:
        self.engine.warmup()
      except Exception:  # serving still works, compiling on first use
        log.exception("warm-up failed")
    self.compiles_at_ready = compiles.count()
    self.ready.set()
    while True:
      if not self._take(block=not self.engine.has_unfinished()):
        break
      if self.engine.has_unfinished():
        try:
          outs = self.engine.step()
        except Exception as e:  # a failed step fails the requests in it, not the server
          log.exception("engine step failed")
          self._fail_all(e)
          continue
        for out in outs:
          self._deliver(out)
      self.snapshot = self.engine.metrics()
    for rid in list(self._sinks):  # stopping: abort what is left and report it
      self.engine.abort(rid)
    while self.engine.has_unfinished():
      for out in self.engine.step():
        self._deliver(out)

  def _take(self, block: bool) -> bool:
    """Applies the inbox's commands (waiting for one when `block`); False on stop."""
    while True:
      try:
        cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
      except queue.Empty:
        if block:
          continue
        return True
      block = False
      if cmd[0] == "stop":
        return False
      if cmd[0] == "abort":
        for rid in cmd[1]:
          self.engine.abort(rid)
        continue
      _, rids, prompts, params, sink = cmd
      with self._lock:
        self._queued -= len(rids)
      for i, rid in enumerate(rids):  # all registered first: should adding fail the loop, each is told
        self._sinks[rid] = (sink, i)
      for i, (rid, ids) in enumerate(zip(rids, prompts)):
        try:
          self.engine.add_request(ids, params, request_id=rid)
        except ValueError as e:  # checked by the handler already; still never the loop's problem
          self._sinks.pop(rid)
          self._release(1)
          sink(i, None, e)

  def _deliver(self, out: RequestOutput) -> None:
    entry = self._sinks.get(out.request_id)
    if entry is None:
      return
    sink, i = entry
    if out.finished:
      del self._sinks[out.request_id]
      self._release(1)
      if self.on_finish is not None:
        self.on_finish(out)
    sink(i, out, None)  # a snapshot already: the engine never changes an output it handed out

  def _fail_all(self, error: BaseException) -> None:
    for rid, (sink, i) in list(self._sinks.items()):
      del self._sinks[rid]
      self._release(1)
      try:
        self.engine.abort(rid)
        sink(i, None, error)
      except Exception:  # the event loop may be gone already
        log.exception("could not report a failed request")

  def _fail_inbox(self, error: BaseException) -> None:
    """Fails the requests submitted but never taken (the loop died before it took them)."""
    while True:
      try:
        cmd = self._inbox.get_nowait()
      except queue.Empty:
        return
      if cmd[0] != "add":
        continue
      _, rids, _, _, sink = cmd
      with self._lock:
        self._queued -= len(rids)
      self._release(len(rids))
      for i in range(len(rids)):
        try:
          sink(i, None, error)
        except Exception:  # the event loop may be gone already
          log.exception("could not report a failed request")

  def _release(self, n: int) -> None:
    with self._lock:
      self._accepted -= n
