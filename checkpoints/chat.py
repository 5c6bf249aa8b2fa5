"""Chat templates: a conversation -> the prompt text the model was trained on, rendered as transformers does.

The template is the model's own (`tokenizer_config.json` / `chat_template.jinja`, or the GGUF key
`tokenizer.chat_template`), rendered with jinja2 in an immutable sandbox with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, `raise_exception`, `strftime_now` and a `tojson` that
keeps non-ASCII text, with the tokenizer's special tokens (`bos_token`, `eos_token`, ...) and
`add_generation_prompt` in scope: the environment transformers' `apply_chat_template` uses.

A model without a template whose vocabulary has Gemma's turn markers (the embedded Gemma 3 270M is
a base model and ships none) gets `GEMMA_TURNS`, Gemma's documented format: a system message is
put in front of the first user turn, the assistant's role is called "model":

    <bos><start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n<start_of_turn>model\n

The rendered prompt is encoded without adding special tokens (the template writes BOS itself), and
generation stops on the template's end-of-turn token (`ChatFormat.stop_ids`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from typing import Any, Mapping, Sequence

import jinja2
from jaxgen.checkpoints.tokenizer import END_OF_TURN_TOKENS
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]

GEMMA_TURNS = (
    "{%- if messages and messages[0]['role'] == 'system' -%}\n"
    "{%- set system = messages[0]['content'] | trim -%}\n"
    "{%- set turns = messages[1:] -%}\n"
    "{%- else -%}\n"
    "{%- set system = '' -%}\n"
    "{%- set turns = messages -%}\n"
    "{%- endif -%}\n"
    "{{ bos_token }}\n"
    "{%- for message in turns -%}\n"
    "{%- if message['role'] not in ('user', 'assistant') -%}\n"
    "{{ raise_exception('Gemma turns are user or assistant (one system message may come first), got '"
    " ~ message['role']) }}\n"
    "{%- endif -%}\n"
    "{{ '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else 'user') ~ '\\n' }}\n"
    "{%- if loop.first and system -%}{{ system ~ '\\n\\n' }}{%- endif -%}\n"
    "{{ message['content'] | trim ~ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}\n"
)
GEMMA_MARKERS = ("<start_of_turn>", "<end_of_turn>")


class TemplateError(ValueError):
  """The template refused the conversation (its `raise_exception`) or could not be rendered."""


def _raise_exception(message: str):
  raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


class _Generation(Extension):
  """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders its body."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
  """The compiled jinja2 template, in transformers' sandboxed environment."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise TemplateError(f"the chat template does not parse (line {e.lineno}): {e.message}") from None


def render(template: str, messages: Sequence[Message], *, add_generation_prompt: bool = True,
           special_tokens: Mapping[str, str | None] | None = None, **kwargs) -> str:
  """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
  scope = dict(special_tokens or {})
  scope.update(kwargs)
  scope.setdefault("tools", None)
  scope.setdefault("documents", None)
  try:
    return compile_template(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                             **scope)
  except jinja2.TemplateError as e:
    raise TemplateError(f"the chat template failed: {e}") from None


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """A template with the tokenizer's special tokens and the ids that end a turn."""

  template: str
  special_tokens: Mapping[str, str | None]
  stop_ids: frozenset[int]
  fallback: bool = False  # True: the model had no template; GEMMA_TURNS is used

  def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs) -> str:
    return render(self.template, messages, add_generation_prompt=add_generation_prompt,
                  special_tokens=self.special_tokens, **kwargs)

  def encode(self, tokenizer, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs) -> list[int]:
    """Token ids of the rendered prompt (no BOS added: the template writes it)."""
    return tokenizer.encode(self.render(messages, add_generation_prompt, **kwargs), add_special_tokens=False)

  @property
  def note(self) -> str | None:
    if self.fallback:
      return "the model has no chat template; using Gemma's turn format (<start_of_turn>user ... <end_of_turn>)"
    return None


def special_tokens(tokenizer) -> dict[str, str | None]:
  """{"bos_token": "<bos>", ...}: the names templates use, from the tokenizer's ids."""
  out = {}
  for name, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id), ("pad", tokenizer.pad_id),
                  ("unk", tokenizer.unk_id)):
    out[f"{name}_token"] = None if i is None else tokenizer.id_to_token(i)
  return out


def chat_format(tokenizer, template: str | None = None) -> ChatFormat:
  """The format for `tokenizer`'s model: `template`, else the model's own, else GEMMA_TURNS where it fits."""
  template = template or getattr(tokenizer, "chat_template", None)
  fallback = template is None
  if fallback:
    if any(tokenizer.token_to_id(m) is None for m in GEMMA_MARKERS):
      raise ValueError("this model has no chat template (none in tokenizer_config.json, chat_template.jinja or "
                       "the GGUF metadata) and is not a Gemma model; pass chat_template= with a jinja template")
    template = GEMMA_TURNS
  stops = {tokenizer.token_to_id(t) for t in END_OF_TURN_TOKENS if t in template}
  stops.discard(None)
  if tokenizer.eos_id is not None:
    stops.add(tokenizer.eos_id)
  return ChatFormat(template, special_tokens(tokenizer), frozenset(stops), fallback)


def conversations(messages) -> list[list[Message]]:
  """One conversation (a list of message dicts) or a list of them -> a list of conversations."""
  messages = list(messages)
  if not messages:
    raise ValueError("messages is empty: give a list of {'role': ..., 'content': ...} dicts (or a list of such lists)")
  if all(isinstance(m, Mapping) for m in messages):
    return [messages]
  out = [list(c) for c in messages]
  for i, conv in enumerate(out):
    if not conv or not all(isinstance(m, Mapping) and "role" in m for m in conv):
      raise ValueError(f"conversation {i} must be a non-empty list of {{'role': ..., 'content': ...}} dicts")
  return out
