"""Text <-> token ids, on top of the Hugging Face `tokenizers` library.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the "backend") together with the ids and flags that the
backend does not carry itself: which ids are BOS/EOS/PAD/UNK, whether BOS is prepended, and which
ids end a turn. Any backend works, e.g. one read from an HF `tokenizer.json`.

`tokenizer_from_gguf` builds the backend from a GGUF file's `tokenizer.ggml.*` metadata. Two kinds
of vocabulary are supported.

`tokenizer.ggml.model = "gpt2"` is byte-level BPE (Llama 3, Qwen 2/3, ...): the file lists the
tokens, spelled in GPT-2's byte alphabet, and the merges. What it does not hold is how text is cut
into words before BPE; it names that with `tokenizer.ggml.pre`, and `BYTE_LEVEL_SPLITS` maps each
name jaxgen knows to its regular expression. A name not in the table is refused: splitting with the
wrong expression gives other ids for the same text, silently.

`tokenizer.ggml.model = "llama"` is llama.cpp's name for a SentencePiece BPE vocabulary with byte
fallback (Llama 1/2, Mistral, Gemma, ...). The file lists no merges for it, so they are derived from
the vocabulary, as HF's SentencePiece conversion does:

  * every piece that can be cut into two pieces of the vocabulary gives a merge; merges rank by the
    merged piece's position in the vocabulary (SentencePiece writes pieces in merge order, and
    Gemma's user-defined pieces carry placeholder scores), then by longer left part first;
  * the normalizer maps " " to "▁" (with a leading "▁" when `add_space_prefix` is set) and there is
    no pre-tokenizer, so BPE sees whole "▁"-joined runs of text, as SentencePiece does;
  * control (and unknown) pieces become special added tokens, so `<start_of_turn>` or `<eos>` in the
    text is one id; user-defined pieces become plain added tokens, matched whole in the raw text,
    except whitespace-only ones that contain spaces: llama.cpp stores those with real spaces, so
    they are respelled with "▁" and left to BPE (Gemma's space runs);
  * the decoder turns "▁" back into spaces, joins `<0xNN>` byte pieces into UTF-8 and concatenates.
This reproduces transformers' GGUF tokenizer for Gemma 3 exactly (tests/test_tokenizer.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

if TYPE_CHECKING:
  import gguf

SPACE = "\u2581"  # "▁", SentencePiece's visible space

# Tokens that end a turn in common chat formats; they stop generation when the vocabulary has them
# as special tokens.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>",
                      "<|endoftext|>")

# gguf.TokenType values
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_GGUF_TOKENIZERS = ("llama", "gpt2")

# How byte-level vocabularies cut text into words, by llama.cpp's `tokenizer.ggml.pre` names.
# GPT-2's own expression is the ByteLevel pre-tokenizer's built-in one (None here).
_LLAMA3_WORDS = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_WORDS = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL_SPLITS: dict[str, str | None] = {
    "default": None, "gpt-2": None, "gpt2": None,
    "llama-bpe": _LLAMA3_WORDS, "llama3": _LLAMA3_WORDS, "llama-v3": _LLAMA3_WORDS,
    "smaug-bpe": _LLAMA3_WORDS, "falcon3": _LLAMA3_WORDS, "dbrx": _LLAMA3_WORDS,
    "qwen2": _QWEN2_WORDS, "deepseek-r1-qwen": _QWEN2_WORDS,
}


class Tokenizer:
  """A `tokenizers.Tokenizer` plus the special ids and flags generation needs."""

  def __init__(self, backend: Backend, *, bos_id: int | None = None, eos_id: int | None = None,
               pad_id: int | None = None, unk_id: int | None = None, add_bos: bool = False,
               add_eos: bool = False, extra_stop_ids: Iterable[int] = (), chat_template: str | None = None):
    self.backend = backend
    self.chat_template = chat_template  # the model's own jinja chat template, if it has one
    self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
    self.bos_id, self.eos_id, self.pad_id, self.unk_id = bos_id, eos_id, pad_id, unk_id
    self.add_bos, self.add_eos = bool(add_bos), bool(add_eos)
    specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    stops = {specials[t] for t in END_OF_TURN_TOKENS if t in specials}
    stops |= {int(i) for i in extra_stop_ids}
    if eos_id is not None:
      stops.add(eos_id)
    self._stop_ids = frozenset(stops)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; BOS first (and EOS last) when `add_special_tokens` and the flags say so.

    Special-token text such as "<start_of_turn>" is always encoded as its single id.
    """
    # encode_batch releases the GIL while it works (encode holds it throughout): a server
    # tokenizing a long prompt on a worker thread must not stall its event loop meanwhile.
    ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
    if add_special_tokens:
      if self.add_bos and self.bos_id is not None:
        ids.insert(0, self.bos_id)
      if self.add_eos and self.eos_id is not None:
        ids.append(self.eos_id)
    return ids

  def decode(self, ids, skip_special_tokens: bool = False) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self.backend.token_to_id(token)

  def id_to_token(self, i: int) -> str | None:
    return self.backend.id_to_token(int(i)) if 0 <= int(i) < self.vocab_size else None

  @property
  def stop_ids(self) -> frozenset[int]:
    """EOS plus the end-of-turn tokens this vocabulary has (e.g. Gemma's `<end_of_turn>`)."""
    return self._stop_ids

  def __repr__(self) -> str:
    return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"pad_id={self.pad_id}, unk_id={self.unk_id}, add_bos={self.add_bos}, "
            f"stop_ids={sorted(self._stop_ids)})")


