"""The OpenAI-compatible server, driven by the official `openai` client and raw HTTP over 127.0.0.1.

One server over the session's embedded model (warmed up once) serves every test here; the last
test starts `jaxgen serve` as a process of its own and stops it with SIGTERM under load. The load
test and the faults run over a tiny model in test_serve_faults.py (they exercise the server, not
the model); chat, which needs the real model's template, is tested here.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jsonschema
import openai
import pytest
import uvicorn
from conftest import DATA, ToyTokenizer, tiny_config, tiny_model
from jaxgen import SamplingParams
from jaxgen.decode.engine import Engine
from jaxgen.decode.outputs import (
  CompletionOutput,
  Logprob,
  RequestMetrics,
  RequestOutput,
)
from jaxgen.serve import create_app
from jaxgen.serve.loop import EngineLoop
from jaxgen.serve.protocol import Responder

pytestmark = pytest.mark.slow
KEY = "test-key"
NAME = "gemma-test"


class ThreadServer:
  """uvicorn serving `app` on a free port of 127.0.0.1, on a thread of this process.

  sndbuf: the kernel's send buffer of each connection, in bytes (default: its own, which grows to
  megabytes), so that a test can make a client that stops reading hold up the server's writes.
  """

  def __init__(self, app, sndbuf: int | None = None):
    sock = socket.socket()
    if sndbuf is not None:  # connections inherit the listening socket's buffers
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
    self.thread.start()

  def stop(self):
    self.server.should_exit = True
    self.thread.join(120)


def wait_healthy(url: str, timeout: float) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      if httpx.get(f"{url}/health", timeout=5).status_code == 200:
        return
    except httpx.TransportError:
      pass
    time.sleep(0.2)
  raise TimeoutError(f"{url}/health did not answer 200 within {timeout} s")


@pytest.fixture(scope="module")
def server(llm):
  app = create_app(llm, model_name=NAME, max_queue=64, request_timeout=120, api_key=KEY)
  srv = ThreadServer(app)
  wait_healthy(srv.url, 600)
  srv.app, srv.loop = app, app.state.loop
  yield srv
  srv.stop()
  assert not srv.loop._thread.is_alive()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


def post(server, path: str, body, key: str | None = KEY, timeout: float = 300) -> httpx.Response:
  headers = {"Authorization": f"Bearer {key}"} if key else {}
  content = body if isinstance(body, (str, bytes)) else json.dumps(body)
  return httpx.post(f"{server.url}{path}", content=content, headers={**headers, "content-type": "application/json"},
                    timeout=timeout)


def metric(server, name: str, labels: str = "") -> float:
  text = httpx.get(f"{server.url}/metrics").text
  m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
  return float(m.group(1)) if m else 0.0


def settled(server, timeout: float = 30.0) -> None:
  """Waits until the loop holds no request; every slot of the engine is then free."""
  deadline = time.monotonic() + timeout
  while server.loop.unfinished and time.monotonic() < deadline:
    time.sleep(0.05)
  assert server.loop.unfinished == 0
  time.sleep(0.2)  # the loop's last step
  assert all(s is None for s in server.loop.engine.scheduler.slots)


# ------------------------------------------------------------------------------------ the client
def test_completions_match_the_reference_greedy_tokens(server, client, golden, llm):
  g = golden["english"]
  want = llm.tokenizer.decode([int(t) for t in g["greedy_ids"][:8]], skip_special_tokens=True)
  assert [m.id for m in client.models.list().data] == [NAME]
  out = client.completions.create(model=NAME, prompt=[int(t) for t in g["ids"]], max_tokens=8, temperature=0)
  assert out.choices[0].text == want and out.choices[0].finish_reason == "length"
  assert out.usage.prompt_tokens == len(g["ids"]) and out.usage.completion_tokens == 8
  chunks = list(client.completions.create(model=NAME, prompt=[int(t) for t in g["ids"]], max_tokens=8, temperature=0,
                                          stream=True, stream_options={"include_usage": True}))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == want
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_stop_logprobs_and_n(server, client):
  prompt = "The capital of France is"
  base = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
  word = base.split()[1]
  cut = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=[word]).choices[0]
  assert cut.finish_reason == "stop" and cut.text == base[:base.index(word)]

  lp = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=3).choices[0].logprobs
  assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
  for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
    assert len(top) == 3 and value <= 0 and value == pytest.approx(max(top.values()), abs=1e-5)  # greedy = the best
  assert "".join(lp.tokens) == base[:sum(len(t) for t in lp.tokens)]

  two = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=1.0, seed=5, n=2)
  assert sorted(c.index for c in two.choices) == [0, 1] and two.usage.completion_tokens == 12
  again = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=1.0, seed=5, n=2)
  assert [c.text for c in again.choices] == [c.text for c in two.choices]


def test_chat_streaming_and_logprobs(server, client):
  messages = [{"role": "user", "content": "Name a colour."}]
  whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                         logprobs=True, top_logprobs=2)
  choice = whole.choices[0]
  assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
  assert len(choice.logprobs.content) == whole.usage.completion_tokens
  assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
  chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
  assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_concurrent_seeded_requests_are_identical(server, client):
  results = [None, None]

  def ask(i):
    results[i] = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=0.9,
                                           top_p=0.95, seed=1234).choices[0].text

  threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert results[0] and results[0] == results[1]


# ------------------------------------------------------------------------------- bad requests
@pytest.mark.parametrize("body,param", [
    ('{"model": "gemma-test", "prompt": ', None),  # malformed JSON
    ({"model": "nope", "prompt": "hi"}, "model"),
    ({"model": NAME, "prompt": "hi", "top_p": 2}, "top_p"),
    ({"model": NAME, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"model": NAME, "prompt": [5] * 1600}, "prompt"),  # over max_len=1536
    ({"model": NAME, "prompt": [10**7]}, "prompt"),
    ({"model": NAME}, "prompt"),
])
def test_bad_requests_get_400_and_the_next_request_succeeds(server, body, param):
  r = post(server, "/v1/completions", body)
  assert r.status_code == 400, r.text
  err = r.json()["error"]
  assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param
  ok = post(server, "/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 2})
  assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def chat_body(**kw) -> dict:
  return {"model": NAME, "messages": [{"role": "user", "content": "Name a colour."}], **kw}


def test_chat_over_the_context_gets_vllms_400_and_max_completion_tokens_wins(server):
  r = post(server, "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "word " * 1600}]))
  assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
  assert r.json()["error"]["message"].startswith("This model's maximum context length is 1536 tokens. However, you "
                                                 "requested 16")
  r = post(server, "/v1/chat/completions", chat_body(max_tokens=2000))
  err = r.json()["error"]
  assert r.status_code == 400 and err["param"] == "max_tokens" and err["type"] == "invalid_request_error"
  m = re.fullmatch(r"This model's maximum context length is 1536 tokens\. However, you requested (\d+) tokens "
                   r"\((\d+) in the messages, 2000 in the completion\)\. Please reduce the length of the messages or "
                   r"completion\.", err["message"])
  assert m and int(m.group(1)) == int(m.group(2)) + 2000
  r = post(server, "/v1/chat/completions", chat_body(max_tokens=3, max_completion_tokens=2000))
  assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
  r = post(server, "/v1/chat/completions", chat_body(max_tokens=2000, max_completion_tokens=3))
  assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


PAINT = {"type": "function", "function": {"name": "paint", "description": "Paints a wall.", "parameters": {
    "type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                     "coats": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["colour", "coats"], "additionalProperties": False}}}
SIGN = {"type": "function", "function": {"name": "sign", "parameters": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}}}


@pytest.mark.parametrize("fields,param,message", [
    ({"tools": [PAINT]}, "tool_choice", "\"auto\" tool choice (the default with tools) requires "
     "--enable-auto-tool-choice and --tool-call-parser to be set"),
    ({"tools": [PAINT], "tool_choice": "auto"}, "tool_choice", "requires --enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "tools", "tools must be a non-empty list"),
    ({"tools": [PAINT], "tool_choice": {"type": "function", "function": {"name": "draw"}}}, "tool_choice",
     "one of ['paint']"),
    ({"tools": [PAINT], "tool_choice": "required", "stream": True}, "stream", "cannot stream yet"),
    ({"tools": [PAINT, {"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools", "tools[1] (say): function.parameters={'type': 'string'} must be a JSON"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "response_format and structured_outputs each constrain the output"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "give exactly one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "StructuredOutputsParams.json does not compile: "),
])
def test_chat_constraints_that_cannot_be_served_are_refused_by_name(server, fields, param, message):
  r = post(server, "/v1/chat/completions", chat_body(max_tokens=2, **fields))
  assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
  assert message in r.json()["error"]["message"], r.text


def test_chat_tools_that_may_not_be_called_are_allowed(server):
  for fields in ({"tools": [PAINT], "tool_choice": "none"}, {"tool_choice": "none"}, {"tools": []},
                 {"response_format": {"type": "text"}}):
    r = post(server, "/v1/chat/completions", chat_body(max_tokens=2, **fields))
    assert r.status_code == 200, (fields, r.text)


def test_response_format_json_schema_through_the_openai_client(client):
  """OpenAI's json_schema response format, whole and streamed: content that validates."""
  schema = PAINT["function"]["parameters"]
  fmt = {"type": "json_schema", "json_schema": {"name": "paint", "schema": schema, "strict": True}}
  messages = [{"role": "user", "content": "Which colour should the wall be, and how many coats? Answer in JSON."}]
  out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=60, temperature=0,
                                       response_format=fmt)
  jsonschema.validate(json.loads(out.choices[0].message.content), schema)
  assert out.choices[0].finish_reason == "stop"
  chunks = client.chat.completions.create(model=NAME, messages=messages, max_tokens=60, temperature=0,
                                          response_format=fmt, stream=True)
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
  obj = client.completions.create(model=NAME, prompt="A JSON object:", max_tokens=80, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
  assert isinstance(json.loads(obj.choices[0].text), dict) and obj.choices[0].finish_reason == "stop"


def test_completions_take_vllms_structured_outputs(client):
  out = client.completions.create(model=NAME, prompt="The sky is", max_tokens=5, temperature=0.9, seed=3, n=3,
                                  extra_body={"structured_outputs": {"choice": ["blue", "grey", "dark"]}})
  assert len(out.choices) == 3 and all(c.text in ("blue", "grey", "dark") for c in out.choices)
  out = client.completions.create(model=NAME, prompt="Year:", max_tokens=10, temperature=0,
                                  extra_body={"guided_regex": r"(19|20)\d\d"})
  assert re.fullmatch(r"(19|20)\d\d", out.choices[0].text) and out.choices[0].finish_reason == "stop"


def test_a_named_or_required_tool_call_comes_back_as_tool_calls(client):
  messages = [{"role": "user", "content": "Paint the kitchen wall red, two coats."}]
  out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=60, temperature=0,
                                       tools=[PAINT, SIGN], tool_choice={"type": "function",
                                                                         "function": {"name": "paint"}})
  (call,) = out.choices[0].message.tool_calls
  assert call.type == "function" and call.function.name == "paint" and call.id.startswith("call_")
  jsonschema.validate(json.loads(call.function.arguments), PAINT["function"]["parameters"])
  assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content is None
  chunks = [c for c in client.chat.completions.create(
      model=NAME, messages=messages, max_tokens=60, temperature=0, tools=[PAINT, SIGN], stream=True,
      tool_choice={"type": "function", "function": {"name": "paint"}}) if c.choices]
  first = chunks[0].choices[0].delta.tool_calls[0]
  assert first.id.startswith("call_") and first.function.name == "paint"
  streamed = "".join(d.function.arguments for c in chunks for d in (c.choices[0].delta.tool_calls or []))
  assert streamed == call.function.arguments and chunks[-1].choices[0].finish_reason == "stop"
  out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=120, temperature=0,
                                       tools=[PAINT, SIGN], tool_choice="required")
  calls = out.choices[0].message.tool_calls
  assert calls and out.choices[0].finish_reason == "tool_calls"
  for call in calls:
    tool = {"paint": PAINT, "sign": SIGN}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_api_key_is_required(server):
  for key in (None, "wrong"):
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "hi"}, key=key)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
  assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open


