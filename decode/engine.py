"""The continuous-batching engine: a fixed set of cache slots, a queue, and a host loop.

Policy of one `step()`:
1. Admission: while slots are free, the oldest waiting request is prefilled into one (a request
   with n samples takes n slots: one prefill, then its rows are forked). A prompt longer than the
   largest bucket is prefilled in chunks of that size, one chunk per step, so running requests
   keep decoding between the chunks of a long prompt; at most `prefill_token_budget` prompt
   tokens are prefilled per step.
2. One decode step for every running row.
3. The results of the *previous* step are read back and turned into text, stop checks and
   outputs while the device works on this one (dispatch before read). A row that finished in
   step k still computes in step k+1; that token is discarded.
Finished rows free their slot at once; the next step can admit into it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import random
import time
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.decode import compiles
from jaxgen.decode.cache import CacheSpec, KVCache
from jaxgen.decode.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxgen.decode.params import SamplingParams
from jaxgen.decode.sampling import MAX_LOGIT_BIAS, MAX_STOP_IDS, RowParams, SamplerState
from jaxgen.decode.steps import DecodeState, Programs, init_state
from jaxgen.decode.text import IncrementalDetokenizer, find_stop, holdback

_SAMPLE_SEED_STRIDE = 0x9E3779B97F4A7C15  # sample i of a request uses seed + i * stride (mod 2**64)


def buckets(largest: int, smallest: int = 16) -> tuple[int, ...]:
  """Powers of two from `smallest` up to `largest` (which is always included)."""
  out, b = [], smallest
  while b < largest:
    out.append(b)
    b *= 2
  return tuple(out) + (largest,)


@dataclasses.dataclass
class _Seq:
  """One sample of a request; holds a slot while running."""

  req: "_Request"
  index: int
  seed: int
  out: CompletionOutput
  detok: IncrementalDetokenizer
  slot: int | None = None
  full_text: str = ""  # generated text before stop-string truncation

  @property
  def done(self) -> bool:
    return self.out.finish_reason is not None


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

  @property
  def finished(self) -> bool:
    return all(s.done for s in self.seqs)

  def output(self) -> RequestOutput:
    return RequestOutput(self.id, self.prompt, self.prompt_ids, [s.out for s in self.seqs], self.metrics,
                         finished=self.finished)


class Engine:
  """Serves many requests at once over `max_batch` cache slots of `max_len` tokens each.

  `add_request(prompt, params) -> id`, `step() -> [RequestOutput updated]`, `abort(id)`,
  `has_unfinished()`. Nothing compiles after `warmup()`.
  """

  def __init__(self, model, tokenizer, *, max_batch: int = 8, max_len: int = 2048, prefill_chunk: int = 512,
               cache_dtype: str = "float32", compute_dtype=None, shardings=None, prefill_token_budget=None):
    from flax import nnx

    cfg = model.cfg
    if max_len > cfg.max_context:
      raise ValueError(f"max_len={max_len} exceeds the model's context length {cfg.max_context}")
    if max_len < 2:
      raise ValueError(f"max_len={max_len} must be >= 2")
    if max_batch < 1:
      raise ValueError(f"max_batch={max_batch} must be >= 1")
    self.cfg, self.tokenizer = cfg, tokenizer
    self.graphdef, self.params = nnx.split(model)
    if compute_dtype is None:
      # XLA:CPU is fastest with float32 activations whatever the weights; accelerators use the
      # weights' own dtype.
      compute_dtype = jnp.float32 if jax.default_backend() == "cpu" else model.embed[...].dtype
    self.spec = CacheSpec(slots=max_batch, max_len=max_len, dtype=cache_dtype)
    self.max_len = max_len
    self.chunk = min(prefill_chunk, max_len)
    self.buckets = buckets(self.chunk, min(16, self.chunk))
    self.prefill_token_budget = prefill_token_budget or self.chunk
    self.programs = Programs(self.graphdef, compute_dtype, shardings)
    self.state = init_state(cfg, self.spec, None if shardings is None else shardings["state"])
    self.slots: list[_Seq | None] = [None] * max_batch
    self.waiting: collections.deque[_Request] = collections.deque()
    self.requests: dict[str, _Request] = {}
    self._pending: collections.deque = collections.deque()
    self._ids = itertools.count()
    self._host_rng = random.Random()
    self._last_ready = time.perf_counter()
    self.stats = collections.Counter()  # prefill_tokens, decode_tokens, *_s, compile_s, steps
    self._fork = self.programs.state_update(_fork, 4)
    self._aborted: list[_Request] = []  # aborted since the last step, reported by the next

  # ----------------------------------------------------------------------------------- requests
  def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                  request_id: str | None = None) -> str:
    """Validates and queues one request; raises ValueError (nothing queued) on bad input."""
    params = params or SamplingParams()
    params.validate(self.cfg.vocab_size)
    if isinstance(prompt, str):
      text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
    else:
      text, ids = None, [int(i) for i in prompt]
      bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
      if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
    if not ids:
      raise ValueError("prompt is empty: it must have at least one token")
    if len(ids) >= self.max_len:
      raise ValueError(f"prompt has {len(ids)} tokens; the context limit is max_len={self.max_len} "
                       "(the prompt must leave room for at least one generated token)")
    if params.n > len(self.slots):
      raise ValueError(f"SamplingParams.n={params.n} exceeds the engine's max_batch={len(self.slots)} slots")
    rid = str(request_id if request_id is not None else next(self._ids))
    if rid in self.requests:
      raise ValueError(f"request_id={rid!r} is already in use")
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
    return rid

  def abort(self, request_id: str) -> None:
    req = self.requests.get(str(request_id))
    if req is None or req.finished:
      return
    for s in req.seqs:
      if not s.done:
        self._finish(s, "abort", None)
    if req in self.waiting:
      self.waiting.remove(req)
    self._aborted.append(req)

  def has_unfinished(self) -> bool:
    return bool(self.waiting) or any(s is not None for s in self.slots) or bool(self._pending)

  # ------------------------------------------------------------------------------------ the loop
  def step(self) -> list[RequestOutput]:
    """Dispatches this step's programs, then reads back the previous step's results."""
    n_before = len(self._pending)
    self._admit()
    running = [(i, s) for i, s in enumerate(self.slots) if s is not None and s.req.prefilled == len(s.req.prompt_ids)]
    if running:
      active = np.zeros(len(self.slots), np.bool_)
      for i, _ in running:
        active[i] = True
      want = np.bool_(any(s.req.params.logprobs is not None for _, s in running))
      c0, t0 = compiles.seconds(), time.perf_counter()
      self.state, out = self.programs.decode(self.params, self.state, active, want)
      rows = [(slot, slot, seq) for slot, seq in running]  # (row of the output, slot, sequence)
      self._pending.append(("decode", out, rows, t0, compiles.seconds() - c0))
    updated: dict[str, _Request] = {r.id: r for r in self._aborted}
    self._aborted = []
    # Read back everything dispatched before this step; keep this step's in flight. When nothing
    # new was dispatched, drain so the loop always makes progress.
    keep = len(self._pending) - n_before if len(self._pending) > n_before else 0
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
      budget -= self._prefill_chunk(req)

  def _prefill_chunk(self, req: _Request) -> int:
    seq0 = req.seqs[0]
    start = req.prefilled
    n = min(self.chunk, len(req.prompt_ids) - start)
    bucket = next(b for b in self.buckets if b >= n)
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :n] = req.prompt_ids[start:start + n]
    row = self._row_params(req, seq0)
    want = np.bool_(req.params.logprobs is not None)
    c0, t0 = compiles.seconds(), time.perf_counter()
    self.state, out = self.programs.prefill(self.params, self.state, tokens, np.array([n], np.int32),
                                            np.array([seq0.slot], np.int32), row, want, fresh=start == 0)
    req.prefilled += n
    final = req.prefilled == len(req.prompt_ids)
    if final and len(req.seqs) > 1:
      rows = [self._row_params(req, s) for s in req.seqs[1:]]
      stacked = jax.tree.map(lambda *xs: np.concatenate(xs), *rows)
      self.state = self._fork(self.state, np.int32(seq0.slot), np.array([s.slot for s in req.seqs[1:]], np.int32),
                              stacked, np.int32(req.prompt_ids[-1]))
    self._pending.append(("prefill", out, [(0, seq0.slot, seq0)] if final else [], t0, compiles.seconds() - c0, n))
    return n

  def _row_params(self, req: _Request, seq: _Seq) -> RowParams:
    p = req.params
    bias_ids = np.full((1, MAX_LOGIT_BIAS), -1, np.int32)
    bias_vals = np.zeros((1, MAX_LOGIT_BIAS), np.float32)
    for j, (k, v) in enumerate(p.logit_bias.items()):
      bias_ids[0, j], bias_vals[0, j] = k, v
    ban = np.full((1, MAX_STOP_IDS), -1, np.int32)
    ban_list = sorted(req.stop_ids)[:MAX_STOP_IDS]
    ban[0, :len(ban_list)] = ban_list
    f32 = lambda x: np.array([x], np.float32)  # noqa: E731
    i32 = lambda x: np.array([x], np.int32)  # noqa: E731
    return RowParams(
        temperature=f32(0.0 if p.greedy else p.temperature), top_k=i32(max(p.top_k, 0)), top_p=f32(p.top_p),
        min_p=f32(p.min_p), repetition_penalty=f32(p.repetition_penalty), presence_penalty=f32(p.presence_penalty),
        frequency_penalty=f32(p.frequency_penalty), bias_ids=bias_ids, bias_values=bias_vals, ban_ids=ban,
        min_tokens=i32(p.min_tokens), prompt_len=i32(len(req.prompt_ids)),
        key=np.array([[seq.seed >> 32, seq.seed & 0xFFFFFFFF]], np.uint32))

  # ---------------------------------------------------------------------------- reading results
  def _process(self, entry) -> Iterable[_Request]:
    kind, out, rows, t_dispatch, compile_s = entry[:5]
    tokens = np.asarray(out.tokens)  # blocks until this program finished
    now = time.perf_counter()
    busy = max(0.0, now - max(self._last_ready, t_dispatch) - compile_s)
    self._last_ready = now
    self.stats["compile_s"] += compile_s
    self.stats[f"{kind}_s"] += busy
    want_lp = any(s.req.params.logprobs is not None for _, _, s in rows)
    if want_lp:
      lp, top_ids, top_lp = np.asarray(out.logprob), np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    if kind == "prefill":
      self.stats["prefill_tokens"] += entry[5]
      self.stats["prefill_calls"] += 1
    else:
      self.stats["decode_steps"] += 1
    touched = []
    for row, slot, seq in rows:
      if seq.done or seq.slot != slot:
        continue
      req = seq.req
      if kind == "prefill":
        req.metrics.prefill_s += busy
        req.metrics.compile_s += compile_s
      else:
        self.stats["decode_tokens"] += 1
      logprobs = None
      if seq.out.logprobs is not None:
        n = req.params.logprobs
        logprobs = {int(top_ids[row, j]): Logprob(int(top_ids[row, j]), float(top_lp[row, j]), j + 1)
                    for j in range(n)}
        tok = int(tokens[row])
        if tok not in logprobs:
          logprobs[tok] = Logprob(tok, float(lp[row]), None)
        seq.out.cumulative_logprob += float(lp[row])
      self._on_token(seq, int(tokens[row]), logprobs, now)
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
    if seq.slot is not None:
      self.slots[seq.slot] = None
      seq.slot = None
    m = seq.req.metrics
    if seq.req.finished:
      m.finished_time = time.perf_counter()

  # ------------------------------------------------------------------------------------- extras
  def warmup(self) -> float:
    """Compiles every program serving can need (each bucket fresh and continued, decode, fork).

    Runs them on slot 0 with a throwaway request state; returns the seconds it took.
    """
    t0 = time.perf_counter()
    dummy = _Request("warmup", None, [0], SamplingParams(max_tokens=1), 1, frozenset(), RequestMetrics(t0, 1))
    seq = _Seq(dummy, 0, 0, CompletionOutput(0), None)
    row = self._row_params(dummy, seq)
    for fresh in (True, False):
      for b in self.buckets:
        for want in (False, True):
          self.state, out = self.programs.prefill(
              self.params, self.state, np.zeros((1, b), np.int32), np.array([1], np.int32),
              np.array([0], np.int32), row, np.bool_(want), fresh=fresh)
    for want in (False, True):
      self.state, out = self.programs.decode(self.params, self.state, np.zeros(len(self.slots), np.bool_), np.bool_(want))
    for k in range(1, len(self.slots)):
      rows = jax.tree.map(lambda *xs: np.concatenate(xs), *([row] * k))
      self.state = self._fork(self.state, np.int32(0), np.arange(1, k + 1, dtype=np.int32), rows, np.int32(0))
    jax.block_until_ready(self.state)
    self._last_ready = time.perf_counter()
    return time.perf_counter() - t0

  def metrics(self) -> dict:
    """A plain snapshot of the engine: occupancy, cache use, per-phase throughput."""
    running = [s for s in self.slots if s is not None]
    used = sum(len(s.req.prompt_ids) + len(s.out.token_ids) for s in running)
    st = self.stats
    return dict(
        running=len(running), waiting=len(self.waiting), slots=len(self.slots),
        slot_occupancy=len(running) / len(self.slots),
        kv_cache_bytes_allocated=self.spec.total_bytes(self.cfg),
        kv_cache_bytes_in_use=int(min(used, len(running) * self.max_len) * self.spec.bytes_per_token(self.cfg)),
        kv_cache_bytes_per_slot=self.spec.bytes_per_slot(self.cfg),
        prefill_tokens=st["prefill_tokens"], decode_tokens=st["decode_tokens"],
        prefill_s=st["prefill_s"], decode_s=st["decode_s"], compile_s=st["compile_s"],
        prefill_tok_s=st["prefill_tokens"] / st["prefill_s"] if st["prefill_s"] else None,
        decode_tok_s=st["decode_tokens"] / st["decode_s"] if st["decode_s"] else None,
        decode_steps=st["decode_steps"])


def _fork(state, src, dsts, row_params, last_token):
  """Copies slot `src`'s cache and prompt state into `dsts` for more samples of one prompt.

  The copies are set one token back (length - 1, next token = the last prompt token), so their
  first decode step recomputes the last prompt position and samples their own first token.
  """
  cache, s = state.cache, state.sampler
  layers = jax.tree.map(lambda a: a.at[dsts].set(a[src][None]), cache.layers)
  lengths = cache.lengths.at[dsts].set(cache.lengths[src] - 1)
  params = jax.tree.map(lambda a, r: a.at[dsts].set(r), s.params, row_params)
  sampler = SamplerState(params, s.tokens.at[dsts].set(last_token),
                         s.seen_prompt.at[dsts].set(s.seen_prompt[src][None]), s.out_counts.at[dsts].set(0))
  return DecodeState(KVCache(layers, lengths), sampler)
