"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, their mapping to
`SamplingParams`, and the response objects (whole and streamed chunks) built from engine outputs.

Unknown fields are ignored, as vLLM does; a field of the wrong type or value is refused with a 400
that names it. vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos, ...)
are accepted too. Structured output arrives as OpenAI's `response_format`, vLLM's
`structured_outputs` (or its older `guided_*` fields), or a tool call forced by `tool_choice`
("required" or a named function): each becomes one `StructuredOutputsParams` (`output_constraint`).
What jaxgen cannot do yet (`tool_choice="auto"`, streamed tool calls) is refused with a 400 naming
the field, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from typing import Any

from jaxgen.decode.outputs import CompletionOutput, RequestOutput
from jaxgen.decode.params import SamplingParams
from jaxgen.decode.structured import StructuredOutputsParams
from pydantic import BaseModel, ConfigDict, Field


class ApiError(Exception):
  """An error answered with OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code

  def body(self) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error",
            503: "server_overloaded"}.get(self.status, "server_error")
    return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code or self.status}}


class StreamOptions(BaseModel):
  include_usage: bool = False


class _Sampling(BaseModel):
  """Fields both endpoints share (OpenAI's, then vLLM's extras)."""

  model_config = ConfigDict(extra="ignore")
  model: str | None = None
  n: int = 1
  temperature: float | None = None
  top_p: float | None = None
  stop: str | list[str] | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  seed: int | None = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None
  user: str | None = None
  top_k: int | None = None
  min_p: float | None = None
  repetition_penalty: float | None = None
  ignore_eos: bool = False
  min_tokens: int = 0
  stop_token_ids: list[int] | None = None
  skip_special_tokens: bool = True
  include_stop_str_in_output: bool = False
  # Structured output (OpenAI's, then vLLM's spellings): typed loosely so that any value reaches
  # `output_constraint` and gets its message, not a type error.
  response_format: Any = None
  structured_outputs: Any = None
  guided_json: Any = None
  guided_regex: Any = None
  guided_choice: Any = None
  guided_grammar: Any = None


class CompletionRequest(_Sampling):
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = 16
  logprobs: int | None = None
  echo: bool = False
  suffix: str | None = None
  best_of: int | None = None


class Message(BaseModel):
  model_config = ConfigDict(extra="ignore")
  role: str
  content: str | list[dict[str, Any]] | None = None

  def plain(self) -> dict[str, str]:
    """{"role", "content"} with the content as one string (text parts joined; others refused)."""
    if self.content is None or isinstance(self.content, str):
      return {"role": self.role, "content": self.content or ""}
    texts = []
    for part in self.content:
      if part.get("type") != "text":
        raise ApiError(400, f"message content part of type {part.get('type')!r} is not supported; only 'text'",
                       "messages")
      texts.append(str(part.get("text", "")))
    return {"role": self.role, "content": "".join(texts)}


class ChatRequest(_Sampling):
  messages: list[Message] = Field(min_length=1)
  max_tokens: int | None = None
  max_completion_tokens: int | None = None
  logprobs: bool = False
  top_logprobs: int | None = None
  add_generation_prompt: bool = True
  tools: Any = None
  tool_choice: Any = None


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclasses.dataclass(frozen=True)
class Constraint:
  """A request's output constraint, the field that asked for it, and the tool call it makes (chat):
  tool "" for none, a function's name (tool_choice naming it), "*" (tool_choice="required": a
  JSON list of {"name", "parameters"}), or "auto:<parser>" (the model decides; no constraint, its
  calls parsed from the text)."""

  params: StructuredOutputsParams | None
  field: str
  tool: str = ""


def _hermes_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
  """Hermes' format (Qwen 2.5/3, Hermes, many fine-tunes): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks. (content before the first call or None, [(name, arguments JSON)]);
  no calls when a block does not parse."""
  calls = []
  for block in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
    try:
      call = json.loads(block)
      calls.append((str(call["name"]), json.dumps(call.get("arguments", {}))))
    except (json.JSONDecodeError, KeyError, TypeError):
      return text, []
  content = text.split("<tool_call>", 1)[0].strip() if calls else text
  return content or None, calls


TOOL_CALL_PARSERS = {"hermes": _hermes_calls}


def output_constraint(req: _Sampling, tool_call_parser: str | None = None) -> Constraint | None:
  """The request's structured output, from whichever one field asks for it; ApiError(400) naming
  the field when its value is refused or two fields ask."""
  asked = []
  fmt = req.response_format
  if fmt is not None and fmt != {"type": "text"}:
    asked.append(("response_format", _response_format(fmt), ""))
  if req.structured_outputs is not None:
    if not isinstance(req.structured_outputs, dict):
      raise ApiError(400, f"structured_outputs={_short(req.structured_outputs)} must be an object", "structured_outputs")
    asked.append(("structured_outputs", req.structured_outputs, ""))
  asked += [(name, {kind: getattr(req, name)}, "") for name, kind in _GUIDED.items() if getattr(req, name) is not None]
  if isinstance(req, ChatRequest):
    tool = _tool_constraint(req, tool_call_parser)
    if tool is not None and tool[0] is None:  # the model decides: nothing to constrain
      if asked:
        raise ApiError(400, f"{asked[0][0]} constrains the output while tool_choice=\"auto\" lets the model "
                       "call a tool: give one", asked[0][0])
      return Constraint(None, "tool_choice", tool[1])
    if tool is not None:
      asked.append(("tool_choice", *tool))
  if not asked:
    return None
  if len(asked) > 1:
    names = [a[0] for a in asked]
    raise ApiError(400, f"{' and '.join(names)} each constrain the output: give one", names[1])
  field, spec, tool = asked[0]
  try:
    return Constraint(StructuredOutputsParams.from_fields(spec), field, tool)
  except (ValueError, TypeError) as e:
    raise ApiError(400, f"{field}: {e}", field) from None


def _response_format(fmt) -> dict:
  kind = fmt.get("type") if isinstance(fmt, dict) else None
  if kind == "json_object":
    return {"json_object": True}
  if kind == "json_schema":
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
      raise ApiError(400, "response_format of type json_schema needs json_schema.schema, a JSON schema object",
                     "response_format")
    return {"json": spec["schema"]}
  raise ApiError(400, f"response_format={_short(fmt)}: its type must be one of text, json_object, json_schema",
                 "response_format")


def _tool_constraint(req: ChatRequest, tool_call_parser: str | None) -> tuple[dict | None, str] | None:
  """(structured_outputs fields, tool) for a tool call that tool_choice forces, (None,
  "auto:<parser>") when the model decides; None for none."""
  choice, tools = req.tool_choice, req.tools or []
  if choice == "none" or (choice is None and not tools):
    return None
  if not isinstance(tools, list) or not tools or not all(
      isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
      and isinstance(t["function"].get("name"), str) for t in tools):
    raise ApiError(400, "tools must be a non-empty list of {\"type\": \"function\", \"function\": {\"name\", "
                   "\"parameters\"}}", "tools")
  functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
  for i, (name, schema) in enumerate(functions.items()):
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
      raise ApiError(400, f"tools[{i}] ({name}): function.parameters={_short(schema)} must be a JSON schema of "
                     "type object", "tools")
  if choice in (None, "auto"):  # vLLM's words
    if tool_call_parser is None:
      raise ApiError(400, "\"auto\" tool choice (the default with tools) requires --enable-auto-tool-choice and "
                     "--tool-call-parser to be set; or send \"required\", a named function or \"none\"",
                     "tool_choice")
    if req.stream:
      raise ApiError(400, "tool_choice=\"auto\" cannot stream yet; send stream=false", "stream")
    return None, "auto:" + tool_call_parser
  if choice == "required":
    if req.stream:  # a list of calls would need its JSON parsed as it grows
      raise ApiError(400, "tool_choice=\"required\" cannot stream yet; send stream=false or name the function",
                     "stream")
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False} for name, schema in functions.items()]
    return {"json": {"type": "array", "minItems": 1, "items": {"anyOf": calls}}, "disable_any_whitespace": True}, "*"
  name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
  if not isinstance(choice, dict) or choice.get("type") != "function" or name not in functions:
    raise ApiError(400, f"tool_choice={_short(choice)} must be \"none\", \"required\" or {{\"type\": \"function\", "
                   f"\"function\": {{\"name\": one of {sorted(functions)}}}}}", "tool_choice")
  # Compact JSON: the arguments are read by a program, and free whitespace lets a small model loop on it.
  return {"json": functions[name], "disable_any_whitespace": True}, name


def tool_calls(text: str, tool: str) -> list[dict] | None:
  """OpenAI's `tool_calls` from a constrained output (None when it is cut short and does not parse)."""
  try:
    value = json.loads(text)
  except json.JSONDecodeError:
    return None
  # A named function's arguments are the text as written (what a stream sends); a list's calls
  # are cut out of it and written again.
  calls = [(tool, text)] if tool != "*" else [(c["name"], json.dumps(c["parameters"])) for c in value]
  return [_call(name, args) for name, args in calls]