def test_timeout_aborts_and_returns_what_was_made(server):
  server.app.state.request_timeout = 0.5
  try:
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 1000,
                                         "ignore_eos": True})
  finally:
    server.app.state.request_timeout = 120
  choice = r.json()["choices"][0]
  assert r.status_code == 200 and choice["finish_reason"] == "abort" and 0 < r.json()["usage"]["completion_tokens"] < 1000
  settled(server)


def test_a_non_streaming_client_that_leaves_frees_its_slot(server):
  """Updates arrive every step, so the disconnect check must not wait for a quiet second."""
  body = {"model": NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 1000, "ignore_eos": True}
  aborted = metric(server, "jaxgen_requests_total", '{finish_reason="abort"}')
  with pytest.raises(httpx.TimeoutException):
    post(server, "/v1/completions", body, timeout=1.5)
  settled(server, timeout=20)  # long before 1000 tokens
  assert metric(server, "jaxgen_requests_total", '{finish_reason="abort"}') == aborted + 1


# ----------------------------------------------------------------------------------- load
def test_a_full_queue_answers_429_and_loses_nothing(server):
  async def main():
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                                 limits=httpx.Limits(max_connections=200)) as http:
      body = {"model": NAME, "prompt": "Hello there", "max_tokens": 3, "temperature": 0}
      return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(120)))

  rs = asyncio.run(main())
  codes = [r.status_code for r in rs]
  assert set(codes) == {200, 429} and codes.count(429) >= 120 - server.loop.capacity
  assert all(r.json()["error"]["code"] == "queue_full" for r in rs if r.status_code == 429)
  texts = {r.json()["choices"][0]["text"] for r in rs if r.status_code == 200}
  assert len(texts) == 1 and all(r.json()["usage"]["completion_tokens"] == 3 for r in rs if r.status_code == 200)
  assert metric(server, "jaxgen_requests_rejected_total", '{status="429"}') == codes.count(429)
  settled(server)


