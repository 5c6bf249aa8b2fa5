"""A request and its samples as the host tracks them: what the scheduler places and the output
processor fills. No JAX here.

A `Request` has one `Sample` per `SamplingParams.n`; a sample holds a cache slot (a row) while it
runs. What a sample generated is kept in append-only lists, so the outputs handed out are views of
their first entries (`outputs.Prefix`): taking one costs the same at token 10 and token 10,000.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxgen.decode.outputs import CompletionOutput, Prefix, RequestMetrics, RequestOutput
from jaxgen.decode.speculative import RowSpec
from jaxgen.decode.text import IncrementalDetokenizer

OUTPUT_KINDS = ("cumulative", "delta", "final_only")  # vLLM's RequestOutputKind


@dataclasses.dataclass(eq=False)
class Sample:
  """One sample of a request; holds a slot while running."""

  req: Request
  index: int
  seed: int
  detok: IncrementalDetokenizer | None
  token_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[dict] | None = None  # per token {id: Logprob}, when the request asks for them
  cumulative_logprob: float | None = None
  text: str = ""  # what the output shows (stop strings cut, a possible stop's start held back)
  full_text: str = ""  # generated text before stop-string truncation
  finish_reason: str | None = None
  stop_reason: int | str | None = None
  slot: int | None = None
  spec: RowSpec = dataclasses.field(default_factory=RowSpec)
  grammar: Any = None  # its structured output's matcher (`decode.structured`), walked with each token
  sent_tokens: int = 0  # delta outputs: tokens and characters already handed out
  sent_chars: int = 0

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  @property
  def running(self) -> bool:
    """Holds a slot whose prompt is fully prefilled (so it decodes)."""
    return self.slot is not None and self.req.prefilled == len(self.req.prompt_ids)

  def completion(self, kind: str) -> CompletionOutput:
    """This sample's output now, which nothing changes later: views of the lists while it runs,
    the lists themselves once it is done (nothing is appended after that)."""
    n = len(self.token_ids)
    if kind == "delta":
      lo, chars = self.sent_tokens, self.sent_chars
      self.sent_tokens, self.sent_chars = n, len(self.text)
      return CompletionOutput(self.index, self.text[chars:], self.token_ids[lo:], self.cumulative_logprob,
                              None if self.logprobs is None else self.logprobs[lo:], self.finish_reason,
                              self.stop_reason)
    if self.done:
      return CompletionOutput(self.index, self.text, self.token_ids, self.cumulative_logprob, self.logprobs,
                              self.finish_reason, self.stop_reason)
    return CompletionOutput(self.index, self.text, Prefix(self.token_ids, n), self.cumulative_logprob,
                            None if self.logprobs is None else Prefix(self.logprobs, n), None, None)


@dataclasses.dataclass(eq=False)
class Request:
  id: str
  prompt: str | None
  prompt_ids: list[int]
  params: object  # SamplingParams (validated before a Request is made)
  max_tokens: int
  stop_ids: frozenset[int]
  metrics: RequestMetrics
  samples: list[Sample] = dataclasses.field(default_factory=list)
  prefilled: int = 0  # prompt tokens already in the cache
  cached: int | None = None  # prompt tokens restored from the prefix store (None: caching off)
  hashes: list[bytes] = dataclasses.field(default_factory=list)  # chained hashes of full prompt blocks
  saved: int = 0  # leading blocks of the prompt known to be in the prefix store

  @property
  def finished(self) -> bool:
    return all(s.done for s in self.samples)

  @property
  def output_kind(self) -> str:
    return getattr(self.params, "output_kind", "cumulative")

  def output(self) -> RequestOutput:
    """A snapshot: later steps change neither it nor anything it holds."""
    kind = self.output_kind
    m = self.metrics
    metrics = m if self.finished else dataclasses.replace(m, token_times=Prefix(m.token_times))
    return RequestOutput(self.id, self.prompt, self.prompt_ids, [s.completion(kind) for s in self.samples], metrics,
                         finished=self.finished, num_cached_tokens=self.cached)