def _call(name: str, arguments: str) -> dict:
  return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _call_id() -> str:
  return "call_" + uuid.uuid4().hex[:24]


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


def sampling_params(req: _Sampling, *, max_tokens: int | None, logprobs: int | None, stop_token_ids=(),
                    constraint: Constraint | None = None) -> SamplingParams:
  """The request's SamplingParams; ApiError(400) naming the field when a value is refused."""
  bias = {}
  for k, v in (req.logit_bias or {}).items():
    try:
      bias[int(k)] = v
    except ValueError:
      raise ApiError(400, f"logit_bias key {k!r} is not a token id", "logit_bias") from None
  try:
    return SamplingParams(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
        min_p=req.min_p or 0.0, repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, logit_bias=bias,
        seed=req.seed, stop=req.stop, stop_token_ids=sorted(set(req.stop_token_ids or []) | set(stop_token_ids)),
        ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
        structured_outputs=None if constraint is None else constraint.params)
  except ValueError as e:
    raise invalid(e) from None


def check_context(prompt_tokens: int, max_tokens: int | None, max_len: int, *, what: str = "prompt",
                  max_tokens_field: str = "max_tokens") -> None:
  """ApiError(400) in vLLM's words when the prompt plus max_tokens overflows the context (max_len).

  The engine would shorten max_tokens to the room left; a server tells the client instead. what:
  "prompt" or "messages" (the field named when the prompt alone leaves no room for one token).
  max_tokens None asks for whatever room is left.
  """
  if prompt_tokens >= max_len:
    raise ApiError(400, f"This model's maximum context length is {max_len} tokens. However, you requested "
                   f"{prompt_tokens} tokens in the {what}, which leaves no room for the completion (at least one "
                   f"token). Please reduce the length of the {what}.", what)
  if max_tokens is not None and prompt_tokens + max_tokens > max_len:
    raise ApiError(400, f"This model's maximum context length is {max_len} tokens. However, you requested "
                   f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {what}, {max_tokens} in the "
                   f"completion). Please reduce the length of the {what} or completion.", max_tokens_field)