def test_64_concurrent_requests_over_8_schemas_each_get_their_own(server):
  """64 requests at once through the official AsyncOpenAI client over eight JSON schemas, sampled
  at temperature 1.0 with their own seeds, streamed and not, every eighth client leaving after its
  first chunk: each answer validates against its own schema (a grammar state shared between
  requests would break another's), every request finishes once, no slot stays held and nothing
  compiles."""
  # Short answers (the validity set's longer schemas run in test_structured and the benchmark):
  # three of tests/data/structured_schemas.json and five small ones.
  data = json.loads((DATA / "structured_schemas.json").read_text())
  cases = [(data[name]["prompt"], data[name]["schema"]) for name in ("person", "tags", "config")]
  cases += [("A yes or no flag as JSON:", {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                             "required": ["ok"], "additionalProperties": False}),
            ("Two small numbers as JSON:", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "minItems": 2, "maxItems": 2}),
            ("A product code as JSON:", {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}),
            ("A level as JSON:", {"enum": ["low", "mid", "high"]}),
            ("A colour as JSON:", {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                                   "required": ["colour"], "additionalProperties": False})]
  def finished():
    return sum(metric(server, "jaxgen_requests_total", f'{{finish_reason="{r}"}}') for r in ("stop", "length", "abort"))

  finished_before = finished()

  async def one(client, i):
    prompt, schema = cases[i % 8]
    body = dict(model=NAME, prompt=prompt, max_tokens=200, temperature=1.0, seed=i,
                extra_body={"structured_outputs": {"json": schema}})
    if i % 8 == 7:  # leaves after its first chunk
      chunks = await client.completions.create(**body, stream=True)
      async for _ in chunks:
        break
      await chunks.close()
      return None
    if i % 2:
      text = "".join([c.choices[0].text async for c in await client.completions.create(**body, stream=True)])
    else:
      text = (await client.completions.create(**body)).choices[0].text
    jsonschema.validate(json.loads(text), schema)
    return text

  async def main():
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300) as client:
      return await asyncio.gather(*(one(client, i) for i in range(64)))

  results = asyncio.run(main())
  assert sum(r is not None for r in results) == 56
  settled(server)
  assert finished() - finished_before == 64
  assert metric(server, "jaxgen_compilations_after_warmup_total") == 0


