"""The continuous-batching engine: a fixed set of cache slots, a queue, and a host loop.

Policy of one `step()`:
1. Admission: while slots are free, the oldest waiting request is prefilled into the lowest free
   one (a request with n samples takes n slots: one prefill, then its rows are forked). A prompt
   longer than the largest bucket is prefilled in chunks of that size, one chunk per step, so
   running requests keep decoding between the chunks of a long prompt; at most
   `prefill_token_budget` prompt tokens are prefilled per step.
2. Compaction: occupied slots are kept lowest. When a row finishes below a higher one, the
   highest row is moved into the hole (one row's cache copied once), so that
3. one decode step runs over the smallest power-of-two bucket of rows holding every running
   request, not over every slot: a lone request on an 8-slot engine costs what it costs alone.
   (On a mesh whose `data` axis splits the slots, every step covers all slots.)
4. The results of the *previous* step are read back and turned into text, stop checks and
   outputs while the device works on this one (dispatch before read). A row that finished in
   step k still computes in step k+1; that token is discarded.
Finished rows free their slot at once; the next step can admit into it.

Speculative decoding (`decode.speculative`, opt-in): results are read back before the next step
is dispatched (proposals need the latest tokens), and a step in which some row proposes runs the
verify program instead of decode.

Prefix caching (`decode.prefix`, on by default): on admission a prompt's longest cached run of
blocks is copied into its row and only the rest is prefilled; each prompt chunk's completed
blocks, and a finished request's generated ones, are saved to the store.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import random
import threading
import time
from typing import Iterable, Sequence

import jax
import numpy as np
from flax import nnx
from jaxgen.decode import compiles, draft, prefix, speculative
from jaxgen.decode.buckets import bucket, powers_of_two
from jaxgen.decode.cache import CacheSpec
from jaxgen.decode.outputs import (
  CompletionOutput,
  Logprob,
  RequestMetrics,
  RequestOutput,
)
from jaxgen.decode.params import SamplingParams, row_params, token_ids
from jaxgen.decode.prefix import BLOCK
from jaxgen.decode.steps import Programs, place_state, place_store, store_shardings
from jaxgen.decode.text import IncrementalDetokenizer, find_stop, holdback
from jaxgen.model.config import LOCAL
from jaxgen.model.platform import Platform, resolve, return_freed_heap

log = logging.getLogger(__name__)

_SAMPLE_SEED_STRIDE = 0x9E3779B97F4A7C15  # sample i of a request uses seed + i * stride (mod 2**64)
MIN_PROMPT_BUCKET = 16


def program_count(max_batch: int, prefill_chunk: int, data_parallel: int = 1, prefix_caching: bool = False,
                  speculative: bool = False) -> int:
  """Programs an engine compiles in `warmup()`: prefill (fresh and continued) per prompt bucket,
  decode per row bucket, fork, move, the uncached forward of the smallest `LLM.logits` bucket,
  with prefix caching its save and restore, with speculation verify per row bucket. Logarithmic
  in max_batch and the chunk."""
  prompt = len(prompt_buckets(prefill_chunk))
  rows = len(powers_of_two(max_batch)) if data_parallel == 1 else 1
  return 2 * prompt + rows * (2 if speculative else 1) + 3 + (2 if prefix_caching else 0)


def prompt_chunk(cfg, spec: CacheSpec, prefill_chunk: int, prefix_caching: bool) -> tuple[int, int | None, str | None]:
  """(the largest prompt chunk one prefill takes, the smallest ring's length or None, why prefix
  caching is off or None)."""
  chunk = min(prefill_chunk, spec.max_len)
  note = None if prefix_caching else "off (enable_prefix_caching=False)"
  ring = min((spec.layer_len(cfg, k) for k in cfg.layer_kinds if k == LOCAL), default=None)
  if note is None and ring is not None and ring < BLOCK:
    note = f"off: the sliding window of {ring} tokens is shorter than a block of {BLOCK}"
  if note is None:
    # Blocks are saved from the row after each chunk, so a chunk must fit the smallest ring and
    # start on a block boundary.
    limit = chunk if ring is None else min(chunk, ring)
    chunk = limit - limit % BLOCK if limit >= BLOCK else limit
  return chunk, ring, note


def prompt_buckets(chunk: int) -> tuple[int, ...]:
  """Prompt lengths a prefill program is compiled for: powers of two from 16 up to the chunk."""
  return powers_of_two(chunk, min(MIN_PROMPT_BUCKET, chunk))


@dataclasses.dataclass
class _Seq:
  """One sample of a request; holds a slot while running."""

  req: "_Request"
  index: int
  seed: int
  out: CompletionOutput
  detok: IncrementalDetokenizer
  slot: int | None = None
  spec: speculative.RowSpec = dataclasses.field(default_factory=speculative.RowSpec)
  full_text: str = ""  # generated text before stop-string truncation

  @property
  def done(self) -> bool:
    return self.out.finish_reason is not None

  @property
  def running(self) -> bool:
    """Holds a slot whose prompt is fully prefilled (so it decodes)."""
    return self.slot is not None and self.req.prefilled == len(self.req.prompt_ids)


@dataclasses.dataclass
class _Request:
  id: str
  prompt: str | None
  prompt_ids: list[int]
  params: SamplingParams
  max_tokens: int
  stop_ids: frozenset[int]
  metrics: RequestMetrics
  seqs: list[_Seq] = dataclasses.field(default_factory=list)
  prefilled: int = 0  # prompt tokens already in the cache
  cached: int | None = None  # prompt tokens restored from the prefix store (None: caching off)
  hashes: list[bytes] = dataclasses.field(default_factory=list)  # chained hashes of full prompt blocks
  saved: int = 0  # leading blocks of the prompt known to be in the prefix store

  @property
  def finished(self) -> bool:
    return all(s.done for s in self.seqs)

  def output(self) -> RequestOutput:
    return RequestOutput(self.id, self.prompt, self.prompt_ids, [s.out for s in self.seqs], self.metrics,
                         finished=self.finished, num_cached_tokens=self.cached)


class Engine:
  """Serves many requests at once over `max_batch` cache slots of `max_len` tokens each.

  `add_request(prompt, params) -> id`, `step() -> [RequestOutput updated]`, `abort(id)`,
  `has_unfinished()`, `metrics()`. Nothing compiles after `warmup()`.

  platform: how the programs run (default: `platform.resolve` for the model's dtype).
  seed: seeds the host RNG that draws a seed for requests without one (None: from the OS).
  enable_prefix_caching: reuse the cache of prompt prefixes seen before (`decode.prefix`); a model
  whose sliding window is shorter than a block caches nothing (`prefix_note` says why).
  prefix_cache_tokens: the store's budget in tokens (default: half the free device memory, or as
  many bytes as the KV cache where the device does not report its memory).
  speculative_config: vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 4} (or
  "ngram:4"); `decode.speculative`. None: off.
  draft_model: the draft (a Transformer sharing the vocabulary) when the method is "draft_model"
  (`decode.draft.load` makes it from the config; `LLM` does this); draft_platform: how it runs
  (default: resolved for its dtype and weights).
  """

  def __init__(self, model, tokenizer, *, max_batch: int = 8, max_len: int = 2048, prefill_chunk: int | None = None,
               cache_dtype: str | None = None, platform: Platform | None = None, shardings=None,
               prefill_token_budget: int | None = None, seed: int | None = None,
               enable_prefix_caching: bool = True, prefix_cache_tokens: int | None = None,
               speculative_config=None, draft_model=None, draft_platform: Platform | None = None):
    cfg = model.cfg
    if max_len > cfg.max_context:
      raise ValueError(f"max_len={max_len} exceeds the model's context length {cfg.max_context}")
    if max_len < 2:
      raise ValueError(f"max_len={max_len} must be >= 2")
    if max_batch < 1:
      raise ValueError(f"max_batch={max_batch} must be >= 1")
    if prefix_cache_tokens is not None and prefix_cache_tokens < 0:
      raise ValueError(f"prefix_cache_tokens={prefix_cache_tokens} must be >= 0")
    self.cfg, self.tokenizer = cfg, tokenizer
    self.graphdef_dtype = model.dtype
    self.graphdef, self.params = nnx.split(model)
    # Committed to where they already are (no copy), as swapped-in weights will be
    # (`LLM.update_weights`), so that the compiled programs serve both.
    self.params = _committed(self.params)
    self.platform = platform or resolve(str(model.dtype), cache_dtype=cache_dtype, prefill_chunk=prefill_chunk)
    self.spec_cfg = speculative.parse(speculative_config)
    self.spec = CacheSpec(slots=max_batch, max_len=max_len, dtype=cache_dtype or self.platform.cache_dtype,
                          align=self.platform.cache_align,
                          slack=self.spec_cfg.k if self.spec_cfg else 0)
    self.max_len = max_len
    self.chunk, self.ring, self.prefix_note = prompt_chunk(cfg, self.spec, prefill_chunk or self.platform.prefill_chunk,
                                                           enable_prefix_caching)
    self.prompt_buckets = prompt_buckets(self.chunk)
    self.data_parallel = 1 if shardings is None else jax.tree.leaves(shardings["state"])[0].mesh.shape.get("data", 1)
    # Slots split over a data axis: a prefix of rows would sit on a few devices, so steps cover all.
    self.row_buckets = powers_of_two(max_batch) if self.data_parallel == 1 else (max_batch,)
    self.prefill_token_budget = prefill_token_budget or self.chunk
    self.state = _committed(place_state(cfg, self.spec, None if shardings is None else shardings["state"]))
    self.store_spec, self.store, self.index = None, None, None
    if self.prefix_note is None:
      if prefix_cache_tokens is None:
        free = _free_device_bytes() if shardings is None else None
        prefix_cache_tokens = prefix.default_tokens(cfg, self.spec.dtype, self.spec.total_bytes(cfg), free)
      store_spec = prefix.spec_for(cfg, self.spec.dtype, prefix_cache_tokens)
      if store_spec.usable < 1:
        self.prefix_note = (f"off: prefix_cache_tokens={prefix_cache_tokens} buys no block (a block is {BLOCK} "
                            "tokens, and one more is scratch)")
      else:
        self.store_spec, self.index = store_spec, prefix.PrefixIndex(store_spec.usable)
        if shardings is not None:
          mesh = jax.tree.leaves(shardings["state"])[0].mesh
          shardings = dict(shardings, store=store_shardings(cfg, store_spec, mesh))
        self.store = _committed(place_store(cfg, store_spec, None if shardings is None else shardings["store"]))
    self._restore_blocks = -(-max_len // BLOCK)
    self._save_blocks = max(self.chunk // BLOCK, 1)
    self.programs = Programs(self.graphdef, cfg, self.spec, self.platform, shardings)
    self.drafter = self._drafter(draft_model, draft_platform, shardings)
    self.slots: list[_Seq | None] = [None] * max_batch
    self.waiting: collections.deque[_Request] = collections.deque()
    self.requests: dict[str, _Request] = {}
    self._pending: collections.deque = collections.deque()
    self._ids = itertools.count()
    self._host_rng = random.Random(seed)
    self._last_ready = time.perf_counter()
    self.stats = collections.Counter()  # prefill_tokens, decode_tokens, *_s, compile_s, steps, moves
    self.decode_buckets = collections.Counter()  # rows of each decode step run: how many steps
    self._decode_built: set[int] = set()  # row buckets whose decode (or verify) program has run
    self._aborted: list[_Request] = []  # aborted since the last step, reported by the next
    self._ahead: threading.Thread | None = None  # `build_decode_ahead`'s build, until it is waited for

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
    if self._ahead is not None or jax.process_count() > 1:  # processes build in step, in order
      return
    rows = self.row_buckets[0]
    lowered = self.programs.decode.lower(self.params, self.state, np.zeros(rows, np.bool_), np.bool_(False))

    def build():
      try:
        lowered.compile()
      except Exception as e:  # built (and the error raised) on first use instead
        log.warning("building the decode program ahead failed (%s: %s)", type(e).__name__, e)

    self._ahead = threading.Thread(target=build, name="jaxgen-decode-ahead")
    self._ahead.start()

  def _await_ahead(self, *, unless_compiling: bool = False) -> None:
    """Waits for `build_decode_ahead`'s build. unless_compiling: returns at once if the build
    missed the persistent cache (or there is none), leaving it for a later call to wait for."""
    ahead = self._ahead
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
    self._ahead = None
    return_freed_heap()  # what the load freed, before the weights are touched

  @property
  def num_programs(self) -> int:
    """Programs `warmup()` compiles (see `program_count`)."""
    return program_count(len(self.slots), self.chunk, self.data_parallel, self.index is not None,
                         self.spec_cfg is not None) + (self.drafter.num_programs if self.drafter else 0)

  def _drafter(self, model, platform: Platform | None, shardings) -> draft.Drafter | None:
    method = None if self.spec_cfg is None else self.spec_cfg.method
    if method != "draft_model":
      if model is not None:
        raise ValueError(f"draft_model is given but speculative_config method={method!r} does not use one")
      return None
    if model is None:
      raise ValueError("speculative_config method='draft_model' needs the draft model (Engine(draft_model=...); "
                       "LLM loads it from the config)")
    if model.cfg.vocab_size != self.cfg.vocab_size:
      raise ValueError(f"draft_model has vocab_size={model.cfg.vocab_size}; the target's is {self.cfg.vocab_size} "
                       "(a draft must share the target's vocabulary)")
    if platform is None:
      same = model.cfg.weight_quant == self.cfg.weight_quant and model.dtype == self.graphdef_dtype
      platform = self.platform if same else resolve(str(model.dtype), cache_dtype=self.spec.dtype,
                                                    prefill_chunk=self.chunk, quantization=model.cfg.weight_quant)
    # Its own rows, with the target's ring slack and dtype; on a mesh, laid out by the same rules.
    mesh = None if shardings is None else jax.tree.leaves(shardings["state"])[0].mesh
    return draft.Drafter(model, self.spec, platform, self.spec_cfg.k, self.prompt_buckets, self.row_buckets, mesh)

  # ----------------------------------------------------------------------------------- requests
  def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                  request_id: str | None = None) -> str:
    """Validates and queues one request; raises ValueError (nothing queued) on bad input."""
    params = params or SamplingParams()
    text, ids = self.check_request(prompt, params)
    rid = str(request_id if request_id is not None else next(self._ids))
    if rid in self.requests:
      raise ValueError(f"request_id={rid!r} is already in use")
    self._queue(rid, text, ids, params)
    return rid

  def check_request(self, prompt: str | Sequence[int], params: SamplingParams) -> tuple[str | None, list[int]]:
    """The checks of `add_request`, changing nothing (a server runs them on its own thread):
    (text or None, prompt token ids); ValueError naming what is wrong."""
    params.validate(self.cfg.vocab_size)
    if isinstance(prompt, str):
      text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, (Sequence, np.ndarray)):
      text, ids = None, token_ids(prompt, self.cfg.vocab_size)
    else:
      raise ValueError(f"prompt is a {type(prompt).__name__}: give a string or a list of token ids")
    if not ids:
      raise ValueError("prompt is empty: it must have at least one token")
    if len(ids) >= self.max_len:
      raise ValueError(f"prompt has {len(ids)} tokens; the context limit is max_len={self.max_len} "
                       "(the prompt must leave room for at least one generated token)")
    if params.n > len(self.slots):
      raise ValueError(f"SamplingParams.n={params.n} exceeds the engine's max_batch={len(self.slots)} slots")
    return text, ids

  def _queue(self, rid: str, text: str | None, ids: list[int], params: SamplingParams) -> None:
    room = self.max_len - len(ids)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.tokenizer.stop_ids)
    req = _Request(rid, text, ids, params, max_tokens, stop_ids, RequestMetrics(time.perf_counter(), len(ids)))
    base_seed = params.seed if params.seed is not None else self._host_rng.getrandbits(64)
    for i in range(params.n):
      seed = (base_seed + i * _SAMPLE_SEED_STRIDE) % 2**64
      out = CompletionOutput(i, logprobs=[] if params.logprobs is not None else None,
                             cumulative_logprob=0.0 if params.logprobs is not None else None)
      req.seqs.append(_Seq(req, i, seed, out, IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)))
    self.requests[rid] = req
    self.waiting.append(req)

  def abort(self, request_id: str) -> None:
    """Ends a request (finish_reason "abort", with what it produced); unknown or finished ids are ignored."""
    req = self.requests.get(str(request_id))
    if req is None or req.finished:
      return
    for s in req.seqs:
      if not s.done:
        self._finish(s, "abort", None)
    if req in self.waiting:
      self.waiting.remove(req)
    self._aborted.append(req)

  def reset_prefix_cache(self) -> bool:
    """Forgets every cached prefix (as vLLM's); False when prefix caching is off."""
    if self.index is None:
      return False
    self.index = prefix.PrefixIndex(self.store_spec.usable)
    return True

  def has_unfinished(self) -> bool:
    return bool(self.waiting) or any(s is not None for s in self.slots) or bool(self._pending) or bool(self._aborted)

  # ------------------------------------------------------------------------------------ the loop
  def step(self) -> list[RequestOutput]:
    """Dispatches this step's programs, then reads back the previous step's results."""
    updated: dict[str, _Request] = {}
    if self.spec_cfg is not None:  # proposals are made from the latest tokens: read them first
      while self._pending:
        for req in self._process(self._pending.popleft()):
          updated[req.id] = req
    n_before = len(self._pending)
    self._admit()
    self._compact()
    running = [s for s in self.slots if s is not None and s.running]
    rows = bucket(max(s.slot for s in running) + 1, self.row_buckets) if running else 0
    # This step's prefills hold first tokens. A decode program never run before would hold them
    # back by its build (its trace and compile, or its load from the cache): they go out first.
    # (Speculative steps keep their order: their proposals are made from the tokens read back.)
    first_build = (self.spec_cfg is None and bool(running) and rows not in self._decode_built
                   and len(self._pending) > n_before)
    if running and not first_build:
      active = np.zeros(rows, np.bool_)
      for s in running:
        active[s.slot] = True
      want = np.bool_(any(s.req.params.logprobs is not None for s in running))
      t0 = time.perf_counter()
      if self._ahead is not None:
        self._await_ahead()
      waited = time.perf_counter() - t0  # a build ahead still compiling: compile time to the metrics
      c0 = compiles.seconds()  # a draft's work counts as decode time
      proposals = self._proposals(running, rows) if self.spec_cfg is not None else None
      if proposals is None:
        self.state, out = self.programs.decode(self.params, self.state, active, want)
        extra = 0
      else:
        self.state, out, accepted = self.programs.verify(self.params, self.state, active, *proposals, want)
        extra = (accepted, proposals[1])
      self.decode_buckets[rows] += 1
      self._decode_built.add(rows)
      self._pending.append(("decode", out, [(s.slot, s) for s in running], t0, waited + compiles.seconds() - c0,
                            extra))
    updated.update({r.id: r for r in self._aborted})
    self._aborted = []
    # Read back everything dispatched before this step; keep this step's in flight. When nothing
    # new was dispatched, drain so the loop always makes progress; before a decode build, drain so
    # the first tokens go out.
    keep = len(self._pending) - n_before if len(self._pending) > n_before and not first_build else 0
    while len(self._pending) > keep:
      for req in self._process(self._pending.popleft()):
        updated[req.id] = req
    outs = []
    for req in updated.values():
      outs.append(req.output())
      if req.finished:
        self.requests.pop(req.id, None)
    return outs

  def _admit(self) -> None:
    budget = self.prefill_token_budget
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
        for seq, slot in zip(req.seqs, free):
          seq.slot = slot
          self.slots[slot] = seq
        self._restore(req)
      budget -= self._prefill_chunk(req)

  def _compact(self) -> None:
    """Moves the highest occupied rows into the holes below them (see the module docstring)."""
    if len(self.row_buckets) == 1:
      return
    occupied = [i for i, s in enumerate(self.slots) if s is not None]
    holes = [i for i in range(len(occupied)) if self.slots[i] is None]
    for dst, src in zip(holes, reversed(occupied)):
      if src < dst:
        break
      seq = self.slots[src]
      self.state = self.programs.move(self.state, np.int32(src), np.int32(dst))
      if self.drafter is not None:
        self.drafter.move(src, dst)
      self.slots[dst], self.slots[src], seq.slot = seq, None, dst
      self.stats["moves"] += 1

  def _prefill_chunk(self, req: _Request) -> int:
    seq0 = req.seqs[0]
    start = req.prefilled
    n = min(self.chunk, len(req.prompt_ids) - start)
    tokens = np.zeros((1, bucket(n, self.prompt_buckets)), np.int32)
    tokens[0, :n] = req.prompt_ids[start:start + n]
    row = self._row_params(req, seq0)
    want = np.bool_(req.params.logprobs is not None)
    args = (self.params, self.state, tokens, np.array([n], np.int32), np.array([seq0.slot], np.int32), row, want)
    t0 = time.perf_counter()
    if self._ahead is not None:  # the decode program loads: trace this one meanwhile, load it after
      lowered = self.programs.lower_prefill(*args, fresh=start == 0)
      self._await_ahead(unless_compiling=True)
      lowered.compile()
    waited = time.perf_counter() - t0  # building programs: compile time to the metrics
    c0 = compiles.seconds()
    self.state, out = self.programs.prefill(*args, fresh=start == 0)
    req.prefilled += n
    if self.index is not None:
      floor = 0 if self.ring is None else req.prefilled - self.ring
      req.saved = self._save(seq0.slot, req.hashes, req.saved, req.prefilled // BLOCK, floor)
    final = req.prefilled == len(req.prompt_ids)
    if final:
      for seq in req.seqs[1:]:
        self.state = self.programs.fork(self.state, np.int32(seq0.slot), np.int32(seq.slot),
                                        self._row_params(req, seq), np.int32(req.prompt_ids[-1]))
    self._pending.append(("prefill", out, [(0, seq0)] if final else [], t0, waited + compiles.seconds() - c0, n))
    return n

  # ------------------------------------------------------------------------------ prefix caching
  def _restore(self, req: _Request) -> None:
    """Copies the longest cached run of the prompt's blocks into its first row (not its last token)."""
    if self.index is None:
      return
    ids = req.prompt_ids
    req.hashes = prefix.chain(ids, len(ids) // BLOCK)
    hit = self.index.lookup(req.hashes[:(len(ids) - 1) // BLOCK])
    req.cached, req.saved = len(hit) * BLOCK, len(hit)
    self.stats["prefix_query_tokens"] += len(ids)
    self.stats["prefix_queries"] += 1
    if not hit:
      return
    table = np.full(self._restore_blocks, self.store_spec.usable, np.int32)
    table[:len(hit)] = hit
    tokens = np.zeros(self._restore_blocks * BLOCK, np.int32)
    tokens[:req.cached] = ids[:req.cached]
    self.state = self.programs.restore(self.state, self.store, np.int32(req.seqs[0].slot), table,
                                       np.int32(req.cached), tokens)
    req.prefilled = req.cached
    self.stats["prefix_hit_tokens"] += req.cached
    self.stats["prefix_hits"] += 1

  def _save(self, slot: int, hashes: list[bytes], lo: int, hi: int, floor: int) -> int:
    """Saves blocks lo..hi-1 of the chain `hashes` from cache row `slot` (none starting before
    position `floor`, which the rings no longer hold). Blocks 0..lo-1 must be in the store (else the
    new ones could never be reached). Returns how many leading blocks are now in the store."""
    if any(h not in self.index for h in hashes[:lo]):
      return lo
    keep = set(hashes[:hi])
    self.index.touch(hashes[:lo])
    scratch = self.store_spec.usable
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
        self.stats["prefix_saved_blocks"] += 1
      done = i + 1
    self.index.touch(hashes[:done])
    m = self._save_blocks
    for g in range(0, len(ids), m):
      part = ids[g:g + m]
      if all(b == scratch for b in part):
        continue
      table = np.full(m, scratch, np.int32)
      table[:len(part)] = part
      self.store = self.programs.save(self.state, self.store, np.int32(slot), np.int32((lo + g) * BLOCK), table)
    return done

  def _save_generated(self, seq: _Seq) -> None:
    """Saves the blocks a finished sample completed beyond its prompt, as far as the rings hold them."""
    req = seq.req
    ids = req.prompt_ids + seq.out.token_ids
    # The row surely holds all but the last token; it may hold up to two more (the steps that were
    # in flight when the finish was read), which a ring writes over its oldest entries.
    written = len(ids) - 1
    floor = 0 if self.ring is None else written + 2 + self.spec.slack - self.ring
    hashes = prefix.chain(ids, written // BLOCK)
    self._save(seq.slot, hashes, req.saved, len(hashes), floor)

  # -------------------------------------------------------------------------- speculative decoding
  def _proposals(self, running: list[_Seq], rows: int):
    """(proposals [rows, k], counts [rows]) for this step, or None when no row proposes."""
    cfg = self.spec_cfg
    props, counts = np.zeros((rows, cfg.k), np.int32), np.zeros(rows, np.int32)
    asks = []
    for s in running:
      p, out = s.req.params, s.out.token_ids
      if (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or len(out) < p.min_tokens
          or not s.spec.wants()):
        continue  # draws after the first would not see the tokens before them in the penalties
      held = len(s.req.prompt_ids) + len(out) - 1  # the last sampled token is fed by this step
      room = min(cfg.k, self.max_len - held - 1, s.req.max_tokens - len(out) - 1)
      if room < 1:
        continue
      history = np.asarray(s.req.prompt_ids + out, np.int32)
      if self.drafter is None:
        got = speculative.ngram_proposal(history, room, cfg.prompt_lookup_max, cfg.prompt_lookup_min)
        props[s.slot, :len(got)], counts[s.slot] = got, len(got)
      elif held >= 1 and held + cfg.k <= self.max_len:  # the draft writes k positions from held - 1
        asks.append((s, history, held, room))
    if asks:
      self._draft_proposals(asks, props, counts)
    return (props, counts) if counts.any() else None

  def _draft_proposals(self, asks, props, counts) -> None:
    """The draft's proposals for rows `asks` [(seq, history, held, room)], into props and counts."""
    rows = len(counts)
    active, window, start = np.zeros(rows, np.bool_), np.zeros((rows, 2), np.int32), np.zeros(rows, np.int32)
    for s, history, held, _ in asks:
      s.spec.draft_held = self.drafter.catch_up(s.slot, history, s.spec.draft_held, held - 1)
      active[s.slot], window[s.slot], start[s.slot] = True, history[held - 1:held + 1], held - 1
      s.spec.draft_base = held
    got = self.drafter.propose(active, window, start)
    for s, _, _, room in asks:
      props[s.slot, :room], counts[s.slot] = got[s.slot, :room], room

  def _row_params(self, req: _Request, seq: _Seq):
    return row_params(req.params, prompt_len=len(req.prompt_ids), stop_ids=req.stop_ids, seed=seq.seed)

  # ---------------------------------------------------------------------------- reading results
  def _process(self, entry) -> Iterable[_Request]:
    kind, out, rows, t_dispatch, compile_s, extra = entry
    tokens = np.asarray(out.tokens)  # blocks until this program finished
    now = time.perf_counter()
    busy = max(0.0, now - max(self._last_ready, t_dispatch) - compile_s)
    self._last_ready = now
    self.stats["compile_s"] += compile_s
    self.stats[f"{kind}_s"] += busy
    want_lp = any(s.req.params.logprobs is not None for _, s in rows)
    if want_lp:
      lp, top_ids, top_lp = np.asarray(out.logprob), np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    if kind == "prefill":
      self.stats["prefill_tokens"] += extra
      self.stats["prefill_calls"] += 1
    else:
      self.stats["decode_steps"] += 1
    verified = kind == "decode" and extra != 0  # a verify step: k + 1 drawn positions per row
    if verified:
      accepted, counts = np.asarray(extra[0]), extra[1]
      width = len(tokens) // len(accepted)
      self.stats["spec_steps"] += 1
    touched = []
    for row, seq in rows:
      if seq.done:
        continue
      req = seq.req
      if kind == "prefill":
        req.metrics.prefill_s += busy
        req.metrics.compile_s += compile_s
      emitted = [row]
      if verified:
        a, proposed = int(accepted[row]), int(counts[row])
        emitted = [row * width + j for j in range(a + 1)]
        seq.spec.record(proposed, a)
        if seq.spec.draft_base is not None:  # the draft holds the accepted run (at most k - 1 of it)
          base, seq.spec.draft_base = seq.spec.draft_base, None
          seq.spec.draft_held = min(base + a + 1, base + self.spec_cfg.k)
        req.metrics.spec_draft_tokens += proposed
        req.metrics.spec_accepted_tokens += a
        self.stats["spec_draft_tokens"] += proposed
        self.stats["spec_accepted_tokens"] += a
        self.stats["spec_proposing_rows"] += proposed > 0
      for i in emitted:
        if seq.done:
          break  # a stop inside an accepted run: the rest is dropped
        if kind != "prefill":
          self.stats["decode_tokens"] += 1
        logprobs = None
        if seq.out.logprobs is not None:
          n = req.params.logprobs
          logprobs = {int(top_ids[i, j]): Logprob(int(top_ids[i, j]), float(top_lp[i, j]), j + 1) for j in range(n)}
          tok = int(tokens[i])
          if tok not in logprobs:
            logprobs[tok] = Logprob(tok, float(lp[i]), None)
          seq.out.cumulative_logprob += float(lp[i])
        self._on_token(seq, int(tokens[i]), logprobs, now)
      touched.append(req)
    return touched

  def _on_token(self, seq: _Seq, token: int, logprobs, now: float) -> None:
    req, out, p = seq.req, seq.out, seq.req.params
    m = req.metrics
    if m.first_token_time is None:
      m.first_token_time = now
    m.last_token_time = now
    m.token_times.append(now)
    m.generated_tokens += 1
    out.token_ids.append(token)
    if logprobs is not None:
      out.logprobs.append(logprobs)
    n = len(out.token_ids)
    may_stop = n > p.min_tokens
    if token in req.stop_ids and may_stop:
      seq.full_text += seq.detok.flush()
      out.text = seq.full_text
      return self._finish(seq, "stop", token)
    delta = seq.detok.add(token)
    seq.full_text += delta
    if p.stop and may_stop and delta:
      hit = find_stop(seq.full_text, p.stop, len(delta))
      if hit is not None:
        i, s = hit
        out.text = seq.full_text[:i + len(s)] if p.include_stop_str_in_output else seq.full_text[:i]
        return self._finish(seq, "stop", s)
    if n >= req.max_tokens:
      seq.full_text += seq.detok.flush()
      out.text = seq.full_text
      return self._finish(seq, "length", None)
    out.text = seq.full_text[:len(seq.full_text) - holdback(seq.full_text, p.stop)]

  def _finish(self, seq: _Seq, reason: str, stop_reason) -> None:
    seq.out.finish_reason, seq.out.stop_reason = reason, stop_reason
    if self.index is not None and reason != "abort" and seq.running:
      self._save_generated(seq)
    if seq.slot is not None:
      self.slots[seq.slot] = None
      seq.slot = None
    m = seq.req.metrics
    if seq.req.finished:
      m.finished_time = time.perf_counter()

  # ------------------------------------------------------------------------------------- extras
  def warmup(self) -> float:
    """Compiles every program serving can need; returns the seconds it took.

    That is `num_programs` programs: prefill fresh and continued for each of the prompt buckets
    (powers of two from 16 to the largest chunk), decode for each row bucket (powers of two up to
    max_batch), fork, move, the uncached forward of `LLM.logits`' smallest bucket (its larger
    buckets compile on first use), and with prefix caching its save and restore. The count grows
    with log2 of max_batch and of the chunk, never with max_batch itself. They run on slot 0 with a
    throwaway request state.
    """
    t0 = time.perf_counter()
    self._await_ahead()
    dummy = _Request("warmup", None, [0], SamplingParams(max_tokens=1), 1, frozenset(), RequestMetrics(t0, 1))
    row = self._row_params(dummy, _Seq(dummy, 0, 0, CompletionOutput(0), None))
    for fresh in (True, False):
      for b in self.prompt_buckets:
        self.state, _ = self.programs.prefill(self.params, self.state, np.zeros((1, b), np.int32),
                                              np.array([1], np.int32), np.array([0], np.int32), row,
                                              np.bool_(False), fresh=fresh)
    for rows in self.row_buckets:
      self.state, _ = self.programs.decode(self.params, self.state, np.zeros(rows, np.bool_), np.bool_(False))
    self._decode_built.update(self.row_buckets)
    self.state = self.programs.fork(self.state, np.int32(0), np.int32(len(self.slots) - 1), row, np.int32(0))
    self.state = self.programs.move(self.state, np.int32(len(self.slots) - 1), np.int32(0))
    self.programs.logits(self.params, np.zeros((1, MIN_PROMPT_BUCKET), np.int32))
    if self.spec_cfg is not None:
      for rows in self.row_buckets:
        self.state, *_ = self.programs.verify(self.params, self.state, np.zeros(rows, np.bool_),
                                              np.zeros((rows, self.spec_cfg.k), np.int32), np.zeros(rows, np.int32),
                                              np.bool_(False))
    if self.drafter is not None:
      self.drafter.warmup()
    if self.index is not None:
      scratch = self.store_spec.usable
      self.store = self.programs.save(self.state, self.store, np.int32(0), np.int32(0),
                                      np.full(self._save_blocks, scratch, np.int32))
      self.state = self.programs.restore(self.state, self.store, np.int32(0), np.full(self._restore_blocks, scratch,
                                         np.int32), np.int32(0), np.zeros(self._restore_blocks * BLOCK, np.int32))
    jax.block_until_ready(self.state)
    self._last_ready = time.perf_counter()
    return time.perf_counter() - t0

  def metrics(self) -> dict:
    """A plain snapshot of the engine: occupancy, cache use, per-phase throughput."""
    occupied = [s for s in self.slots if s is not None]
    running = [s for s in occupied if s.running]
    used = sum(len(s.req.prompt_ids) + len(s.out.token_ids) for s in occupied)
    st = self.stats
    return dict(
        running=len(running), prefilling=len(occupied) - len(running), waiting=len(self.waiting),
        slots=len(self.slots), slot_occupancy=len(occupied) / len(self.slots),
        kv_cache_bytes_allocated=self.spec.total_bytes(self.cfg),
        kv_cache_bytes_in_use=int(min(used, len(occupied) * self.max_len) * self.spec.bytes_per_token(self.cfg)),
        kv_cache_bytes_per_slot=self.spec.bytes_per_slot(self.cfg),
        prefill_tokens=st["prefill_tokens"], decode_tokens=st["decode_tokens"],
        prefill_s=st["prefill_s"], decode_s=st["decode_s"], compile_s=st["compile_s"],
        prefill_tok_s=st["prefill_tokens"] / st["prefill_s"] if st["prefill_s"] else None,
        decode_tok_s=st["decode_tokens"] / st["decode_s"] if st["decode_s"] else None,
        decode_steps=st["decode_steps"], row_moves=st["moves"], decode_rows=dict(sorted(self.decode_buckets.items())),
        **self._prefix_metrics(), **self._spec_metrics())

  def _spec_metrics(self) -> dict:
    """Speculation: proposals made and accepted; the mean accepted length counts the token every
    verify row emits after its accepted proposals (vLLM's mean acceptance length)."""
    st = self.stats
    rows = st["spec_proposing_rows"]
    return dict(
        speculative=None if self.spec_cfg is None else f"{self.spec_cfg.method}:{self.spec_cfg.k}",
        spec_verify_steps=st["spec_steps"], spec_draft_tokens=st["spec_draft_tokens"],
        spec_accepted_tokens=st["spec_accepted_tokens"],
        spec_acceptance_rate=st["spec_accepted_tokens"] / st["spec_draft_tokens"] if st["spec_draft_tokens"] else None,
        spec_mean_accepted_length=1 + st["spec_accepted_tokens"] / rows if rows else None)

  def _prefix_metrics(self) -> dict:
    """vLLM's prefix-cache figures: hit rate = prompt tokens reused / prompt tokens looked up."""
    st, on = self.stats, self.index is not None
    queried = st["prefix_query_tokens"]
    return dict(
        prefix_cache=on, prefix_cache_note=self.prefix_note,
        prefix_cache_blocks=self.store_spec.usable if on else 0, prefix_cache_block_size=BLOCK,
        prefix_cache_blocks_used=len(self.index) if on else 0,
        prefix_cache_bytes=self.store_spec.total_bytes(self.cfg) if on else 0,
        prefix_cache_queries=st["prefix_queries"], prefix_cache_hits=st["prefix_hits"],
        prefix_cache_query_tokens=queried, prefix_cache_hit_tokens=st["prefix_hit_tokens"],
        prefix_cache_hit_rate=st["prefix_hit_tokens"] / queried if queried else None,
        prefix_cache_saved_blocks=st["prefix_saved_blocks"],
        prefix_cache_evictions=self.index.evictions if on else 0)


def _committed(tree):
  """`tree` committed to the devices it is on (no copy). Programs whose inputs are all committed
  return committed outputs; inputs that start uncommitted would make each program compile twice."""
  return jax.device_put(tree, jax.tree.map(lambda x: x.sharding, tree))


def _free_device_bytes() -> int | None:
  """Bytes the first local device has free (None where it does not say, or in a multi-process
  run, whose processes must all decide alike)."""
  if jax.process_count() > 1:
    return None
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" not in stats:
    return None
  return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
