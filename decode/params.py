"""`SamplingParams` (vLLM's names and meanings) and its validation.

Every check names the field, the value given and the limit, so one bad request is rejected with
a message a person can act on and nothing else is disturbed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import numpy as np
from jaxgen.decode.requests import OUTPUT_KINDS
from jaxgen.decode.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_IDS, RowParams
from jaxgen.decode.structured import StructuredOutputsParams

FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclasses.dataclass
class SamplingParams:
  """How to sample one request. Defaults follow vLLM.

  n: samples of the prompt (they share its prefill). temperature 0 is greedy. top_k -1 (or 0 is
  rejected) disables; top_p 1 disables; min_p 0 disables. repetition_penalty (> 1 discourages)
  applies to tokens of the prompt and the output; presence/frequency penalties to the output.
  logit_bias maps token id -> added logit. seed fixes the randomness of this request alone: the
  draw for a token depends only on (seed, token position), never on the batch.
  stop: strings that end generation (not included in the text unless
  include_stop_str_in_output); stop_token_ids: ids that end it (EOS too unless ignore_eos).
  min_tokens: stop ids and EOS are banned until this many tokens were generated.
  logprobs: top-N log-probabilities to return per generated token (plus the chosen one's).
  output_kind (vLLM's RequestOutputKind): what each output of a running request holds:
  "cumulative" everything so far, "delta" only what is new since the last one, "final_only" no
  output until the request finishes.
  structured_outputs: a `StructuredOutputsParams` (or a dict of its fields): the output is held
  to a JSON schema, a regex, a choice or a grammar (`decode.structured`).
  """

  n: int = 1
  max_tokens: int | None = 16
  min_tokens: int = 0
  temperature: float = 1.0
  top_k: int = -1
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[int, float] | None = None
  seed: int | None = None
  stop: str | Sequence[str] | None = None
  stop_token_ids: Sequence[int] | None = None
  ignore_eos: bool = False
  include_stop_str_in_output: bool = False
  skip_special_tokens: bool = True
  logprobs: int | None = None
  output_kind: str = "cumulative"
  structured_outputs: StructuredOutputsParams | None = None

  def __post_init__(self):
    if isinstance(self.structured_outputs, dict):
      try:
        self.structured_outputs = StructuredOutputsParams.from_fields(self.structured_outputs)
      except ValueError as e:
        raise ValueError(f"SamplingParams.{e}") from None
    if isinstance(self.stop, str):
      self.stop = [self.stop]
    self.stop = list(self.stop or [])
    self.stop_token_ids = [_token_id("stop_token_ids", i) for i in (self.stop_token_ids or [])]
    self.logit_bias = {_token_id("logit_bias", k): _number("logit_bias", v) for k, v in (self.logit_bias or {}).items()}
    self.validate()

  def validate(self, vocab_size: int | None = None) -> None:
    def bad(field, value, limit):
      raise ValueError(f"SamplingParams.{field}={value!r} is invalid: {limit}")

    for f in FLOAT_FIELDS:
      value = getattr(self, f)
      if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
          or not math.isfinite(value):
        bad(f, value, "must be a finite number")
    for k, v in self.logit_bias.items():
      if not math.isfinite(v):
        bad("logit_bias", {k: v}, "bias values must be finite numbers")
    if not isinstance(self.n, int) or self.n < 1:
      bad("n", self.n, "must be an integer >= 1")
    if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
      bad("max_tokens", self.max_tokens, "must be an integer >= 1 (or None for the context limit)")
    if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
      bad("min_tokens", self.min_tokens, f"must be in [0, max_tokens={self.max_tokens}]")
    if not self.temperature >= 0:
      bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
    if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
      bad("top_k", self.top_k, "must be -1 (disabled) or an integer >= 1")
    if not 0 < self.top_p <= 1:
      bad("top_p", self.top_p, "must be in (0, 1]")
    if not 0 <= self.min_p <= 1:
      bad("min_p", self.min_p, "must be in [0, 1]")
    if not self.repetition_penalty > 0:
      bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 disables)")
    for f in ("presence_penalty", "frequency_penalty"):
      if not -2 <= getattr(self, f) <= 2:
        bad(f, getattr(self, f), "must be in [-2, 2]")
    if len(self.logit_bias) > MAX_LOGIT_BIAS:
      bad("logit_bias", f"<{len(self.logit_bias)} entries>", f"at most {MAX_LOGIT_BIAS} entries")
    if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
      bad("logprobs", self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")
    if len(self.stop_token_ids) > MAX_STOP_IDS - 2:
      bad("stop_token_ids", self.stop_token_ids, f"at most {MAX_STOP_IDS - 2} ids")
    if any(not s for s in self.stop):
      bad("stop", self.stop, "stop strings must be non-empty")
    if self.output_kind not in OUTPUT_KINDS:
      bad("output_kind", self.output_kind, f"must be one of {', '.join(OUTPUT_KINDS)}")
    if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
      bad("structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams (or a dict of its fields)")
    if self.seed is not None and not 0 <= self.seed < 2**64:
      bad("seed", self.seed, "must be in [0, 2**64)")
    if vocab_size is not None:
      for f, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias))):
        for i in ids:
          if not 0 <= i < vocab_size:
            bad(f, i, f"token ids must be in [0, {vocab_size})")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0 or self.top_k == 1


def _token_id(field: str, value) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"SamplingParams.{field}: {value!r} is not a token id (an integer)")
  return int(value)


def _number(field: str, value) -> float:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise ValueError(f"SamplingParams.{field}: {value!r} is not a number")
  return float(value)


def token_ids(prompt: Iterable, vocab_size: int) -> list[int]:
  """A prompt given as token ids, checked: integers in [0, vocab_size). ValueError naming the element."""
  out = []
  for j, x in enumerate(prompt):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
      raise ValueError(f"token id at index {j} is {x!r} ({type(x).__name__}); token ids must be integers")
    if not 0 <= x < vocab_size:
      raise ValueError(f"token id {int(x)} at index {j} is outside the vocabulary [0, {vocab_size})")
    out.append(int(x))
  return out


def row_params(p: SamplingParams, *, prompt_len: int, stop_ids: Iterable[int], seed: int) -> RowParams:
  """One row of device-side sampling parameters ([1, ...] arrays) for a sample of a request."""
  bias_ids = np.full((1, MAX_LOGIT_BIAS), -1, np.int32)
  bias_vals = np.zeros((1, MAX_LOGIT_BIAS), np.float32)
  for j, (k, v) in enumerate(p.logit_bias.items()):
    bias_ids[0, j], bias_vals[0, j] = k, v
  ban = np.full((1, MAX_STOP_IDS), -1, np.int32)
  ban_list = sorted(stop_ids)[:MAX_STOP_IDS]
  ban[0, :len(ban_list)] = ban_list
  f32 = lambda x: np.array([x], np.float32)  # noqa: E731
  i32 = lambda x: np.array([x], np.int32)  # noqa: E731
  return RowParams(
      temperature=f32(0.0 if p.greedy else p.temperature), top_k=i32(max(p.top_k, 0)), top_p=f32(p.top_p),
      min_p=f32(p.min_p), repetition_penalty=f32(p.repetition_penalty), presence_penalty=f32(p.presence_penalty),
      frequency_penalty=f32(p.frequency_penalty), bias_ids=bias_ids, bias_values=bias_vals, ban_ids=ban,
      min_tokens=i32(p.min_tokens), prompt_len=i32(prompt_len),
      key=np.array([[seed >> 32, seed & 0xFFFFFFFF]], np.uint32))