def test_metrics_and_health(server):
  text = httpx.get(f"{server.url}/metrics").text
  for name in ("jaxgen_requests_total", "jaxgen_requests_waiting", "jaxgen_requests_running", "jaxgen_prompt_tokens_total",
               "jaxgen_generation_tokens_total", "jaxgen_time_per_output_token_seconds_bucket",
               "jaxgen_prefix_cache_hit_tokens_total", "jaxgen_kv_cache_usage_ratio"):
    assert name in text, name
  assert metric(server, "jaxgen_prefix_cache_hit_tokens_total") > 0  # the first test repeated its prompt


# -------------------------------------------------------------------------------------- SIGTERM
def test_sigterm_drains_running_requests_and_exits_0(tmp_path):
  env = dict(os.environ, JAXGEN_API_KEY="")
  proc = subprocess.Popen([sys.executable, "-m", "jaxgen.cli", "serve", "--port", "0", "--max-len", "128",
                           "--max-batch", "4", "--no-warmup", "--log-level", "warning",
                           "--compilation-cache", os.environ["JAX_COMPILATION_CACHE_DIR"]],
                          stderr=subprocess.PIPE, text=True, env=env)
  try:
    line = ""
    while "serving" not in line:
      line = proc.stderr.readline()
      assert line or proc.poll() is None, "the server exited before serving"
    url = re.search(r"http://\S+", line).group(0).rstrip(";")
    wait_healthy(url, 120)
    results, started = [], threading.Barrier(5)

    def ask():
      body = {"model": "gemma-3-270m", "prompt": "The sea is", "max_tokens": 24, "ignore_eos": True, "stream": True}
      with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        lines = r.iter_lines()
        first = next(lines)
        started.wait()
        rest = [first, *lines]
      reasons = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest if x.startswith("data: {")]
      results.append((reasons[-1], rest.count("data: [DONE]")))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
      t.start()
    started.wait(timeout=300)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
      t.join(300)
    assert results == [("length", 1)] * 4  # all four ran to the end after the signal
    assert proc.wait(60) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.stderr.close()


