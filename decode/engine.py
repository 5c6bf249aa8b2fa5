"""The continuous-batching engine: a short loop over three rooms.

    add_request ──> Scheduler ──SchedulerOutput──> Runner ──RunnerOutput──> OutputProcessor ──> RequestOutput
                   (slots, queue,                 (weights, cache,          (text, stops,
                    prefix index; no JAX)          programs; the device)     logprobs; no JAX)

One `step()` dispatches this step's work, then reads back the previous step's results while the
device runs it (dispatch before read): a row that finished in step k still computes in step k+1,
and that token is discarded. A row held to a grammar draws after that read (its mask needs the
token before), while the device runs the step's forward pass (`Runner.draw`). Two features read
first. Speculation makes its proposals from the latest tokens, so a speculative engine reads everything before it schedules. And a decode program
never run before would hold this step's first tokens back by its build (a trace and a compile, or
a load from the cache): the prefills' results are read first and the decode waits a step.
docs/architecture.md follows one request through the rooms.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Sequence

import numpy as np
from jaxgen.decode import stats as engine_stats
from jaxgen.decode.config import EngineConfig
from jaxgen.decode.output_processor import OutputProcessor
from jaxgen.decode.outputs import RequestOutput
from jaxgen.decode.params import SamplingParams, token_ids
from jaxgen.decode.runner import Runner
from jaxgen.decode.scheduler import Scheduler

class Engine:
  """Serves many requests at once over `max_batch` cache slots of `max_len` tokens each.

  `add_request(prompt, params) -> id`, `step() -> [RequestOutput]`, `abort(id)`,
  `has_unfinished()`, `metrics()`, `warmup()`. Nothing compiles after `warmup()`.

  config: an `EngineConfig`; without one, the keyword arguments resolve one
  (`EngineConfig.resolve`: max_batch, max_len, prefill_chunk, cache_dtype, platform, mesh, seed,
  enable_prefix_caching, prefix_cache_tokens, speculative_config, ...). draft_model: the draft (a
  Transformer sharing the vocabulary) when the speculation method is "draft_model".
  """

  def __init__(self, model, tokenizer, config: EngineConfig | None = None, *, draft_model=None, **settings):
    if config is None:
      draft = None if draft_model is None else (draft_model.cfg, str(draft_model.dtype))
      config = EngineConfig.resolve(model.cfg, str(model.dtype), draft=draft, **settings)
    elif settings:
      raise ValueError(f"pass either an EngineConfig or settings, not both (got {sorted(settings)})")
    self.config, self.cfg = config, config.model
    self.stats = engine_stats.Stats()
    self.scheduler = Scheduler(config, self.stats)
    self.runner = Runner(config, model, draft_model)
    k = 0 if config.speculative is None else config.speculative.k
    self.processor = OutputProcessor(tokenizer, self.scheduler, self.stats, max_len=config.max_len,
                                     vocab_size=config.model.vocab_size, spec_k=k, seed=config.seed)
    self.requests: dict[str, object] = {}
    self._in_flight: collections.deque = collections.deque()
    self._aborted: list = []  # aborted since the last step, reported by the next
    self._ids = itertools.count()

  @property
  def max_len(self) -> int:
    return self.config.max_len

  @property
  def tokenizer(self):
    return self.processor.tokenizer

  @tokenizer.setter
  def tokenizer(self, tokenizer) -> None:  # an LLM hands its tokenizer over once it is parsed
    self.processor.tokenizer = tokenizer

  # ----------------------------------------------------------------------------------- requests
  def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                  request_id: str | None = None) -> str:
    """Validates and queues one request; raises ValueError (nothing queued) on bad input."""
    params = params or SamplingParams()
    text, ids = self.check_request(prompt, params)
    rid = str(request_id if request_id is not None else next(self._ids))
    if rid in self.requests:
      raise ValueError(f"request_id={rid!r} is already in use")
    req = self.processor.request(rid, text, ids, params)
    self.requests[rid] = req
    self.scheduler.add(req)
    return rid

  def check_request(self, prompt: str | Sequence[int], params: SamplingParams) -> tuple[str | None, list[int]]:
    """The checks of `add_request`, changing nothing (a server runs them on its own thread)."""
    return check_request(self.config, self.tokenizer, prompt, params, self.processor.grammars)

  def abort(self, request_id: str) -> None:
    """Ends a request (finish_reason "abort", with what it produced); unknown or finished ids are ignored."""
    req = self.requests.get(str(request_id))
    if req is None or req.finished:
      return
    for s in req.samples:
      if not s.done:
        self.processor.finish(s, "abort")
    self.scheduler.unqueue(req)
    self._aborted.append(req)

  def reset_prefix_cache(self) -> bool:
    """Forgets every cached prefix (as vLLM's); False when prefix caching is off."""
    return self.scheduler.reset_prefix_cache()

  def has_unfinished(self) -> bool:
    return self.scheduler.has_work() or bool(self._in_flight) or bool(self._aborted)

  # ------------------------------------------------------------------------------------ the loop
  def step(self) -> list[RequestOutput]:
    """Dispatches this step's programs, then reads back the previous step's results."""
    updated = {}
    if self.config.reads_first:
      self._read(len(self._in_flight), updated)
    work = self.scheduler.schedule()
    first_build = (not self.config.reads_first and work.decode is not None and work.prefills > 0
                   and work.decode.rows not in self.runner.built)
    flights = self.runner.execute(work, self.stats, decode=not first_build)
    self._in_flight.extend(flights)
    updated.update({r.id: r for r in self._aborted})
    self._aborted = []
    # Read back what was dispatched before this step and keep this step's in flight; when nothing
    # new went out (or the first tokens wait on a decode build), read everything.
    keep = len(flights) if flights and not first_build else 0
    self._read(len(self._in_flight) - keep, updated)
    self.runner.draw_pending(self._in_flight)  # draws held for grammar masks: the tokens before are read
    outs = []
    for req in updated.values():
      if req.finished:
        self.requests.pop(req.id, None)
      elif req.output_kind == "final_only":
        continue
      outs.append(req.output())
    return outs

  def _read(self, n: int, updated: dict) -> None:
    for _ in range(n):
      for req in self.processor.process(self.runner.read(self._in_flight.popleft())):
        updated[req.id] = req

  # ------------------------------------------------------------------------------------ weights
  def model(self):
    """The model the programs run: its graph with the current parameters."""
    return self.runner.weights()

  def update_weights(self, values: dict) -> None:
    """Swaps in parameters {flat name: array} laid out as the current ones (nothing recompiles).
    Requests in flight are aborted first (their tokens came from the old weights); the prefix
    cache is emptied."""
    for rid in list(self.requests):
      self.abort(rid)
    while self.has_unfinished():
      self.step()
    self.runner.update_weights(values)
    self.reset_prefix_cache()

  def logits(self, tokens: np.ndarray) -> np.ndarray:
    """Float32 logits [1, T, V] of one uncached forward pass over tokens [1, T] (a bucket)."""
    return self.runner.logits(tokens)

  # ------------------------------------------------------------------------------------- extras
  def build_decode_ahead(self) -> None:
    """Starts building the first decode program on a thread (`Runner.build_decode_ahead`)."""
    self.runner.build_decode_ahead()

  def warmup(self) -> float:
    """Compiles every program serving can need (`EngineConfig.programs`: `num_programs` of them,
    logarithmic in max_batch and the chunk); returns the seconds it took."""
    t0 = time.perf_counter()
    self.runner.warmup()
    return time.perf_counter() - t0

  @property
  def num_programs(self) -> int:
    return self.config.program_count

  def metrics(self) -> dict:
    """A plain snapshot of the engine: occupancy, cache use, per-phase throughput."""
    return engine_stats.snapshot(self.config, self.stats, self.scheduler)


def check_request(config: EngineConfig, tokenizer, prompt: str | Sequence[int], params: SamplingParams,
                  grammars) -> tuple[str | None, list[int]]:
  """(text or None, prompt token ids) of a request an engine of `config` can serve; a ValueError
  naming what is wrong (the argument, its value, the limit) otherwise. A structured-output
  constraint is compiled by `grammars` (and cached), so a bad one is refused here."""
  params.validate(config.model.vocab_size)
  if getattr(params, "structured_outputs", None) is not None:
    grammars.compile(params.structured_outputs)
  if isinstance(prompt, str):
    text, ids = prompt, tokenizer.encode(prompt, add_special_tokens=True)
  elif isinstance(prompt, (Sequence, np.ndarray)):
    text, ids = None, token_ids(prompt, config.model.vocab_size)
  else:
    raise ValueError(f"prompt is a {type(prompt).__name__}: give a string or a list of token ids")
  if not ids:
    raise ValueError("prompt is empty: it must have at least one token")
  if len(ids) >= config.max_len:
    raise ValueError(f"prompt has {len(ids)} tokens; the context limit is max_len={config.max_len} "
                     "(the prompt must leave room for at least one generated token)")
  if params.n > config.max_batch:
    raise ValueError(f"SamplingParams.n={params.n} exceeds the engine's max_batch={config.max_batch} slots")
  return text, ids
