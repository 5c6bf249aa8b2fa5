"""The runner: owns what lives on the device and runs what the scheduler decided.

It holds the weights, the decode state (KV cache and per-row sampler state, donated to every
program), the prefix store, the compiled programs and a draft model's. `execute(SchedulerOutput)`
dispatches one step's programs in order and returns `InFlight` handles without waiting for the
device; `read(handle)` waits for one and returns a `RunnerOutput` of host arrays. Device time is
measured from one read to the next (compile time excluded): the engine reads the previous step's
results while the device runs this one.

Warm-up runs `EngineConfig.programs`, so what `program_count` says and what compiles are one list.
`build_decode_ahead` starts the first decode program's build on a thread so a start can overlap it
with parsing the tokenizer.

A row held to a grammar (`decode.structured`) draws with its mask, which depends on the token drawn
the step before. So a decode step with such a row dispatches its forward pass and leaves the draw
`pending`: the engine reads the previous step back (the matchers take its tokens) while the device
runs the forward pass, then `draw` computes the masks and dispatches the sampler.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jaxgen.decode import compiles, draft, structured
from jaxgen.decode.config import EngineConfig
from jaxgen.decode.params import SamplingParams, row_params
from jaxgen.decode.prefix_index import BLOCK
from jaxgen.decode.buckets import bucket
from jaxgen.decode.scheduler import Decode, Fork, Move, Prefill, Restore, Save, SchedulerOutput, chunk_tokens
from jaxgen.decode.stats import Stats
from jaxgen.decode.steps import place_state, place_store, programs_for, state_shardings, store_shardings
from jaxgen.model.params import path_str
from jaxgen.model.platform import return_freed_heap
from jaxgen.sharding import rules

log = logging.getLogger(__name__)


@dataclasses.dataclass
class InFlight:
  """A dispatched prefill chunk or decode step whose results are not read yet."""

  kind: str  # "prefill" or "decode"
  out: Any  # the program's sampled ids (and logprobs), still on the device; None: nothing drawn
  rows: list  # [(row of the results, Sample)] to hand the results to
  dispatched: float
  compile_s: float  # of this dispatch (a build ahead waited for, a program compiled)
  prompt_tokens: int = 0  # prefill: the chunk's tokens
  accepted: Any = None  # verify: accepted proposals per row (on the device)
  counts: np.ndarray | None = None  # verify: proposals per row
  ready: Any = None  # without `out`: an output of the program (not one a later dispatch donates), to wait for
  pending: Any = None  # a decode step's draw waiting for its rows' grammar masks: (logits, took, want)


@dataclasses.dataclass(frozen=True)
class RunnerOutput:
  """One program's results on the host. A verify step draws k + 1 positions per row: token i of
  row r is at r * width + i."""

  kind: str
  rows: list
  tokens: np.ndarray
  logprob: np.ndarray | None  # of each drawn token; None when no row asked for logprobs
  top_ids: np.ndarray | None
  top_logprobs: np.ndarray | None
  busy_s: float  # device time since the previous read, compile time excluded
  compile_s: float
  prompt_tokens: int
  accepted: np.ndarray | None
  counts: np.ndarray | None

  @property
  def width(self) -> int:
    return 1 if self.accepted is None else len(self.tokens) // len(self.accepted)


class Runner:
  def __init__(self, config: EngineConfig, model, draft_model=None):
    self.config = config
    cfg, mesh = config.model, config.mesh
    self.graphdef, params = nnx.split(model)
    shardings = None
    if mesh is not None:
      shardings = {"params": rules.param_tree(params, rules.param_shardings(cfg, str(model.dtype), mesh)),
                   "state": state_shardings(cfg, config.cache, mesh)}
      if config.store is not None:
        shardings["store"] = store_shardings(cfg, config.store, mesh)
    # Committed to where they already are (no copy), as swapped-in weights will be
    # (`update_weights`), so that the compiled programs serve both.
    self.params = _committed(params)
    self.state = _committed(place_state(cfg, config.cache, None if shardings is None else shardings["state"]))
    self.store = None
    if config.store is not None:
      self.store = _committed(place_store(cfg, config.store, None if shardings is None else shardings["store"]))
    self.programs = programs_for(self.graphdef, cfg, config.cache, config.platform, shardings)
    self.drafter = None
    if config.draft_platform is not None:
      self.drafter = draft.Drafter(draft_model, config.cache, config.draft_platform, config.speculative.k,
                                   config.prompt_buckets, config.row_buckets, mesh)
    # The sampler's inputs as a decode step hands them over (committed, placed as program outputs
    # are), also where a prefill's come from the host: one program per row count, not two.
    out = self.state.cache.lengths.sharding if mesh is None else rules.replicated(mesh)
    self._place = lambda x: jax.device_put(x, out)
    self._take = self._place(np.full(1, True))  # a prompt's last chunk: its row keeps the draw
    self.grammar = GrammarMasks(self._place, cfg.vocab_size)
    self.built: set[int] = set()  # row buckets whose decode (or verify) program has run
    self.ahead: threading.Thread | None = None  # `build_decode_ahead`'s build, until waited for
    self._last_ready = time.perf_counter()

  # --------------------------------------------------------------------------------- one step
  def execute(self, work: SchedulerOutput, stats: Stats, *, decode: bool = True) -> list[InFlight]:
    """Dispatches `work` in order (its decode step unless decode=False); returns what is in flight."""
    flights = []
    for op in work.ops:
      if isinstance(op, Prefill):
        flights.append(self._prefill(op))
      elif isinstance(op, Restore):
        self.state = self.programs.restore(self.state, self.store, np.int32(op.slot), op.table, np.int32(op.length),
                                           op.tokens)
      elif isinstance(op, Save):
        self.store = self.programs.save(self.state, self.store, np.int32(op.slot), np.int32(op.first), op.table)
      elif isinstance(op, Fork):
        self.state = self.programs.fork(self.state, np.int32(op.src), np.int32(op.dst),
                                        _row_params(op.sample), np.int32(op.last_token))
      elif isinstance(op, Move):
        self.state = self.programs.move(self.state, np.int32(op.src), np.int32(op.dst))
        if self.drafter is not None:
          self.drafter.move(op.src, op.dst)
    if work.decode is not None and decode:
      flights.append(self._decode(work.decode, stats))
    return flights

  def _prefill(self, op: Prefill) -> InFlight:
    args = (self.params, self.state, op.tokens, np.array([op.n], np.int32), np.array([op.slot], np.int32),
            _row_params(op.sample))
    t0 = time.perf_counter()
    if self.ahead is not None:  # the decode program loads: trace this one meanwhile, load it after
      lowered = self.programs.lower_prefill(*args, fresh=op.start == 0)
      self.await_ahead(unless_compiling=True)
      lowered.compile()
    waited = time.perf_counter() - t0  # building programs: compile time to the metrics
    c0 = compiles.seconds()
    self.state, logits = self.programs.prefill(*args, fresh=op.start == 0)
    if not op.final:  # nothing to draw: `read` waits for the chunk itself
      return InFlight("prefill", None, [], t0, waited + compiles.seconds() - c0, op.n, ready=logits)
    want = op.sample.req.params.logprobs is not None
    self.state, out = self.programs.sample(self.state, logits, np.array([op.slot], np.int32), self._take,
                                           np.bool_(want), *self.grammar.draw([(0, op.sample)], 1))
    return InFlight("prefill", out, [(0, op.sample)], t0, waited + compiles.seconds() - c0, op.n)

  def _decode(self, d: Decode, stats: Stats) -> InFlight:
    t0 = time.perf_counter()
    if self.ahead is not None:
      self.await_ahead()
    waited = time.perf_counter() - t0  # a build ahead still compiling: compile time to the metrics
    c0 = compiles.seconds()  # a draft's work counts as decode time
    want = np.bool_(d.want_logprobs)
    rows = [(s.slot, s) for s in d.samples]
    pending, counts = None, d.counts
    if not d.verify:
      self.state, logits, took = self.programs.decode(self.params, self.state, d.active)
      out = accepted = None
      if self.config.reads_first or not any(s.grammar is not None for s in d.samples):
        self.state, out = self.programs.sample(self.state, logits, np.arange(d.rows, dtype=np.int32), took, want,
                                               *self.grammar.draw(rows, d.rows))
      else:  # the masks need the previous step's tokens: `draw` once they are read
        pending = (logits, took, want)
    else:
      proposals = d.proposals
      if d.asks:
        proposals, counts = self._draft(d)
      self.state, out, accepted = self.programs.verify(self.params, self.state, d.active, proposals, counts, want,
                                                       *self.grammar.verify(rows, proposals, counts))
    stats.decode_rows[d.rows] += 1
    self.built.add(d.rows)
    return InFlight("decode", out, rows, t0, waited + compiles.seconds() - c0, accepted=accepted,
                    counts=counts, pending=pending)

  def draw_pending(self, flights) -> None:
    """Dispatches the draws among `flights` held for grammar masks (`draw`)."""
    for f in flights:
      if f.pending is not None:
        self.draw(f)

  def draw(self, f: InFlight) -> None:
    """Dispatches a decode step's pending draw with its rows' grammar masks as they are now: once
    the step before is read, before any other program is dispatched."""
    logits, took, want = f.pending
    f.pending = None
    c0 = compiles.seconds()
    self.state, f.out = self.programs.sample(self.state, logits, np.arange(len(took), dtype=np.int32), took, want,
                                             *self.grammar.draw(f.rows, len(took)))
    f.compile_s += compiles.seconds() - c0

  def _draft(self, d: Decode) -> tuple[np.ndarray, np.ndarray]:
    """(proposals, counts): the scheduler's with the draft model's filled in for the rows it asked
    about (a constrained row's cut to what its grammar allows)."""
    proposals, counts = d.proposals.copy(), d.counts.copy()
    active, window, start = np.zeros(d.rows, np.bool_), np.zeros((d.rows, 2), np.int32), np.zeros(d.rows, np.int32)
    for a in d.asks:
      s = a.sample
      s.spec.draft_held = self.drafter.catch_up(s.slot, a.history, s.spec.draft_held, a.held - 1)
      active[s.slot], window[s.slot], start[s.slot] = True, a.history[a.held - 1:a.held + 1], a.held - 1
      s.spec.draft_base = a.held
    got = self.drafter.propose(active, window, start)
    for a in d.asks:
      slot = a.sample.slot
      proposals[slot, :a.room] = got[slot, :a.room]
      if a.sample.grammar is not None:
        counts[slot] = structured.valid_prefix(a.sample.grammar, got[slot, :a.room])
    return proposals, counts

  def read(self, f: InFlight) -> RunnerOutput:
    """Waits for one dispatch's results and brings them to the host (a pending draw is dispatched
    first: every dispatch before it was read)."""
    if f.pending is not None:
      self.draw(f)
    if f.out is None:  # a prompt's earlier chunk: nothing drawn
      jax.block_until_ready(f.ready)
      tokens = np.zeros(0, np.int32)
    else:
      tokens = np.asarray(f.out.tokens)  # blocks until this program finished
    now = time.perf_counter()
    busy = max(0.0, now - max(self._last_ready, f.dispatched) - f.compile_s)
    self._last_ready = now
    lp = top_ids = top_lp = None
    if any(s.req.params.logprobs is not None for _, s in f.rows):
      lp, top_ids, top_lp = np.asarray(f.out.logprob), np.asarray(f.out.top_ids), np.asarray(f.out.top_logprobs)
    accepted = None if f.accepted is None else np.asarray(f.accepted)
    return RunnerOutput(f.kind, f.rows, tokens, lp, top_ids, top_lp, busy, f.compile_s, f.prompt_tokens, accepted,
                        f.counts)

  # ------------------------------------------------------------------------------ benchmarks
  def prefill_prompt(self, ids: np.ndarray, slot: int = 0):
    """Prefills prompt `ids` into row `slot` in the engine's chunks, outside any request (what a
    benchmark of prefill times); returns the token sampled after it, on the device."""
    row = row_params(SamplingParams(max_tokens=1), prompt_len=len(ids), stop_ids=(), seed=0)
    start = 0
    while start < len(ids):
      tokens, n = chunk_tokens(ids, start, self.config.chunk, self.config.prompt_buckets)
      self.state, logits = self.programs.prefill(self.params, self.state, tokens, np.array([n], np.int32),
                                                 np.array([slot], np.int32), row, fresh=start == 0)
      start += n
    self.state, out = self.programs.sample(self.state, logits, np.array([slot], np.int32), self._take, np.bool_(False),
                                           *self.grammar.unconstrained(1, 1))
    return out.tokens

  def decode_rows(self, rows: int):
    """One decode step over rows 0..rows-1 (padded to a row bucket), outside any request (what a
    benchmark of decode times); returns the sampled ids, on the device."""
    active = np.zeros(bucket(rows, self.config.row_buckets), np.bool_)
    active[:rows] = True
    self.state, logits, took = self.programs.decode(self.params, self.state, active)
    self.state, out = self.programs.sample(self.state, logits, np.arange(len(active), dtype=np.int32), took,
                                           np.bool_(False), *self.grammar.unconstrained(len(active), len(active)))
    return out.tokens

  # -------------------------------------------------------------------------------- compiling
  def build_decode_ahead(self) -> None:
    """Traces the decode program a first request runs (the smallest row bucket), then compiles it
    or loads it from the persistent cache on a thread, and returns: the caller's next work (an
    `LLM` parses its tokenizer, which holds the GIL but not the cores) hides the load.

    Why ahead: the first prefill makes the weights resident, and a build after it holds its
    transient memory (a load parses several copies of the program) on top of them, which sets the
    peak of a start. So the first prefill waits for a load before it runs (tracing its own program
    meanwhile, loading it after). A compilation from scratch (a cold cache: seconds) is not waited
    for there; the first decode step waits for it, as it would have built the program itself.
    `warmup()` waits for it too."""
    if self.ahead is not None or jax.process_count() > 1:  # processes build in step, in order
      return
    rows = self.config.row_buckets[0]
    lowered = self.programs.decode.lower(self.params, self.state, np.zeros(rows, np.bool_))

    def build():
      try:
        lowered.compile()
      except Exception as e:  # built (and the error raised) on first use instead
        log.warning("building the decode program ahead failed (%s: %s)", type(e).__name__, e)

    self.ahead = threading.Thread(target=build, name="jaxgen-decode-ahead")
    self.ahead.start()

  def await_ahead(self, *, unless_compiling: bool = False) -> None:
    """Waits for `build_decode_ahead`'s build. unless_compiling: returns at once if the build
    missed the persistent cache (or there is none), leaving it for a later call to wait for."""
    ahead = self.ahead
    if ahead is None:
      return
    if unless_compiling and ahead.is_alive():
      if not compiles.persistent_cache_on():
        return
      while ahead.is_alive() and compiles.cache_lookup(ahead) is None:
        ahead.join(0.005)  # not looked up yet
      if ahead.is_alive() and compiles.cache_lookup(ahead) == "cache_misses":
        return
    ahead.join()
    self.ahead = None
    return_freed_heap()  # what the load freed, before the weights are touched

  def warmup(self) -> None:
    """Runs every program of `EngineConfig.programs` once, on slot 0 with throwaway inputs."""
    self.await_ahead()
    slots, k = self.config.max_batch, 0 if self.config.speculative is None else self.config.speculative.k
    row = row_params(SamplingParams(max_tokens=1), prompt_len=1, stop_ids=(), seed=0)
    scratch = None if self.config.store is None else self.config.store.usable
    restore_blocks = self.config.restore_blocks
    p = self.programs
    for name, *shape in self.config.programs:
      if name == "prefill":
        fresh, b = shape
        self.state, _ = p.prefill(self.params, self.state, np.zeros((1, b), np.int32), np.array([1], np.int32),
                                  np.array([0], np.int32), row, fresh=fresh)
      elif name == "decode":
        self.state, *_ = p.decode(self.params, self.state, np.zeros(shape[0], np.bool_))
        self.built.add(shape[0])
      elif name == "sample":
        rows = shape[0]
        self.state, _ = p.sample(self.state, self._place(np.zeros((rows, self.config.model.vocab_size), np.float32)),
                                 np.arange(rows, dtype=np.int32), self._place(np.zeros(rows, np.bool_)), np.bool_(False),
                                 *self.grammar.unconstrained(rows, rows))
      elif name == "verify":
        rows = shape[0]
        self.state, *_ = p.verify(self.params, self.state, np.zeros(rows, np.bool_), np.zeros((rows, k), np.int32),
                                  np.zeros(rows, np.int32), np.bool_(False), *self.grammar.unconstrained(rows * (k + 1), rows))
      elif name == "fork":
        self.state = p.fork(self.state, np.int32(0), np.int32(slots - 1), row, np.int32(0))
      elif name == "move":
        self.state = p.move(self.state, np.int32(slots - 1), np.int32(0))
      elif name == "logits":
        p.logits(self.params, np.zeros((1, shape[0]), np.int32))
      elif name == "save":
        self.store = p.save(self.state, self.store, np.int32(0), np.int32(0),
                            np.full(self.config.save_blocks, scratch, np.int32))
      elif name == "restore":
        self.state = p.restore(self.state, self.store, np.int32(0), np.full(restore_blocks, scratch, np.int32),
                               np.int32(0), np.zeros(restore_blocks * BLOCK, np.int32))
      elif name.startswith("draft_"):
        self.drafter.warm(name, *shape)
      else:
        raise AssertionError(f"no warm-up for program {name!r}")
    jax.block_until_ready(self.state)
    self._last_ready = time.perf_counter()

  # ---------------------------------------------------------------------------------- weights
  def weights(self):
    """The model the programs run (graph and current parameters)."""
    return nnx.merge(self.graphdef, self.params)

  def update_weights(self, values: dict[str, jax.Array]) -> None:
    """Swaps in parameters {flat name: array}, laid out as the current ones; nothing recompiles."""
    flat = nnx.to_flat_state(self.params)
    self.params = nnx.from_flat_state([(path, var.replace(values[path_str(path)])) for path, var in flat])

  def logits(self, tokens: np.ndarray) -> np.ndarray:
    """Float32 logits [1, T, V] of one uncached forward pass over tokens [1, T]."""
    return np.asarray(self.programs.logits(self.params, tokens))


class GrammarMasks:
  """The sampling programs' grammar-mask arguments (mask int32 [positions, V/32], constrained bool
  [rows]), placed where the programs take them: from the samples' matchers as they are now, or one
  constant per shape when no row is constrained."""

  def __init__(self, place, vocab_size: int):
    self.place, self.vocab_size = place, vocab_size
    self._constant: dict[tuple[int, int], tuple] = {}

  def draw(self, rows: list, width: int) -> tuple:
    """For a draw over `width` rows: the masks of the samples among `rows` [(row, Sample)] that
    have a grammar."""
    held = _held(rows)
    if not held:
      return self.unconstrained(width, width)
    return self.place(structured.masks(held, width, self.vocab_size)), self._constrained(held, width)

  def verify(self, rows: list, proposals: np.ndarray, counts: np.ndarray) -> tuple:
    """For a verify step: [R * (k + 1), V/32], a constrained row's mask at each position after the
    proposals before it (`structured.masks_along`)."""
    width, t = proposals.shape[0], proposals.shape[1] + 1
    held = _held(rows)
    if not held:
      return self.unconstrained(width * t, width)
    return self.place(structured.masks_along(held, proposals, counts, t, self.vocab_size)), self._constrained(held, width)

  def unconstrained(self, positions: int, width: int) -> tuple:
    """The placed constant of `width` rows drawing at `positions` in all, none constrained."""
    if (positions, width) not in self._constant:
      words = structured.words(self.vocab_size)
      self._constant[positions, width] = (self.place(np.zeros((positions, words), np.int32)),
                                          self.place(np.zeros(width, np.bool_)))
    return self._constant[positions, width]

  def _constrained(self, held: list, width: int):
    constrained = np.zeros(width, np.bool_)
    constrained[[r for r, _ in held]] = True
    return self.place(constrained)


def _held(rows: list) -> list:
  return [(r, s.grammar) for r, s in rows if s.grammar is not None and not s.done]


def _row_params(sample):
  req = sample.req
  return row_params(req.params, prompt_len=len(req.prompt_ids), stop_ids=req.stop_ids, seed=sample.seed)


def _committed(tree):
  """`tree` committed to the devices it is on (no copy). Programs whose inputs are all committed
  return committed outputs; inputs that start uncommitted would make each program compile twice."""
  return jax.device_put(tree, jax.tree.map(lambda x: x.sharding, tree))
