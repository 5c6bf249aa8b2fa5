"""The tokenizer of a Hugging Face model directory: `tokenizer.json` plus what transformers keeps beside it.

The backend is `tokenizer.json` as saved. Read from the other files:
- the special tokens (bos/eos/pad/unk): `tokenizer_config.json` (a string or an AddedToken dict),
  else `special_tokens_map.json`;
- whether BOS/EOS are added: `add_bos_token`/`add_eos_token` where the config sets them, else what
  the backend's post-processor does (found by encoding one character with and without it);
- extra stop ids: `eos_token_id` (an int or a list) of `generation_config.json`, else of
  `config.json` (Llama 3 instruct models list `<|eot_id|>` there);
- the chat template: `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string,
  or a list of named templates, of which "default" is used), else `chat_template.json`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxgen.checkpoints.tokenizer import Tokenizer
from tokenizers import Tokenizer as Backend

TOKENIZER = "tokenizer.json"
SPECIAL_NAMES = ("bos", "eos", "pad", "unk")


def _json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path!r} is not valid JSON: {e}") from None


def _content(token: Any) -> str | None:
  """A special token as written by transformers: a string or {"content": ..., ...}."""
  if isinstance(token, dict):
    return token.get("content")
  return token if isinstance(token, str) else None


def chat_template_of(path: str, tokenizer_config: dict | None = None) -> str | None:
  """The directory's chat template (see the module docstring for where it is looked for)."""
  jinja = os.path.join(path, "chat_template.jinja")
  if os.path.isfile(jinja):
    with open(jinja, encoding="utf-8") as f:
      return f.read()
  template = (tokenizer_config if tokenizer_config is not None else _json(os.path.join(path, "tokenizer_config.json"))
              ).get("chat_template")
  if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  if template is None:
    template = _json(os.path.join(path, "chat_template.json")).get("chat_template")
  return template if isinstance(template, str) else None


def _eos_ids(path: str) -> list[int]:
  for name in ("generation_config.json", "config.json"):
    ids = _json(os.path.join(path, name)).get("eos_token_id")
    if ids is not None:
      return [int(i) for i in (ids if isinstance(ids, list) else [ids])]
  return []


def tokenizer_from_hf_dir(path: str) -> Tokenizer:
  """The Tokenizer of a local HF model directory (its `tokenizer.json` is required)."""
  file = os.path.join(path, TOKENIZER)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path!r} has no {TOKENIZER} (jaxgen reads fast-tokenizer files only; "
                            "save the tokenizer with transformers to create one)")
  try:
    backend = Backend.from_file(file)
  except Exception as e:  # tokenizers raises a bare Exception for malformed files
    raise ValueError(f"{file!r} could not be read by the tokenizers library: {e}") from None
  config = _json(os.path.join(path, "tokenizer_config.json"))
  special_map = _json(os.path.join(path, "special_tokens_map.json"))
  ids: dict[str, int | None] = {}
  for name in SPECIAL_NAMES:
    token = _content(config.get(f"{name}_token")) or _content(special_map.get(f"{name}_token"))
    ids[name] = None if token is None else backend.token_to_id(token)

  probe_plain = backend.encode("a", add_special_tokens=False).ids
  probe_full = backend.encode("a", add_special_tokens=True).ids
  adds_bos = ids["bos"] is not None and probe_full[:1] == [ids["bos"]] and probe_plain[:1] != [ids["bos"]]
  adds_eos = ids["eos"] is not None and probe_full[-1:] == [ids["eos"]] and probe_plain[-1:] != [ids["eos"]]
  add_bos = config.get("add_bos_token")
  add_eos = config.get("add_eos_token")
  return Tokenizer(backend, bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["pad"], unk_id=ids["unk"],
                   add_bos=adds_bos if add_bos is None else add_bos,
                   add_eos=adds_eos if add_eos is None else add_eos,
                   extra_stop_ids=_eos_ids(path), chat_template=chat_template_of(path, config))