def test_the_waiting_gauge_counts_requests_not_inbox_commands():
  """`jaxgen_requests_waiting` counts requests: an n=3 submission is three, an abort none."""
  cfg = tiny_config()
  loop = EngineLoop(Engine(tiny_model(cfg), ToyTokenizer(cfg.vocab_size), max_batch=2, max_len=64), max_queue=4,
                    warmup=False)  # never started: the test applies the inbox itself
  rids = loop.submit([[5, 6], [7], [8, 9]], SamplingParams(max_tokens=2), lambda *a: None)
  loop.abort(["unknown"])
  assert loop.waiting == 3
  assert loop._take(block=False)  # handed to the engine, which has not stepped yet
  loop.snapshot = loop.engine.metrics()
  assert loop.waiting == 3 and len(rids) == 3


def test_streamed_text_offsets_continue_across_chunks():
  """A streamed completion's logprobs.text_offset continues from the previous chunk, and the
  chunks together give the offsets of the whole response."""
  class Pieces:  # token t decodes to t % 3 + 1 characters
    def decode(self, ids, skip_special_tokens=False):
      return "".join("ab"[t % 2] * (t % 3 + 1) for t in ids)

  ids = [4, 7, 5, 9, 3, 8, 6]
  c = CompletionOutput(0, logprobs=[])
  out = RequestOutput("r", None, [1], [c], RequestMetrics(0.0))
  stream = Responder("m", Pieces(), n=1, chat=False)
  streamed = []
  for upto in (2, 3, 7):
    c.token_ids = ids[:upto]
    c.logprobs = [{t: Logprob(t, -1.0, rank=1)} for t in c.token_ids]
    c.text = Pieces().decode(c.token_ids)
    (chunk,) = stream.chunks(0, out)
    streamed += chunk["choices"][0]["logprobs"]["text_offset"]
  whole = Responder("m", Pieces(), n=1, chat=False).whole([out])["choices"][0]["logprobs"]["text_offset"]
  assert streamed == whole == [0, 2, 4, 7, 8, 9, 12]


def test_hermes_tool_calls_are_parsed_from_an_auto_choice():
  """tool_choice="auto" with `--tool-call-parser hermes`: the model's `<tool_call>` blocks become
  tool_calls (finish_reason "tool_calls"), the text before them the content; text without a
  call, or with a block that does not parse, stays content."""
  said = ('Sure.\n<tool_call>\n{"name": "paint", "arguments": {"colour": "red", "coats": 2}}\n</tool_call>\n'
          '<tool_call>{"name": "sign", "arguments": {"name": "Al"}}</tool_call>')
  texts = [said, "No tool needed.", '<tool_call>{"name": "paint", "arguments": </tool_call>']
  outs = [RequestOutput(str(i), None, [1], [CompletionOutput(0, text, [5], finish_reason="stop")], RequestMetrics(0.0))
          for i, text in enumerate(texts)]
  choices = Responder("m", None, n=1, chat=True, tool="auto:hermes").whole(outs)["choices"]
  message = choices[0]["message"]
  assert message["content"] == "Sure." and choices[0]["finish_reason"] == "tool_calls"
  assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
      ("paint", {"colour": "red", "coats": 2}), ("sign", {"name": "Al"})]
  for choice, text in zip(choices[1:], texts[1:]):
    assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "stop"


def test_serve_refuses_auto_tool_choice_without_a_parser(capsys):
  from jaxgen import cli
  assert cli.main(["serve", "--enable-auto-tool-choice"]) == 2  # before any model loads
  assert "--enable-auto-tool-choice needs --tool-call-parser (one of hermes)" in capsys.readouterr().err
