"""Speculative decoding: proposals made on the host, verified on the device in one pass.

Decode reads every weight once per step whatever the number of tokens it scores, so scoring the
next token and k proposed ones together (`steps.verify_step`, T = k + 1) costs about one step,
and every proposal accepted is a step saved. Verification is exact: a row emits what plain
decoding would have emitted, token for token, for greedy and seeded sampling alike.

Method "ngram" (prompt lookup, as vLLM's): the last n tokens of a row (n from prompt_lookup_max
down to prompt_lookup_min) are looked up in its prompt and output so far; the k tokens that
followed their latest earlier occurrence are proposed. It costs nothing on the device, and pays
where the answer repeats its input (code edits, extraction, summaries that quote).

Proposals that keep failing cost a wider step for nothing, so a row whose proposals were all
rejected `BACKOFF` times in a row stops proposing for a while (doubling each time, up to
`MAX_PAUSE` steps); a step in which no row proposes runs the plain decode program.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

METHODS = ("ngram",)
BACKOFF = 2  # fully rejected proposals in a row before a row pauses
MAX_PAUSE = 64  # steps


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  method: str
  num_speculative_tokens: int
  prompt_lookup_max: int = 4
  prompt_lookup_min: int = 2

  @property
  def k(self) -> int:
    return self.num_speculative_tokens


def parse(config: Mapping[str, Any] | str | None) -> SpecConfig | None:
  """vLLM's `speculative_config` dict (or the CLI's "ngram:K") -> SpecConfig; ValueError naming
  the field for a bad one."""
  if config is None:
    return None
  if isinstance(config, str):
    method, _, k = config.partition(":")
    try:
      config = {"method": method, "num_speculative_tokens": int(k or 4)}
    except ValueError:
      raise ValueError(f"speculative={config!r}: write METHOD:K, e.g. ngram:4") from None
  config = dict(config)
  method = config.pop("method", None)
  if method not in METHODS:
    hint = " (a draft model is not supported yet)" if method in ("draft_model", "draft") else ""
    raise ValueError(f"speculative_config method={method!r} is not supported{hint}; use one of {list(METHODS)}")
  known = {f.name for f in dataclasses.fields(SpecConfig)} - {"method"}
  unknown = set(config) - known
  if unknown:
    raise ValueError(f"speculative_config has unknown fields {sorted(unknown)}; known: {sorted(known)}")
  if "num_speculative_tokens" not in config:
    raise ValueError("speculative_config needs num_speculative_tokens (the k proposals per step)")
  cfg = SpecConfig(method, **config)
  for name in known:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"speculative_config {name}={value!r} must be an integer >= 1")
  if cfg.k > 16:
    raise ValueError(f"speculative_config num_speculative_tokens={cfg.k} exceeds the limit of 16")
  if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
    raise ValueError(f"speculative_config prompt_lookup_min={cfg.prompt_lookup_min} exceeds "
                     f"prompt_lookup_max={cfg.prompt_lookup_max}")
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
