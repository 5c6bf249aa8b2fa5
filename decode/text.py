"""Incremental detokenization and stop strings, per sequence, on the host.

Detokenization decodes a short window of recent tokens twice (with and without the newest ones)
and emits only the difference, so each step costs O(window) and never emits half a UTF-8
character: while the newest text ends in U+FFFD (an incomplete byte sequence) it waits.
"""

from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
  """Turns a growing list of token ids into text, a delta at a time."""

  def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
    self.tok = tokenizer
    self.skip = skip_special_tokens
    self.ids: list[int] = list(prompt_ids[-6:])  # a little prompt context for leading spaces
    self.prefix = 0  # start of the window decoded for context
    self.read = len(self.ids)  # tokens before this were already emitted

  def _decode(self, ids) -> str:
    return self.tok.decode(ids, skip_special_tokens=self.skip)

  def add(self, token: int) -> str:
    """Adds one token; returns the text it completes (possibly "")."""
    self.ids.append(int(token))
    before = self._decode(self.ids[self.prefix:self.read])
    after = self._decode(self.ids[self.prefix:])
    if len(after) > len(before) and not after.endswith(REPLACEMENT):
      delta = after[len(before):]
      self.prefix, self.read = self.read, len(self.ids)
      return delta
    return ""

  def flush(self) -> str:
    """Text of tokens still held back (an incomplete character at the very end)."""
    before = self._decode(self.ids[self.prefix:self.read])
    after = self._decode(self.ids[self.prefix:])
    self.prefix = self.read = len(self.ids)
    return after[len(before):]


def find_stop(text: str, stops: Sequence[str], new_chars: int) -> tuple[int, str] | None:
  """First occurrence of a stop string that ends within the last `new_chars` characters.

  Returns (index where it starts, the stop string) or None. Only the tail that could contain a
  match touching the new text is searched, so a stop spanning two tokens is found too.
  """
  best = None
  for s in stops:
    start = max(0, len(text) - new_chars - len(s) + 1)
    i = text.find(s, start)
    if i != -1 and (best is None or i < best[0]):
      best = (i, s)
  return best


def holdback(text: str, stops: Sequence[str]) -> int:
  """How many trailing characters could still begin a stop string (not to be streamed yet)."""
  keep = 0
  for s in stops:
    for k in range(min(len(s) - 1, len(text)), keep, -1):
      if s.startswith(text[-k:]):
        keep = k
        break
  return keep