def tokenizer_from_gguf(reader: "gguf.GGUFReader") -> Tokenizer:
  """The tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata."""

  def field(key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()

  kind = field("tokenizer.ggml.model")
  if kind is None:
    raise ValueError("this GGUF file has no tokenizer (no tokenizer.ggml.model metadata)")
  if kind not in SUPPORTED_GGUF_TOKENIZERS:
    raise ValueError(f"unsupported GGUF tokenizer: tokenizer.ggml.model = {kind!r}; supported: "
                     f"{', '.join(repr(k) for k in SUPPORTED_GGUF_TOKENIZERS)} (SentencePiece and byte-level BPE)")
  tokens = field("tokenizer.ggml.tokens")
  if not tokens:
    raise ValueError("GGUF tokenizer metadata has no tokenizer.ggml.tokens")
  types = field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
  if len(types) != len(tokens):
    raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")

  ids = {name: field(f"tokenizer.ggml.{name}_token_id")
         for name in ("bos", "eos", "padding", "unknown")}
  special_ids = [i for i in ids.values() if i is not None]
  if kind == "gpt2":
    pre = field("tokenizer.ggml.pre", "default")
    if pre not in BYTE_LEVEL_SPLITS:
      raise ValueError(f"unsupported GGUF pre-tokenizer: tokenizer.ggml.pre = {pre!r}; jaxgen knows how "
                       f"to split text for {', '.join(sorted(BYTE_LEVEL_SPLITS))}")
    merges = field("tokenizer.ggml.merges")
    if not merges:
      raise ValueError("GGUF byte-level tokenizer metadata has no tokenizer.ggml.merges")
    backend = byte_level_backend(tokens, types, merges, BYTE_LEVEL_SPLITS[pre], special_ids=special_ids)
    add_bos_default = False  # byte-level vocabularies state it when they want BOS (Llama 3 does)
  else:
    backend = spm_bpe_backend(tokens, types, unk_id=ids["unknown"],
                              add_space_prefix=bool(field("tokenizer.ggml.add_space_prefix", False)),
                              special_ids=special_ids)
    add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
  return Tokenizer(backend, bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["padding"],
                   unk_id=ids["unknown"],
                   add_bos=bool(field("tokenizer.ggml.add_bos_token", add_bos_default)),
                   add_eos=bool(field("tokenizer.ggml.add_eos_token", False)),
                   chat_template=field("tokenizer.chat_template"))


def byte_tokenizer() -> Tokenizer:
  """A byte-level tokenizer of 259 ids (0 pad, 1 eos, 2 bos, then one per byte): for small models
  built from a config (tests, examples) that still need real text in and out."""
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  specials = ["<pad>", "<eos>", "<bos>"]
  backend = Backend(models.BPE({t: i for i, t in enumerate(specials + alphabet)}, [], fuse_unk=False))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
  return Tokenizer(backend, bos_id=2, eos_id=1, pad_id=0, add_bos=True)


def byte_level_backend(tokens: list[str], types: list[int], merges: list[str], split: str | None, *,
                       special_ids: Iterable[int] = ()) -> Backend:
  """A `tokenizers` byte-level BPE from GGUF tokens and "left right" merges; words cut by `split`
  (a regular expression; None for GPT-2's)."""
  vocab: dict[str, int] = {}
  for i, t in enumerate(tokens):
    vocab.setdefault(t, i)
  pairs = [tuple(m.split(" ", 1)) for m in merges]
  backend = Backend(models.BPE(vocab, pairs, fuse_unk=False))
  if split is None:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  else:
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  special_ids = set(special_ids)
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                              for i, (t, k) in enumerate(zip(tokens, types))
                              if k in (_CONTROL, _UNKNOWN) or i in special_ids])
  backend.add_tokens([AddedToken(t, special=False, normalized=False)
                      for i, (t, k) in enumerate(zip(tokens, types)) if k == _USER_DEFINED and i not in special_ids])
  return backend


def spm_bpe_backend(tokens: list[str], types: list[int], *, unk_id: int | None = None,
                    add_space_prefix: bool = False, special_ids: Iterable[int] = ()) -> Backend:
  """A `tokenizers` BPE equivalent to a SentencePiece BPE model with these pieces (see above)."""
  pieces = [t.replace(" ", SPACE) if t and not t.strip() else t for t in tokens]
  vocab: dict[str, int] = {}
  for i, p in enumerate(pieces):
    vocab.setdefault(p, i)

  # Merges in rank order: by the merged piece's id, then longest left part first.
  merges = []
  for p in pieces:
    for cut in range(len(p) - 1, 0, -1):
      if p[:cut] in vocab and p[cut:] in vocab:
        merges.append((p[:cut], p[cut:]))

  unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
  backend = Backend(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
  replace = normalizers.Replace(" ", SPACE)
  steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
  if add_space_prefix:
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace])
    steps.append(decoders.Strip(" ", 1, 0))
  else:
    backend.normalizer = replace
  backend.decoder = decoders.Sequence(steps)

  special_ids = set(special_ids)
  special = [AddedToken(t, special=True, normalized=False) for i, (t, k) in enumerate(zip(tokens, types))
             if k in (_CONTROL, _UNKNOWN) or i in special_ids]
  plain = [AddedToken(t, special=False, normalized=False)
           for i, (t, p, k) in enumerate(zip(tokens, pieces, types))
           if k == _USER_DEFINED and t == p and i not in special_ids]
  backend.add_special_tokens(special)
  backend.add_tokens(plain)
  return backend
