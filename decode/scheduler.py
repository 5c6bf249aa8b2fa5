"""The scheduler: which request holds which cache slot, and what the device runs next. No JAX.

Policy of one `schedule()`:
1. Saves first: the blocks that samples finished since the last step completed go to the prefix
   store before anything can reuse their rows.
2. Admission: while slots are free, the oldest waiting request is prefilled into the lowest free
   one (a request with n samples takes n slots: one prefill, then its rows are forked). A prompt
   longer than the largest bucket is prefilled in chunks of that size, one chunk per step, so
   running requests keep decoding between the chunks of a long prompt; at most
   `prefill_token_budget` prompt tokens are prefilled per step. With prefix caching a prompt's
   longest cached run of blocks is restored into its row first, and each chunk's completed blocks
   are saved after it.
3. Compaction: occupied slots are kept lowest. When a row finishes below a higher one, the
   highest row is moved into the hole (one row's cache copied once), so that
4. one decode step runs over the smallest power-of-two bucket of rows holding every running
   request, not over every slot: a lone request on an 8-slot engine costs what it costs alone.
   (On a mesh whose `data` axis splits the slots, every step covers all slots.) With speculation
   the step carries each row's proposals (n-gram lookups here; a draft model's are asked of the
   runner), and a row whose proposals keep failing pauses proposing for a while.

The result is a `SchedulerOutput`: device work in the order it must run (`ops`), then the decode
step. The runner executes it; the scheduler never touches the device. Every op names its rows as
they were when it was scheduled: a later op of the same step (a Move) may change where a sample is.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import TYPE_CHECKING, Union

import numpy as np
from jaxgen.decode import prefix_index, speculative, structured
from jaxgen.decode.buckets import bucket
from jaxgen.decode.prefix_index import BLOCK
from jaxgen.decode.requests import Request, Sample

if TYPE_CHECKING:
  from jaxgen.decode.config import EngineConfig
  from jaxgen.decode.stats import Stats


# ------------------------------------------------------------------------------ the device work
@dataclasses.dataclass(frozen=True)
class Restore:
  """Copy `length` cached tokens' blocks (store ids `table`) into row `slot`."""

  slot: int
  table: np.ndarray  # i32 [restore_blocks]; the scratch block pads
  length: int
  tokens: np.ndarray  # i32 [restore_blocks * BLOCK]: the restored tokens (the sampler's penalties see them)


@dataclasses.dataclass(frozen=True)
class Prefill:
  """One prompt chunk of `sample`'s request: positions start..start+n-1 into its row."""

  sample: Sample
  slot: int  # the row when scheduled (a later Move of this step may take the sample elsewhere)
  start: int
  n: int
  tokens: np.ndarray  # i32 [1, prompt bucket]
  final: bool  # the prompt's last chunk: its first token is sampled


@dataclasses.dataclass(frozen=True)
class Save:
  """Copy the blocks of row `slot` from position `first` into store blocks `table`."""

  slot: int
  first: int
  table: np.ndarray  # i32 [save_blocks]; the scratch block takes what is not saved


@dataclasses.dataclass(frozen=True)
class Fork:
  """Copy row `src` (a prefilled prompt) into row `dst`, with `sample`'s sampler state."""

  src: int
  dst: int
  sample: Sample
  last_token: int


@dataclasses.dataclass(frozen=True)
class Move:
  src: int
  dst: int


@dataclasses.dataclass(frozen=True)
class DraftAsk:
  """A row whose proposals a draft model makes: it catches up on `history` (the runner records
  how far in `sample.spec`), then proposes from position held - 1; `room` proposals are used."""

  sample: Sample
  history: np.ndarray
  held: int
  room: int


@dataclasses.dataclass(frozen=True)
class Decode:
  """One decode (or verify) step over rows 0..rows-1; `samples` are the running ones."""

  rows: int
  samples: tuple[Sample, ...]
  active: np.ndarray  # bool [rows]
  want_logprobs: bool
  proposals: np.ndarray | None = None  # i32 [rows, k]: speculation (None: a plain decode step)
  counts: np.ndarray | None = None  # i32 [rows]: proposals made per row
  asks: tuple[DraftAsk, ...] = ()  # rows whose proposals the runner asks the draft model for

  @property
  def verify(self) -> bool:
    return self.proposals is not None


Op = Union[Restore, Prefill, Save, Fork, Move]


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
  ops: tuple[Op, ...]  # in the order they must run
  decode: Decode | None

  @property
  def prefills(self) -> int:
    return sum(isinstance(op, Prefill) for op in self.ops)


