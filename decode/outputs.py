"""What a request returns: `RequestOutput` with one `CompletionOutput` per sample, and metrics.

Prefill and decode are kept apart in every figure: time to first token, prefill seconds, decode
seconds, time per output token and inter-token latencies. Compile time is never inside them.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import html
import itertools
from typing import Any


class Prefix(collections.abc.Sequence):
  """The first `n` items of a list that only ever grows: a snapshot that costs nothing to take.

  The engine hands out outputs of running requests this way, so a server streaming a long answer
  never copies what it already holds. It compares equal to a list or tuple with the same items;
  slicing returns a list.
  """

  __slots__ = ("_items", "_n")

  def __init__(self, items: list, n: int | None = None):
    self._items, self._n = items, len(items) if n is None else n

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, i):
    if isinstance(i, slice):
      return self._items[slice(*i.indices(self._n))]
    j = i + self._n if i < 0 else i
    if not 0 <= j < self._n:
      raise IndexError(f"index {i} is out of range for {self._n} items")
    return self._items[j]

  def __iter__(self):
    return itertools.islice(self._items, self._n)

  def __eq__(self, other) -> bool:
    if not isinstance(other, (list, tuple, Prefix)):
      return NotImplemented
    return len(other) == self._n and all(a == b for a, b in zip(self, other))

  __hash__ = None

  def __repr__(self) -> str:
    return repr(self[:])


@dataclasses.dataclass
class RequestMetrics:
  """Times are `time.perf_counter()` seconds; derived figures are properties."""

  arrival_time: float
  prompt_tokens: int = 0
  generated_tokens: int = 0
  scheduled_time: float | None = None  # left the queue (prefill dispatched)
  first_token_time: float | None = None
  last_token_time: float | None = None
  finished_time: float | None = None
  prefill_s: float = 0.0  # prefill device time attributed to this request (excl. compile)
  compile_s: float = 0.0  # compilation that happened while this request was prefilling
  spec_draft_tokens: int = 0  # speculative proposals made for this request
  spec_accepted_tokens: int = 0  # ... and accepted
  token_times: list[float] = dataclasses.field(default_factory=list)

  @property
  def queue_s(self) -> float | None:
    return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

  @property
  def ttft_s(self) -> float | None:
    """Time to first token, from arrival, compile time excluded."""
    if self.first_token_time is None:
      return None
    return self.first_token_time - self.arrival_time - self.compile_s

  @property
  def decode_s(self) -> float:
    if self.first_token_time is None or self.last_token_time is None:
      return 0.0
    return self.last_token_time - self.first_token_time

  @property
  def tpot_s(self) -> float | None:
    """Time per output token after the first (the decode phase's pace)."""
    if self.generated_tokens < 2:
      return None
    return self.decode_s / (self.generated_tokens - 1)

  @property
  def inter_token_latencies(self) -> list[float]:
    t = self.token_times
    return [b - a for a, b in zip(t, t[1:])]

  def as_dict(self) -> dict[str, Any]:
    return dict(prompt_tokens=self.prompt_tokens, generated_tokens=self.generated_tokens,
                queue_s=self.queue_s, ttft_s=self.ttft_s, prefill_s=self.prefill_s,
                decode_s=self.decode_s, tpot_s=self.tpot_s, compile_s=self.compile_s,
                spec_draft_tokens=self.spec_draft_tokens, spec_accepted_tokens=self.spec_accepted_tokens,
                inter_token_latencies=self.inter_token_latencies)


@dataclasses.dataclass
class Logprob:
  token_id: int
  logprob: float
  rank: int | None = None
  decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
  index: int
  text: str = ""
  token_ids: list[int] = dataclasses.field(default_factory=list)
  cumulative_logprob: float | None = None
  logprobs: list[dict[int, Logprob]] | None = None  # per token: {id: Logprob} (top-N + chosen)
  finish_reason: str | None = None  # "stop", "length" or "abort"
  stop_reason: int | str | None = None  # the stop string or token id that ended it

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  outputs: list[CompletionOutput]
  metrics: RequestMetrics
  finished: bool = False
  num_cached_tokens: int | None = None  # prompt tokens reused from the prefix cache (None: caching off)

  # Shortcuts to the first sample, for the common n=1 case.
  @property
  def text(self) -> str:
    return self.outputs[0].text

  @property
  def token_ids(self) -> list[int]:
    return self.outputs[0].token_ids

  @property
  def finish_reason(self) -> str | None:
    return self.outputs[0].finish_reason

  def summary(self) -> str:
    """One line: finish reason, tokens, and the two phases apart (TTFT, then time per token)."""
    m = self.metrics
    ttft = "-" if m.ttft_s is None else f"{m.ttft_s * 1e3:.0f} ms"
    tpot = "-" if m.tpot_s is None else f"{m.tpot_s * 1e3:.1f} ms/token"
    cached = "" if not self.num_cached_tokens else f" ({self.num_cached_tokens} from the prefix cache)"
    reasons = ",".join(str(c.finish_reason) for c in self.outputs)
    return (f"{len(self.prompt_token_ids)} prompt tokens{cached} -> {sum(len(c.token_ids) for c in self.outputs)} "
            f"generated, finish_reason={reasons} | prefill: TTFT {ttft} | decode: {tpot}")

  def __repr__(self) -> str:
    text = self.outputs[0].text if self.outputs else ""
    short = text if len(text) <= 60 else text[:57] + "..."
    return f"RequestOutput(request_id={self.request_id!r}, text={short!r}, {self.summary()})"

  def _repr_html_(self) -> str:
    """A notebook's view: each sample's text and finish reason, then the phase figures."""
    rows = "".join(f"<tr><td>{c.index}</td><td style='text-align:left;white-space:pre-wrap'>{html.escape(c.text)}</td>"
                   f"<td>{c.finish_reason}</td><td>{len(c.token_ids)}</td></tr>" for c in self.outputs)
    return (f"<div><b>RequestOutput</b> {html.escape(self.request_id)}: {html.escape(self.summary())}"
            "<table><tr><th>#</th><th>text</th><th>finish_reason</th><th>tokens</th></tr>"
            f"{rows}</table></div>")
