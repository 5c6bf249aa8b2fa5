"""The output processor: turns the runner's sampled ids into text, stops and logprobs. No JAX.

Per sample it appends the token (and its logprobs), detokenizes incrementally, checks stop ids,
stop strings and the token limit, and finishes the sample with its `finish_reason` ("stop",
"length", "abort"), handing the slot back to the scheduler. A verify step's accepted run is
handed out token by token, so a stop inside it drops the rest. Outputs are built by
`Request.output()`: snapshots that later steps never change.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from jaxgen.decode import structured
from jaxgen.decode.outputs import Logprob, RequestMetrics
from jaxgen.decode.requests import Request, Sample
from jaxgen.decode.text import IncrementalDetokenizer, find_stop, holdback

if TYPE_CHECKING:
  from jaxgen.decode.runner import RunnerOutput
  from jaxgen.decode.scheduler import Scheduler
  from jaxgen.decode.stats import Stats

log = logging.getLogger(__name__)

_SAMPLE_SEED_STRIDE = 0x9E3779B97F4A7C15  # sample i of a request uses seed + i * stride (mod 2**64)


class OutputProcessor:
  def __init__(self, tokenizer, scheduler: Scheduler, stats: Stats, *, max_len: int, vocab_size: int,
               spec_k: int = 0, seed: int | None = None):
    self.tokenizer, self.scheduler, self.stats = tokenizer, scheduler, stats
    self.max_len, self.vocab_size, self.spec_k = max_len, vocab_size, spec_k
    self._host_rng = random.Random(seed)  # seeds of requests without one
    self._grammars: structured.Grammars | None = None

  @property
  def grammars(self) -> structured.Grammars:
    """Structured-output constraints compiled against the current tokenizer (cached)."""
    if self._grammars is None or self._grammars.tokenizer is not self.tokenizer:
      self._grammars = structured.Grammars(self.tokenizer, self.vocab_size)
    return self._grammars

  def request(self, rid: str, text: str | None, ids: list[int], params) -> Request:
    """A new request's host state: its samples, their seeds and detokenizers."""
    room = self.max_len - len(ids)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.tokenizer.stop_ids)
    req = Request(rid, text, ids, params, max_tokens, stop_ids, RequestMetrics(time.perf_counter(), len(ids)))
    base_seed = params.seed if params.seed is not None else self._host_rng.getrandbits(64)
    want = params.logprobs is not None
    constraint = getattr(params, "structured_outputs", None)
    template = None if constraint is None else self.grammars.compile(constraint)
    for i in range(params.n):
      seed = (base_seed + i * _SAMPLE_SEED_STRIDE) % 2**64
      detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
      req.samples.append(Sample(req, i, seed, detok, logprobs=[] if want else None,
                                cumulative_logprob=0.0 if want else None,
                                grammar=None if template is None else structured.start(template)))
    return req

  def process(self, result: RunnerOutput) -> list[Request]:
    """Hands one program's results to their samples; returns the requests touched."""
    st, now = self.stats, time.perf_counter()
    st.compile_s += result.compile_s
    if result.kind == "prefill":
      st.prefill_s += result.busy_s
      st.prefill_tokens += result.prompt_tokens
      st.prefill_calls += 1
    else:
      st.decode_s += result.busy_s
      st.decode_steps += 1
      st.spec_steps += result.accepted is not None
    touched = []
    for row, sample in result.rows:
      if sample.done:
        continue
      req = sample.req
      if result.kind == "prefill":
        req.metrics.prefill_s += result.busy_s
        req.metrics.compile_s += result.compile_s
      emitted = [row]
      if result.accepted is not None:
        emitted = self._accepted(result, row, sample)
      for i in emitted:
        if sample.done:
          break  # a stop inside an accepted run: the rest is dropped
        if result.kind != "prefill":
          st.decode_tokens += 1
        self._on_token(sample, int(result.tokens[i]), self._logprobs(result, i, sample), now)
      touched.append(req)
    return touched

  def _accepted(self, result: RunnerOutput, row: int, sample: Sample) -> list[int]:
    """Positions of a verify row's tokens to hand out (its accepted run and the token after)."""
    a, proposed = int(result.accepted[row]), int(result.counts[row])
    sample.spec.record(proposed, a)
    if sample.spec.draft_base is not None:  # the draft holds the accepted run (at most k - 1 of it)
      base, sample.spec.draft_base = sample.spec.draft_base, None
      sample.spec.draft_held = min(base + a + 1, base + self.spec_k)
    sample.req.metrics.spec_draft_tokens += proposed
    sample.req.metrics.spec_accepted_tokens += a
    self.stats.spec_draft_tokens += proposed
    self.stats.spec_accepted_tokens += a
    self.stats.spec_proposing_rows += proposed > 0
    return [row * result.width + j for j in range(a + 1)]

  def _logprobs(self, result: RunnerOutput, i: int, sample: Sample) -> dict | None:
    if sample.logprobs is None:
      return None
    n, ids, lps = sample.req.params.logprobs, result.top_ids, result.top_logprobs
    out = {int(ids[i, j]): Logprob(int(ids[i, j]), float(lps[i, j]), j + 1) for j in range(n)}
    tok = int(result.tokens[i])
    if tok not in out:
      out[tok] = Logprob(tok, float(result.logprob[i]), None)
    sample.cumulative_logprob += float(result.logprob[i])
    return out

  def _on_token(self, sample: Sample, token: int, logprobs: dict | None, now: float) -> None:
    req, p = sample.req, sample.req.params
    m = req.metrics
    if m.first_token_time is None:
      m.first_token_time = now
    m.last_token_time = now
    m.token_times.append(now)
    m.generated_tokens += 1
    sample.token_ids.append(token)
    if logprobs is not None:
      sample.logprobs.append(logprobs)
    n = len(sample.token_ids)
    may_stop = n > p.min_tokens
    if token in req.stop_ids and may_stop:
      sample.full_text += sample.detok.flush()
      sample.text = sample.full_text
      return self.finish(sample, "stop", token)
    grammar = sample.grammar
    if grammar is not None and not grammar.consume_token(token):
      # Only a row whose mask allowed nothing can draw a token its grammar refuses.
      log.warning("request %s: its grammar refused token %d (%s)", req.id, token, grammar.get_error())
      return self.finish(sample, "abort", None)
    delta = sample.detok.add(token)
    sample.full_text += delta
    if p.stop and may_stop and delta:
      hit = find_stop(sample.full_text, p.stop, len(delta))
      if hit is not None:
        i, s = hit
        sample.text = sample.full_text[:i + len(s)] if p.include_stop_str_in_output else sample.full_text[:i]
        return self.finish(sample, "stop", s)
    if grammar is not None and grammar.is_stopped():  # the structure is complete: nothing may follow
      sample.full_text += sample.detok.flush()
      sample.text = sample.full_text
      return self.finish(sample, "stop", None)
    if n >= req.max_tokens:
      sample.full_text += sample.detok.flush()
      sample.text = sample.full_text
      return self.finish(sample, "length", None)
    held = holdback(sample.full_text, p.stop)
    sample.text = sample.full_text[:len(sample.full_text) - held] if held else sample.full_text

  def finish(self, sample: Sample, reason: str, stop_reason=None) -> None:
    """Ends a sample ("stop", "length" or "abort"); its slot goes back to the scheduler, with
    what it generated saved to the prefix store unless it was aborted."""
    sample.finish_reason, sample.stop_reason = reason, stop_reason
    self.scheduler.release(sample, save=reason != "abort")
    if sample.req.finished:
      sample.req.metrics.finished_time = time.perf_counter()