def chunk_tokens(ids, start: int, chunk: int, buckets: tuple[int, ...]) -> tuple[np.ndarray, int]:
  """(the prompt chunk from `start`: at most `chunk` ids, zero-padded to a bucket [1, b], its length)."""
  n = min(chunk, len(ids) - start)
  tokens = np.zeros((1, bucket(n, buckets)), np.int32)
  tokens[0, :n] = ids[start:start + n]
  return tokens, n


# ------------------------------------------------------------------------------- the scheduler
class Scheduler:
  """Slots, queue, admission, compaction, the prefill budget, the prefix index and speculation's
  proposals and back-off. `add`, `schedule`, `release`, `unqueue`."""

  def __init__(self, config: EngineConfig, stats: Stats):
    self.config, self.stats = config, stats
    self.slots: list[Sample | None] = [None] * config.max_batch
    self.waiting: collections.deque[Request] = collections.deque()
    self.index = None if config.store is None else prefix_index.PrefixIndex(config.store.usable)
    self._saves: list[Save] = []  # of samples finished since the last schedule()

  def add(self, req: Request) -> None:
    self.waiting.append(req)

  def unqueue(self, req: Request) -> None:
    if req in self.waiting:
      self.waiting.remove(req)

  def has_work(self) -> bool:
    return bool(self.waiting) or any(s is not None for s in self.slots)

  def reset_prefix_cache(self) -> bool:
    if self.index is None:
      return False
    self.index = prefix_index.PrefixIndex(self.config.store.usable)
    return True

  def release(self, sample: Sample, save: bool) -> None:
    """Frees a finished sample's slot; save: its completed blocks go to the prefix store first."""
    if save and self.index is not None and sample.running:
      self._save_generated(sample)
    if sample.slot is not None:
      self.slots[sample.slot] = None
      sample.slot = None

  def schedule(self) -> SchedulerOutput:
    ops: list[Op] = self._saves
    self._saves = []
    self._admit(ops)
    self._compact(ops)
    # A constrained row whose prompt ends in this step draws its second token next step: that
    # draw's grammar mask needs the first token, which this step's prefill draws.
    drawing = {op.sample for op in ops if isinstance(op, Prefill) and op.final and op.sample.grammar is not None}
    running = tuple(s for s in self.slots if s is not None and s.running and s not in drawing)
    if not running:
      return SchedulerOutput(tuple(ops), None)
    rows = bucket(max(s.slot for s in running) + 1, self.config.row_buckets)
    active = np.zeros(rows, np.bool_)
    active[[s.slot for s in running]] = True
    want = any(s.req.params.logprobs is not None for s in running)
    decode = Decode(rows, running, active, want)
    if self.config.speculative is not None:
      decode = self._propose(decode)
    return SchedulerOutput(tuple(ops), decode)

  # ----------------------------------------------------------------------------------- admission
  def _admit(self, ops: list[Op]) -> None:
    budget = self.config.prefill_token_budget
    while budget > 0:
      # A request whose chunks are under way continues first.
      req = next((s.req for s in self.slots if s is not None and s.index == 0
                  and s.req.prefilled < len(s.req.prompt_ids)), None)
      if req is None:
        free = [i for i, s in enumerate(self.slots) if s is None]
        if not self.waiting or len(free) < self.waiting[0].params.n:
          return
        req = self.waiting.popleft()
        req.metrics.scheduled_time = time.perf_counter()
        for sample, slot in zip(req.samples, free):
          sample.slot = slot
          self.slots[slot] = sample
        self._restore(req, ops)
      budget -= self._prefill_chunk(req, ops)

  def _prefill_chunk(self, req: Request, ops: list[Op]) -> int:
    first = req.samples[0]
    start = req.prefilled
    tokens, n = chunk_tokens(req.prompt_ids, start, self.config.chunk, self.config.prompt_buckets)
    req.prefilled += n
    final = req.prefilled == len(req.prompt_ids)
    ops.append(Prefill(first, first.slot, start, n, tokens, final))
    if self.index is not None:
      floor = 0 if self.config.ring is None else req.prefilled - self.config.ring
      req.saved = self._save(first.slot, req.hashes, req.saved, req.prefilled // BLOCK, floor, ops)
    if final:
      ops.extend(Fork(first.slot, s.slot, s, req.prompt_ids[-1]) for s in req.samples[1:])
    return n

  def _compact(self, ops: list[Op]) -> None:
    """Moves the highest occupied rows into the holes below them (see the module docstring)."""
    if len(self.config.row_buckets) == 1:
      return
    occupied = [i for i, s in enumerate(self.slots) if s is not None]
    holes = [i for i in range(len(occupied)) if self.slots[i] is None]
    for dst, src in zip(holes, reversed(occupied)):
      if src < dst:
        break
      sample = self.slots[src]
      ops.append(Move(src, dst))
      self.slots[dst], self.slots[src], sample.slot = sample, None, dst
      self.stats.moves += 1

  # ------------------------------------------------------------------------------ prefix caching
  def _restore(self, req: Request, ops: list[Op]) -> None:
    """Restores the longest cached run of the prompt's blocks into its first row (not its last token)."""
    if self.index is None:
      return
    ids = req.prompt_ids
    req.hashes = prefix_index.chain(ids, len(ids) // BLOCK)
    hit = self.index.lookup(req.hashes[:(len(ids) - 1) // BLOCK])
    req.cached, req.saved = len(hit) * BLOCK, len(hit)
    self.stats.prefix_query_tokens += len(ids)
    self.stats.prefix_queries += 1
    if not hit:
      return
    blocks = self.config.restore_blocks
    table = np.full(blocks, self.config.store.usable, np.int32)
    table[:len(hit)] = hit
    tokens = np.zeros(blocks * BLOCK, np.int32)
    tokens[:req.cached] = ids[:req.cached]
    ops.append(Restore(req.samples[0].slot, table, req.cached, tokens))
    req.prefilled = req.cached
    self.stats.prefix_hit_tokens += req.cached
    self.stats.prefix_hits += 1

  def _save(self, slot: int, hashes: list[bytes], lo: int, hi: int, floor: int, ops: list[Op]) -> int:
    """Saves blocks lo..hi-1 of the chain `hashes` from cache row `slot` (none starting before
    position `floor`, which the rings no longer hold). Blocks 0..lo-1 must be in the store (else the
    new ones could never be reached). Returns how many leading blocks are now in the store."""
    if any(h not in self.index for h in hashes[:lo]):
      return lo
    keep = set(hashes[:hi])
    self.index.touch(hashes[:lo])
    scratch = self.config.store.usable
    ids, done = [], lo
    for i in range(lo, hi):
      if hashes[i] in self.index:
        ids.append(scratch)
      elif i * BLOCK < floor:
        break
      else:
        block = self.index.add(hashes[i], keep)
        if block is None:
          break
        ids.append(block)
        self.stats.prefix_saved_blocks += 1
      done = i + 1
    self.index.touch(hashes[:done])
    m = self.config.save_blocks
    for g in range(0, len(ids), m):
      part = ids[g:g + m]
      if all(b == scratch for b in part):
        continue
      table = np.full(m, scratch, np.int32)
      table[:len(part)] = part
      ops.append(Save(slot, (lo + g) * BLOCK, table))
    return done

  def _save_generated(self, sample: Sample) -> None:
    """Saves the blocks a finished sample completed beyond its prompt, as far as the rings hold them."""
    req = sample.req
    ids = req.prompt_ids + sample.token_ids
    # The row surely holds all but the last token; it may hold up to two more (the steps that were
    # in flight when the finish was read), which a ring writes over its oldest entries.
    written = len(ids) - 1
    ring = self.config.ring
    floor = 0 if ring is None else written + 2 + self.config.cache.slack - ring
    hashes = prefix_index.chain(ids, written // BLOCK)
    self._save(sample.slot, hashes, req.saved, len(hashes), floor, self._saves)

  # -------------------------------------------------------------------------- speculative decoding
  def _propose(self, decode: Decode) -> Decode:
    """`decode` with this step's proposals, or as it is when no row proposes."""
    cfg, max_len = self.config.speculative, self.config.max_len
    draft = cfg.method == "draft_model"
    props, counts = np.zeros((decode.rows, cfg.k), np.int32), np.zeros(decode.rows, np.int32)
    asks = []
    for s in decode.samples:
      p, out = s.req.params, s.token_ids
      if (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or len(out) < p.min_tokens
          or not s.spec.wants()):
        continue  # draws after the first would not see the tokens before them in the penalties
      held = len(s.req.prompt_ids) + len(out) - 1  # the last sampled token is fed by this step
      room = min(cfg.k, max_len - held - 1, s.req.max_tokens - len(out) - 1)
      if room < 1:
        continue
      history = np.asarray(s.req.prompt_ids + out, np.int32)
      if not draft:
        got = speculative.ngram_proposal(history, room, cfg.prompt_lookup_max, cfg.prompt_lookup_min)
        if s.grammar is not None and len(got):  # a constrained row proposes what its grammar allows
          got = got[:structured.valid_prefix(s.grammar, got)]
        props[s.slot, :len(got)], counts[s.slot] = got, len(got)
      elif held >= 1 and held + cfg.k <= max_len:  # the draft writes k positions from held - 1
        asks.append(DraftAsk(s, history, held, room))
        counts[s.slot] = room
    if not counts.any():
      return decode
    return dataclasses.replace(decode, proposals=props, counts=counts, asks=tuple(asks))
