"""Speculative decoding: proposals made on the host, verified on the device in one pass.

Decode reads every weight once per step whatever the number of tokens it scores, so scoring the
next token and k proposed ones together (`steps.verify_step`, T = k + 1) costs about one step,
and every proposal accepted is a step saved. Verification is exact: a row emits what plain
decoding would have emitted, token for token, for greedy and seeded sampling alike.

Method "ngram" (prompt lookup, as vLLM's): the last n tokens of a row (n from prompt_lookup_max
down to prompt_lookup_min) are looked up in its prompt and output so far; the k tokens that
followed their latest earlier occurrence are proposed. It costs nothing on the device, and pays
where the answer repeats its input (code edits, extraction, summaries that quote).

Method "draft_model": a smaller model sharing the target's vocabulary proposes k tokens greedily,
k forward passes in one compiled program over its own cache (`decode.draft`). "model": "self"
drafts with the target's own checkpoint, made cheaper by `quantization` ("int8") and/or
`draft_layers` (its first N layers with the final norm and head), so no second checkpoint is needed.

Proposals that keep failing cost a wider step for nothing, so a row whose proposals were all
rejected `BACKOFF` times in a row stops proposing for a while (doubling each time, up to
`MAX_PAUSE` steps); a step in which no row proposes runs the plain decode program.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

import numpy as np

METHODS = ("ngram", "draft_model")
MAX_K = 16
BACKOFF = 2  # fully rejected proposals in a row before a row pauses
MAX_PAUSE = 64  # steps


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  method: str
  num_speculative_tokens: int
  prompt_lookup_max: int = 4
  prompt_lookup_min: int = 2
  model: str | None = None  # draft_model: a path LLM loads, or "self" (the target's checkpoint)
  quantization: str | None = None  # draft_model: the draft's weights ("int8" or None)
  draft_layers: int | None = None  # draft_model: keep the draft's first N layers only

  @property
  def k(self) -> int:
    return self.num_speculative_tokens


def parse(config: SpecConfig | Mapping[str, Any] | str | None) -> SpecConfig | None:
  """vLLM's `speculative_config` dict, its JSON text, or the CLI's "ngram:K" -> SpecConfig;
  ValueError naming the field for a bad one."""
  if config is None or isinstance(config, SpecConfig):
    return config
  if isinstance(config, str) and config.lstrip().startswith("{"):
    try:
      config = json.loads(config)
    except json.JSONDecodeError as e:
      raise ValueError(f"speculative_config is not valid JSON: {e}") from None
  elif isinstance(config, str):
    method, _, k = config.partition(":")
    try:
      config = {"method": method, "num_speculative_tokens": int(k or 4)}
    except ValueError:
      raise ValueError(f"speculative={config!r}: write METHOD:K, e.g. ngram:4, or a JSON dict") from None
    if method == "draft_model":
      config["model"] = "self"
  if not isinstance(config, Mapping):
    raise ValueError(f"speculative_config is a {type(config).__name__}: give a dict such as "
                     '{"method": "ngram", "num_speculative_tokens": 4}')
  config = dict(config)
  method = config.pop("method", None)
  if method not in METHODS:
    raise ValueError(f"speculative_config method={method!r} is not supported; use one of {list(METHODS)}")
  fields = {f.name for f in dataclasses.fields(SpecConfig)} - {"method"}
  draft_only = {"model", "quantization", "draft_layers"}
  known = fields - draft_only if method == "ngram" else fields - {"prompt_lookup_max", "prompt_lookup_min"}
  unknown = set(config) - known
  if unknown:
    raise ValueError(f"speculative_config has unknown fields {sorted(unknown)} for method {method!r}; "
                     f"known: {sorted(known)}")
  if "num_speculative_tokens" not in config:
    raise ValueError("speculative_config needs num_speculative_tokens (the k proposals per step)")
  if method == "draft_model" and not isinstance(config.get("model"), str):
    raise ValueError(f"speculative_config model={config.get('model')!r}: a draft_model needs the draft's path "
                     'or "self" (the target\'s own checkpoint)')
  cfg = SpecConfig(method, **config)
  for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "draft_layers"):
    value = getattr(cfg, name)
    if name == "draft_layers" and value is None:
      continue
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"speculative_config {name}={value!r} must be an integer >= 1")
  if cfg.k > MAX_K:
    raise ValueError(f"speculative_config num_speculative_tokens={cfg.k} exceeds the limit of {MAX_K}")
  if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
    raise ValueError(f"speculative_config prompt_lookup_min={cfg.prompt_lookup_min} exceeds "
                     f"prompt_lookup_max={cfg.prompt_lookup_max}")
  if cfg.quantization not in (None, "int8"):
    raise ValueError(f"speculative_config quantization={cfg.quantization!r} is not supported; use None or 'int8'")
  return cfg


def ngram_proposal(history: np.ndarray, k: int, n_max: int, n_min: int) -> np.ndarray:
  """The k tokens (or fewer) that followed the latest earlier occurrence of the history's last n
  tokens, for the longest n in [n_min, n_max] that occurs; empty when none does."""
  size = len(history)
  for n in range(min(n_max, size - 1), n_min - 1, -1):
    tail = history[size - n:]
    # Candidate starts: where the tail's first token occurs, leaving room for at least one follower.
    starts = np.flatnonzero(history[:size - n] == tail[0])
    for j in range(1, n):
      if not len(starts):
        break
      starts = starts[history[starts + j] == tail[j]]
    if len(starts):
      at = starts[-1] + n
      return history[at:at + k]
  return history[:0]


@dataclasses.dataclass
class RowSpec:
  """Per-sample speculation state: how often its proposals failed, and how long it pauses."""

  misses: int = 0
  pause: int = 0
  next_pause: int = 4
  draft_tokens: int = 0
  accepted_tokens: int = 0
  draft_held: int = 0  # draft_model: leading positions of the row its draft's cache holds
  draft_base: int | None = None  # draft_model: the row's length when the draft last proposed

  def wants(self) -> bool:
    if self.pause > 0:
      self.pause -= 1
      return False
    return True

  def record(self, proposed: int, accepted: int) -> None:
    self.draft_tokens += proposed
    self.accepted_tokens += accepted
    if proposed == 0:
      return
    if accepted:
      self.misses, self.next_pause = 0, 4
      return
    self.misses += 1
    if self.misses >= BACKOFF:
      self.pause, self.misses = self.next_pause, 0
      self.next_pause = min(2 * self.next_pause, MAX_PAUSE)
