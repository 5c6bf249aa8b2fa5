"""Streaming text on the host: the incremental detokenizer (what each step emits) and the stop-string
search and holdback, with the embedded model's real tokenizer."""

from __future__ import annotations

import pytest
from jaxgen.decode.text import REPLACEMENT, IncrementalDetokenizer, find_stop, holdback


@pytest.fixture(scope="module")
def tok(llm):
  # The session's model brings the tokenizer (parsing it from the GGUF again takes seconds; that
  # parse is test_tokenizer's subject).
  return llm.tokenizer


def stream(tok, ids, prompt=(2,)):
  detok = IncrementalDetokenizer(tok, list(prompt))
  deltas = [detok.add(i) for i in ids]
  return deltas + [detok.flush()]


# Characters the vocabulary has no piece for, so each is spelled as 4 byte-fallback tokens (rare CJK
# of extension B, mathematical letters), beside ones it has (common CJK, accents).
BYTE_FALLBACK = ["\U00020B9F\U00020BB7 ok", "\U0001D518\U0001D52B\U0001D526 and \u00e9t\u00e9 \u4e2d\u6587"]


@pytest.mark.parametrize("text", BYTE_FALLBACK)
def test_byte_fallback_characters_stream_whole(tok, text):
  ids = tok.encode(text, add_special_tokens=False)
  pieces = [tok.id_to_token(i) for i in ids]
  assert sum(p.startswith("<0x") for p in pieces) >= 8, pieces  # the case under test
  deltas = stream(tok, ids)
  assert "".join(deltas) == tok.decode(ids) == text
  assert not any(REPLACEMENT in d for d in deltas)
  # The first bytes of a character emit nothing; its last byte emits it whole.
  first = pieces.index(next(p for p in pieces if p.startswith("<0x")))
  assert deltas[first:first + 3] == ["", "", ""] and len(deltas[first + 3]) == 1


def test_an_emoji_sequence_joined_by_zwj_streams_as_its_text(tok):
  text = "family: \U0001F469\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466!"
  ids = tok.encode(text, add_special_tokens=False)
  assert len(ids) >= 7  # one grapheme, several tokens
  deltas = stream(tok, ids)
  assert "".join(deltas) == text and not any(REPLACEMENT in d for d in deltas)


def test_a_sequence_cut_inside_a_character_flushes_what_it_has(tok):
  ids = tok.encode("\U00020B9F", add_special_tokens=False)
  deltas = stream(tok, ids[:-1])
  assert all(d == "" for d in deltas[:-1])  # nothing streamed while the character is incomplete
  assert deltas[-1] == tok.decode(ids[:-1])  # flush at the end gives what decoding gives


def test_leading_spaces_survive_token_by_token(tok):
  text = " Hello  world,\n  indented\tand tabbed"
  ids = tok.encode(text, add_special_tokens=False)
  assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_find_stop_sees_a_stop_string_across_the_boundary():
  assert find_stop("abc END", ["END"], new_chars=1) == (4, "END")
  assert find_stop("abc EN", ["END"], new_chars=2) is None
  assert find_stop("xx STOP yy END", ["END", "STOP"], new_chars=14) == (3, "STOP")  # the earliest
  assert find_stop("END and more", ["END"], new_chars=4) is None  # ended before the new text


def test_holdback_keeps_exactly_a_possible_stop_prefix():
  assert holdback("the answer is 4", ["</s>"]) == 0
  assert holdback("the answer <", ["</s>"]) == 1
  assert holdback("the answer </", ["</s>"]) == 2
  assert holdback("the answer </s", ["</s>", "s>"]) == 3
  assert holdback("ab", ["abc", "bcd"]) == 2
  assert holdback("", ["x"]) == 0