def invalid(e: ValueError, constraint: Constraint | None = None) -> ApiError:
  """A ValueError of jaxgen's checks as a 400, its param taken from 'SamplingParams.<field>' when
  named (a constraint that does not compile: the request field that gave it)."""
  if constraint is not None and re.search(r"structured[ _]?outputs", str(e), re.I):
    return ApiError(400, str(e), constraint.field)
  m = re.search(r"\bSamplingParams\.(\w+)", str(e))
  return ApiError(400, str(e), m.group(1) if m else None)


# ------------------------------------------------------------------------------------- responses
class Responder:
  """Builds one HTTP request's responses: whole, or as stream chunks that each carry what is new.

  chat: chat.completion objects (message/delta) instead of text_completion ones. Choice index =
  prompt index * n + sample index, as OpenAI numbers the choices of a batch of prompts.
  """

  def __init__(self, model: str, tokenizer, n: int, chat: bool, include_usage: bool = False, tool: str = ""):
    self.model, self.tokenizer, self.n, self.chat, self.include_usage = model, tokenizer, n, chat, include_usage
    self.tool = tool  # a forced tool call's function name ("*": any of the tools), or ""
    self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    self.created = int(time.time())
    self.object = "chat.completion" if chat else "text_completion"
    self._sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) streamed
    self._offsets: dict[int, int] = {}  # choice index -> text_offset after the tokens streamed
    self._done: set[int] = set()  # choice indices whose last chunk was sent

  def _head(self, obj: str) -> dict:
    return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

  def usage(self, finals: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

  def whole(self, finals: list[RequestOutput]) -> dict:
    choices = []
    for p, out in enumerate(finals):
      for c in out.outputs:
        choice = {"index": p * self.n + c.index, "logprobs": self._logprobs(c, 0), "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        calls, auto = None, self.tool.startswith("auto:")
        if auto:  # the model's own calls, parsed from its text
          content, found = TOOL_CALL_PARSERS[self.tool[5:]](c.text)
          calls = [_call(name, args) for name, args in found] or None
        elif self.tool and c.finish_reason == "stop":
          content, calls = None, tool_calls(c.text, self.tool)
        if calls is not None:  # vLLM's finish reasons: "stop" for a named function, else "tool_calls"
          choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
          choice["finish_reason"] = "tool_calls" if auto or self.tool == "*" else "stop"
        elif self.chat:
          choice["message"] = {"role": "assistant", "content": c.text}
        else:
          choice["text"] = c.text
        choices.append(choice)
    return {**self._head(self.object), "choices": choices, "usage": self.usage(finals)}

  def chunks(self, p: int, out: RequestOutput) -> list[dict]:
    """Chunks for what `out` (prompt p's latest output) adds to what was streamed."""
    found = []
    for c in out.outputs:
      index = p * self.n + c.index
      first = index not in self._sent
      chars, tokens = self._sent.get(index, (0, 0))
      new = len(c.text) > chars or len(c.token_ids) > tokens
      if index in self._done or not (first or new or c.finished):
        continue
      choice = {"index": index, "logprobs": self._logprobs(c, tokens, index), "finish_reason": c.finish_reason}
      if c.finished:
        choice["stop_reason"] = c.stop_reason
        self._done.add(index)
      text = c.text[chars:]
      if self.chat and self.tool:  # a named function's arguments stream as they are written (vLLM's deltas)
        call = {"index": 0, "function": {"arguments": text}}
        if first:
          call = {"index": 0, "id": _call_id(), "type": "function", "function": {"name": self.tool, "arguments": text}}
        choice["delta"] = {"role": "assistant", "tool_calls": [call]} if first else {"tool_calls": [call]} if text else {}
      elif self.chat:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
      else:
        choice["text"] = text
      self._sent[index] = (len(c.text), len(c.token_ids))
      chunk = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
      if self.include_usage:
        chunk["usage"] = None
      found.append(chunk)
    return found

  def usage_chunk(self, finals: list[RequestOutput]) -> dict:
    return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
            "usage": self.usage(finals)}

  # ----------------------------------------------------------------------------------- logprobs
  def _piece(self, token: int) -> str:
    return self.tokenizer.decode([token], skip_special_tokens=False)

  def _logprobs(self, c: CompletionOutput, start: int, index: int | None = None) -> dict | None:
    """OpenAI's logprobs of tokens[start:]: {content: [...]} for chat, {tokens, token_logprobs,
    top_logprobs, text_offset} for completions; None when none were asked for. A stream passes its
    choice `index`: each chunk's offsets continue from the last, without decoding what was sent."""
    if c.logprobs is None:
      return None
    ids, entries = c.token_ids[start:], c.logprobs[start:]
    if self.chat:
      content = []
      for t, entry in zip(ids, entries):
        piece = self._piece(t)
        content.append({"token": piece, "logprob": entry[t].logprob, "bytes": list(piece.encode()),
                        "top_logprobs": [{"token": self._piece(lp.token_id), "logprob": lp.logprob,
                                          "bytes": list(self._piece(lp.token_id).encode())} for lp in _top(entry)]})
      return {"content": content}
    pieces = [self._piece(t) for t in ids]
    offsets, at = [], 0 if start == 0 else self._offsets[index]
    for piece in pieces:
      offsets.append(at)
      at += len(piece)
    if index is not None:
      self._offsets[index] = at
    return {"tokens": pieces, "token_logprobs": [entry[t].logprob for t, entry in zip(ids, entries)],
            "top_logprobs": [{self._piece(lp.token_id): lp.logprob for lp in _top(entry)}
                             for t, entry in zip(ids, entries)],
            "text_offset": offsets}


def _top(entry: dict) -> list:
  """The top-N alternatives of one position, best first (the chosen token has no rank unless it is among them)."""
  return sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
