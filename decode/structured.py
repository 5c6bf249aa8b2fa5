"""Structured output: a request's text held to a JSON schema, a regex, a list of choices or a
grammar, by a token mask at every draw. No JAX here.

The grammar engine is llguidance (`LLMatcher`): it compiles each constraint against the
tokenizer's vocabulary, walks it with every accepted token, and writes the next draw's allowed
tokens as a packed bitmask, int32 [rows, ceil(V/32)] (bit j of word w allows token 32 w + j). The
sampling program applies it on the device before temperature, top-k and top-p
(`decode.sampling.sample`); rows without a constraint carry no mask and cost nothing.

`StructuredOutputsParams` has vLLM's names and meanings. `Grammars` compiles and caches by
(kind, spec) and hands each sample its own matcher. A sample whose grammar is complete (nothing
may follow but the end) finishes with "stop" (`OutputProcessor`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Whitespace JSON may hold between two tokens unless a request says otherwise: one newline with up
# to 20 spaces or tabs of indentation, or one space or tab. Pretty-printed JSON stays possible; a
# run of blank lines does not (vLLM's default, any whitespace, lets a small model sampled at
# temperature 1.0 loop on newlines until its token limit: docs/structured-output.md).
JSON_WHITESPACE = r"(\n[ \t]{0,20})|[ \t]"
MAX_SPEC_CHARS = 1 << 20  # a constraint's text (a schema, a grammar): longer is refused
_CACHE_SIZE = 256  # compiled constraints kept (a server sees the same few schemas again and again)


@dataclasses.dataclass
class StructuredOutputsParams:
  """One constraint on a request's output (vLLM's `StructuredOutputsParams`); exactly one of:

  json: a JSON schema (dict or its JSON text); the output is one JSON value it accepts.
  regex: the output matches this regular expression (Rust `regex` syntax) whole.
  choice: the output is exactly one of these strings.
  grammar: a context-free grammar, Lark (llguidance's dialect) or GBNF (llama.cpp's).
  json_object: True: any JSON object.
  Options: disable_any_whitespace (JSON without free whitespace between tokens: ", " and ": "
  only), disable_additional_properties (object schemas without `additionalProperties` get
  false), whitespace_pattern (a regex for the whitespace JSON may hold between two tokens; by
  default `JSON_WHITESPACE`, one newline and its indentation or one space).
  """

  json: str | dict | None = None
  regex: str | None = None
  choice: list[str] | None = None
  grammar: str | None = None
  json_object: bool | None = None
  structural_tag: str | None = None
  disable_fallback: bool = False
  disable_any_whitespace: bool = False
  disable_additional_properties: bool = False
  whitespace_pattern: str | None = None

  def __post_init__(self):
    given = [k for k in KINDS if getattr(self, k) not in (None, False)]
    if len(given) != 1:
      raise ValueError(f"StructuredOutputsParams: give exactly one of {', '.join(KINDS)} (got "
                       f"{', '.join(given) if given else 'none'})")
    if self.structural_tag is not None:
      raise ValueError("StructuredOutputsParams.structural_tag is not supported; use json, regex, choice or grammar")
    if self.json is not None and not isinstance(self.json, (str, dict)):
      raise ValueError(f"StructuredOutputsParams.json is a {type(self.json).__name__}: give a JSON schema "
                       "(a dict or its JSON text)")
    if self.json_object not in (None, True, False):
      raise ValueError(f"StructuredOutputsParams.json_object={self.json_object!r}: must be True")
    if self.choice is not None:
      if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) or not self.choice:
        raise ValueError(f"StructuredOutputsParams.choice={self.choice!r}: must be a non-empty list of "
                         "non-empty strings")
      self.choice = list(self.choice)
    for field in ("regex", "grammar", "whitespace_pattern"):
      value = getattr(self, field)
      if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"StructuredOutputsParams.{field}={value!r}: must be a non-empty string")
    text = self.key()[1]
    if len(text) > MAX_SPEC_CHARS:
      raise ValueError(f"StructuredOutputsParams.{self.kind} is {len(text)} characters; the limit is "
                       f"{MAX_SPEC_CHARS}")

  @classmethod
  def from_fields(cls, fields: dict) -> "StructuredOutputsParams":
    """From a dict of its fields (a request body's); unknown fields are a ValueError naming them."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise ValueError(f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}")
    return cls(**fields)

  @property
  def kind(self) -> str:
    return next(k for k in KINDS if getattr(self, k) not in (None, False))

  def key(self) -> tuple[str, str, bool, bool, str | None]:
    """What the compiled constraint depends on: (kind, canonical text, options)."""
    kind = self.kind
    value = {"json_object": {"type": "object"}}.get(kind, getattr(self, kind))
    if kind == "json" and isinstance(value, str):
      try:
        value = json.loads(value)
      except json.JSONDecodeError as e:
        raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
    # Not key-sorted: a schema's property order is the order its object's keys are written in.
    text = value if isinstance(value, str) else json.dumps(value)
    return (kind, text, self.disable_any_whitespace, self.disable_additional_properties, self.whitespace_pattern)


def _grammar_text(key) -> str:
  """llguidance's grammar for a constraint key."""
  kind, text, no_whitespace, no_additional, whitespace = key
  if kind in ("json", "json_object"):
    options: dict[str, Any] = {"whitespace_flexible": not no_whitespace}
    if not no_whitespace:
      options["whitespace_pattern"] = JSON_WHITESPACE if whitespace is None else whitespace
    schema = json.loads(text)
    if no_additional and isinstance(schema, dict):
      schema = _no_additional_properties(schema)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
  if kind == "choice":
    return llguidance.grammar_from("choice", json.loads(text))
  return llguidance.grammar_from("grammar" if kind == "grammar" else kind, text)


def _no_additional_properties(schema):
  """`additionalProperties: false` wherever an object schema does not set it (vLLM's option)."""
  if isinstance(schema, list):
    return [_no_additional_properties(s) for s in schema]
  if not isinstance(schema, dict):
    return schema
  out = {k: _no_additional_properties(v) for k, v in schema.items()}
  if out.get("type") == "object" and "additionalProperties" not in out:
    out["additionalProperties"] = False
  return out


class Grammars:
  """Compiles constraints against one tokenizer's vocabulary and keeps the latest `_CACHE_SIZE`.

  Thread-safe: a server compiles on its handlers' threads (llguidance drops the GIL while it
  compiles). The vocabulary's index (about 3 s for 262,144 tokens) is built on first use.
  """

  def __init__(self, tokenizer, vocab_size: int):
    self.tokenizer, self.vocab_size = tokenizer, vocab_size
    self._ll: llguidance.LLTokenizer | None = None
    self._compiled: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()

  def _vocabulary(self) -> llguidance.LLTokenizer:
    with self._lock:
      if self._ll is None:
        backend = getattr(self.tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
          raise ValueError(f"structured outputs need a `tokenizers` vocabulary; this tokenizer "
                           f"({type(self.tokenizer).__name__}) has none")
        ends = sorted(self.tokenizer.stop_ids)
        self._ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=ends or None)
      return self._ll

  def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
    """The constraint's matcher at its start (a template: each sample takes a `start` copy).
    ValueError naming the constraint and llguidance's message when it does not compile."""
    key = params.key()
    with self._lock:
      if key in self._compiled:
        self._compiled.move_to_end(key)
        return self._compiled[key]
    vocab = self._vocabulary()
    try:
      grammar = _grammar_text(key)
    except (ValueError, TypeError) as e:
      raise ValueError(f"StructuredOutputsParams.{key[0]} does not compile: {e}") from None
    matcher = llguidance.LLMatcher(vocab, grammar, log_level=0)
    if matcher.is_error():
      raise ValueError(f"StructuredOutputsParams.{key[0]} does not compile: {matcher.get_error()}")
    probe = matcher.deep_copy()  # some grammars that admit nothing show it only at the first mask
    first = masks([(0, probe)], 1, self.vocab_size)
    if probe.is_error() or not first.any():
      reason = probe.get_error().splitlines()[0] if probe.is_error() else "no token may start it"
      raise ValueError(f"StructuredOutputsParams.{key[0]} admits no output: no text matches it ({reason})")
    with self._lock:
      self._compiled[key] = matcher
      while len(self._compiled) > _CACHE_SIZE:
        self._compiled.popitem(last=False)
    return matcher


def words(vocab_size: int) -> int:
  """int32 words of one row's mask."""
  return (vocab_size + 31) // 32


def masks(matchers: list[tuple[int, llguidance.LLMatcher]], rows: int, vocab_size: int) -> np.ndarray:
  """The next draw's masks int32 [rows, words] for (row, matcher) pairs; other rows allow everything."""
  mask = np.full((rows, words(vocab_size)), -1, np.int32)
  for row, m in matchers:
    llg_numpy.fill_next_token_bitmask(m, mask, row)
  return mask


def masks_along(matchers: list[tuple[int, llguidance.LLMatcher]], proposals: np.ndarray, counts: np.ndarray,
                t: int, vocab_size: int) -> np.ndarray:
  """A verify step's masks int32 [rows * t, words]: row r's mask at position j (r * t + j) is its
  grammar's after the first j of its counts[r] proposals [rows, t - 1]; the matcher walks them and
  back. The proposals must be valid (`valid_prefix`)."""
  mask = np.full((len(counts) * t, words(vocab_size)), -1, np.int32)
  for row, m in matchers:
    c = int(counts[row])
    llg_numpy.fill_next_token_bitmask(m, mask, row * t)
    for j in range(c):
      m.consume_token(int(proposals[row, j]))
      llg_numpy.fill_next_token_bitmask(m, mask, row * t + j + 1)
    if c:
      m.rollback(c)
  return mask


def valid_prefix(matcher: llguidance.LLMatcher, proposals) -> int:
  """How many of the leading proposals the grammar accepts in turn (vLLM's `validate_tokens`)."""
  return matcher.validate_tokens([int(p) for p in proposals])


def start(template: llguidance.LLMatcher) -> llguidance.LLMatcher:
  """A sample's own matcher, at the constraint's start."""
  return template.deep_copy()

