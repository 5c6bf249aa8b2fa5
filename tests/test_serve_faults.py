"""The server under load and faults, over a tiny random model: each test runs in seconds.

One warmed server (`tiny`) takes the load test and the faults it survives (a failed engine step,
timeouts, bad bodies, slow clients, slow tokenization); a test that breaks its server for good (a
dead engine loop, draining, warm-up) starts one of its own over a fresh engine that never compiles.
The tiny model has no chat template: chat is tested in test_serve.py, over the real model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from conftest import ToyTokenizer, tiny_config, tiny_model
from jaxgen.decode import compiles
from jaxgen.decode.engine import Engine
from jaxgen.serve import create_app, run
from test_serve import ThreadServer, metric, settled, wait_healthy

pytestmark = pytest.mark.slow
NAME = "tiny"
BODY_LIMIT = 64 * 1024


class Tok(ToyTokenizer):
  """The toy tokenizer as create_app meets it: no chat template and no Gemma turn markers."""

  chat_template = None

  def token_to_id(self, token: str) -> None:
    return None


class Tiny:
  """What create_app needs of an LLM: an engine, its tokenizer and max_len."""

  def __init__(self, engine: Engine):
    self.engine, self.tokenizer, self.max_len = engine, engine.tokenizer, engine.max_len


@pytest.fixture(scope="module")
def model():
  # test_prefix.py's shape of model and engine (rings of 32, prefix caching on): its programs
  # come from the session's compilation cache when both run.
  return tiny_model(tiny_config(sliding_window=32, max_context=1024), seed=3)


def fresh_engine(model) -> Engine:
  return Engine(model, Tok(model.cfg.vocab_size), max_batch=4, max_len=256, prefill_chunk=64, seed=0)


@pytest.fixture(scope="module")
def tiny(model):
  # 64 clients at once, and up to 64 more whose clients left but whose abort the loop has not yet
  # applied: all must fit max_batch + max_queue, or the load test would meet 429s of its own making.
  app = create_app(Tiny(fresh_engine(model)), model_name=NAME, max_queue=128, request_timeout=60,
                   max_body_bytes=BODY_LIMIT)
  srv = ThreadServer(app, sndbuf=16384)  # a client that stops reading holds up writes after ~100 KB
  wait_healthy(srv.url, 600)
  srv.app, srv.loop = app, app.state.loop
  yield srv
  srv.stop()


@contextlib.contextmanager
def serving(app):
  """`app` served on a thread until the block ends."""
  srv = ThreadServer(app)
  srv.app, srv.loop = app, app.state.loop
  deadline = time.monotonic() + 60
  while True:  # up: /health answers, whatever it says
    try:
      httpx.get(f"{srv.url}/health", timeout=5)
      break
    except httpx.TransportError:
      assert time.monotonic() < deadline, "the server did not come up"
      time.sleep(0.05)
  try:
    yield srv
  finally:
    srv.stop()


def post(srv, body, path="/v1/completions", timeout=30.0, **kw) -> httpx.Response:
  content = json.dumps(body) if isinstance(body, dict) else body  # bytes, text or an iterator of bytes
  return httpx.post(f"{srv.url}{path}", content=content, headers={"content-type": "application/json"},
                    timeout=timeout, **kw)


def events(lines) -> tuple[list[dict], int]:
  """Server-sent event lines -> (the JSON events, the count of [DONE])."""
  data = [x[6:] for x in lines if x.startswith("data: ")]
  return [json.loads(x) for x in data if x != "[DONE]"], data.count("[DONE]")


def stream(srv, body, timeout=30.0) -> tuple[int, list[dict], int]:
  with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
    return (r.status_code, *events(r.iter_lines()))


def assert_error(r: httpx.Response, status: int, kind: str, param=None, code=None) -> dict:
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"} and err["message"]
  assert err["type"] == kind and err["param"] == param
  if code is not None:
    assert err["code"] == code
  return err


# ------------------------------------------------------------------------------------------ load
def test_load_with_disconnects_completes_each_request_once(tiny, monkeypatch):
  """500 requests from the official async client, 64 at a time, streamed and not, one in ten
  leaving early: each finishes once in the engine, no slot leaks, nothing compiles, and every
  completed text is the greedy reference."""
  prompts = [f"Fact number {i} about the sea:" for i in range(8)]  # 29 tokens: a prefix-cache block each
  want = [post(tiny, {"model": NAME, "prompt": p, "max_tokens": 2 + i % 4, "temperature": 0}).json()["choices"][0]
          for i, p in enumerate(prompts)]
  finished_before = {r: metric(tiny, "jaxgen_requests_total", f'{{finish_reason="{r}"}}')
                     for r in ("stop", "length", "abort")}
  compiles_before = compiles.count()
  leave = set(np.random.default_rng(0).choice(500, 50, replace=False).tolist())
  submitted: set[int] = set()  # the seeds of requests the server handed to the loop
  real_submit = tiny.loop.submit

  def submit(prompt_ids, params, sink):
    rids = real_submit(prompt_ids, params, sink)
    submitted.add(params.seed)
    return rids

  monkeypatch.setattr(tiny.loop, "submit", submit)

  async def one(client, i):
    streamed, body = i % 2 == 0, {"model": NAME, "temperature": 0, "seed": i}
    if i in leave:  # long enough to be running when its client goes
      body.update(prompt=f"Leave {i}", max_tokens=60, extra_body={"ignore_eos": True})
    else:
      body.update(prompt=prompts[i % 8], max_tokens=2 + i % 8 % 4)
    if i in leave and streamed:
      chunks = await client.completions.create(**body, stream=True)
      async for _ in chunks:
        break
      await chunks.close()
      return None
    if i in leave:  # leaves once the server has its request: one it never read would never reach the engine
      task = asyncio.create_task(client.completions.create(**body))
      while i not in submitted and not task.done():
        await asyncio.sleep(0.002)
      task.cancel()
      with contextlib.suppress(asyncio.CancelledError):
        await task
      return None
    if streamed:
      text, reasons = "", []
      async for chunk in await client.completions.create(**body, stream=True):
        text += chunk.choices[0].text
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
      return text, reasons
    out = (await client.completions.create(**body)).choices[0]
    return out.text, [out.finish_reason]

  async def main():
    limit = asyncio.Semaphore(64)
    async with openai.AsyncOpenAI(base_url=f"{tiny.url}/v1", api_key="none", max_retries=0, timeout=60) as client:
      async def bounded(i):
        async with limit:
          return await one(client, i)
      return await asyncio.gather(*(bounded(i) for i in range(500)))

  results = asyncio.run(main())
  for i, res in enumerate(results):
    if i not in leave:
      assert res == (want[i % 8]["text"], [want[i % 8]["finish_reason"]]), i
  settled(tiny)
  finished = {r: metric(tiny, "jaxgen_requests_total", f'{{finish_reason="{r}"}}') for r in finished_before}
  assert sum(finished.values()) - sum(finished_before.values()) == 500  # each finished exactly once
  assert finished["abort"] > finished_before["abort"]  # some leavers were cut short
  assert compiles.count() == compiles_before  # nothing compiled under load
  assert metric(tiny, "jaxgen_compilations_after_warmup_total") == 0


# ------------------------------------------------------------------------------- engine failures
def test_a_failed_engine_step_answers_500_and_the_server_goes_on(tiny, monkeypatch):
  engine, real_step = tiny.loop.engine, tiny.loop.engine.step

  def fail_once():
    monkeypatch.setattr(engine, "step", real_step)
    raise RuntimeError("injected step failure")

  body = {"model": NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
  monkeypatch.setattr(engine, "step", fail_once)
  err = assert_error(post(tiny, body), 500, "server_error", code=500)
  assert "injected step failure" in err["message"]

  monkeypatch.setattr(engine, "step", fail_once)
  status, chunks, done = stream(tiny, body)  # the headers went out first: the error is an event
  assert status == 200 and done == 1 and len(chunks) == 1
  assert chunks[0]["error"]["type"] == "server_error" and "injected step failure" in chunks[0]["error"]["message"]

  ok = post(tiny, body)
  assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
  settled(tiny)


def test_a_streamed_request_past_its_timeout_ends_with_abort_then_done(tiny, monkeypatch):
  engine, real_step = tiny.loop.engine, tiny.loop.engine.step

  def slow_step():  # 200 tokens would take 4 s
    time.sleep(0.02)
    return real_step()

  monkeypatch.setattr(engine, "step", slow_step)
  tiny.app.state.request_timeout = 0.5
  try:
    status, chunks, done = stream(tiny, {"model": NAME, "prompt": "Count", "max_tokens": 200, "ignore_eos": True})
  finally:
    tiny.app.state.request_timeout = 60
  assert status == 200 and done == 1
  reasons = [c["choices"][0]["finish_reason"] for c in chunks]
  assert reasons[-1] == "abort" and reasons.count("abort") == 1 and set(reasons[:-1]) == {None}
  assert 0 < len("".join(c["choices"][0]["text"] for c in chunks)) < 200
  settled(tiny)


# ---------------------------------------------------------------------------------- bad bodies
@pytest.mark.parametrize("body,words", [
    (b'["a list"]', "JSON object"),
    (b'"a string"', "JSON object"),
    (b"42", "JSON object"),
    (b"null", "JSON object"),
    (b'{"model": "tiny", "prompt": "caf\xe9"}', "UTF-8"),  # Latin-1, not UTF-8
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "UTF-8"),
])
def test_bodies_that_are_not_utf8_json_objects_get_400(tiny, body, words):
  err = assert_error(post(tiny, body), 400, "invalid_request_error")
  assert words in err["message"]


def test_a_body_over_the_limit_gets_413_before_it_is_read_whole(tiny):
  host, port = tiny.url.removeprefix("http://").split(":")
  with socket.create_connection((host, int(port)), timeout=10) as raw:  # a gigabyte announced, none sent
    raw.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                "Content-Length: 1000000000\r\n\r\n".encode())
    assert raw.recv(65536).startswith(b"HTTP/1.1 413")
  prompt = "x" * (BODY_LIMIT + 1)
  declared = post(tiny, {"model": NAME, "prompt": prompt})  # Content-Length says it
  err = assert_error(declared, 413, "invalid_request_error", code="request_too_large")
  assert str(BODY_LIMIT) in err["message"]
  whole = json.dumps({"model": NAME, "prompt": prompt}).encode()
  chunked = post(tiny, (whole[i:i + 4096] for i in range(0, len(whole), 4096)))  # no length given
  assert "content-length" not in chunked.request.headers
  assert_error(chunked, 413, "invalid_request_error", code="request_too_large")
  padded = json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 1}).ljust(BODY_LIMIT)  # just fits
  assert post(tiny, padded).status_code == 200


# ---------------------------------------------------------------------------- context and fields
def test_a_prompt_plus_max_tokens_over_the_context_gets_vllms_400(tiny):
  err = assert_error(post(tiny, {"model": NAME, "prompt": [5] * 200, "max_tokens": 100}), 400,
                     "invalid_request_error", "max_tokens")
  assert err["message"] == ("This model's maximum context length is 256 tokens. However, you requested 300 tokens "
                            "(200 in the prompt, 100 in the completion). Please reduce the length of the prompt or "
                            "completion.")
  assert_error(post(tiny, {"model": NAME, "prompt": [5] * 256, "max_tokens": 1}), 400, "invalid_request_error",
               "prompt")
  err = assert_error(post(tiny, {"model": NAME, "prompt": ["Hi", "x" * 255]}), 400, "invalid_request_error", "prompt")
  assert err["message"].startswith("prompt 1: This model's maximum context length is 256 tokens")
  fits = post(tiny, {"model": NAME, "prompt": [5] * 200, "max_tokens": 56, "ignore_eos": True})
  assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 56
  rest = post(tiny, {"model": NAME, "prompt": [5] * 250, "max_tokens": None, "ignore_eos": True})
  assert rest.status_code == 200 and rest.json()["usage"]["completion_tokens"] == 6  # the room left


@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("structured_outputs", {"choice": ["a", "b"]}),
    ("guided_json", {"type": "object"}),
    ("guided_regex", "[a-z]+"),
    ("guided_choice", ["yes", "no"]),
    ("guided_grammar", "root ::= \"a\""),
])
def test_structured_output_without_a_vocabulary_is_refused_by_field(tiny, field, value):
  """The tiny model's toy tokenizer has no `tokenizers` vocabulary for a grammar engine to index:
  each way of asking for structured output is refused, naming the field, not ignored."""
  err = assert_error(post(tiny, {"model": NAME, "prompt": "Hi", "max_tokens": 1, field: value}), 400,
                     "invalid_request_error", field)
  assert "structured outputs need a `tokenizers` vocabulary" in err["message"], err
  for plain in (None, {"type": "text"}):
    assert post(tiny, {"model": NAME, "prompt": "Hi", "max_tokens": 1, "response_format": plain}).status_code == 200


# ------------------------------------------------------------------------------------ slow parts
def test_a_client_that_reads_slowly_holds_up_neither_the_engine_nor_others(tiny):
  """Its response waits in the server (uvicorn's write buffer fills, then the stream's newest
  outputs are kept, one per prompt), the engine finishes it meanwhile, and once read, it is whole."""
  body = json.dumps({"model": NAME, "prompt": "Slow", "max_tokens": 240, "n": 4, "logprobs": 5, "ignore_eos": True,
                     "temperature": 0, "stream": True})
  host, port = tiny.url.removeprefix("http://").split(":")
  slow = socket.socket()
  slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server must hold the rest
  slow.connect((host, int(port)))
  slow.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode())
  try:
    t0 = time.monotonic()
    while not tiny.loop.unfinished:  # submitted
      assert time.monotonic() - t0 < 10
      time.sleep(0.01)
    settled(tiny)  # then run to its end by the engine, unread
    other = post(tiny, {"model": NAME, "prompt": "Meanwhile", "max_tokens": 3})
    assert other.status_code == 200 and time.monotonic() - t0 < 20
    raw = b""
    while chunk := slow.recv(65536):
      raw += chunk
  finally:
    slow.close()
  head, _, rest = raw.partition(b"\r\n\r\n")
  assert head.startswith(b"HTTP/1.1 200")
  chunks, done = events(dechunk(rest).decode().splitlines())
  assert done == 1
  tokens = {i: 0 for i in range(4)}
  for c in chunks:
    choice = c["choices"][0]
    tokens[choice["index"]] += len(choice["logprobs"]["tokens"])
  assert tokens == {i: 240 for i in range(4)}
  assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 4
  assert len(chunks) < 4 * 240  # the reader fell behind: the server sent what piled up as fewer chunks


def dechunk(data: bytes) -> bytes:
  """The body of an HTTP/1.1 chunked transfer."""
  out = b""
  while True:
    size, _, data = data.partition(b"\r\n")
    n = int(size, 16)
    if n == 0:
      return out
    out, data = out + data[:n], data[n + 2:]


def test_a_slow_tokenization_leaves_the_event_loop_free(tiny, monkeypatch):
  tok = tiny.loop.engine.tokenizer
  real_encode, started = tok.encode, threading.Event()

  def encode(text, add_special_tokens=True):
    if text.startswith("HUGE"):  # as long as a very long prompt takes
      started.set()
      time.sleep(3)
    return real_encode(text, add_special_tokens)

  monkeypatch.setattr(tok, "encode", encode)
  huge: list = []
  worker = threading.Thread(target=lambda: huge.append(post(tiny, {"model": NAME, "prompt": "HUGE", "max_tokens": 2})))
  worker.start()
  assert started.wait(10)
  t0 = time.monotonic()
  assert httpx.get(f"{tiny.url}/health", timeout=10).status_code == 200
  other = post(tiny, {"model": NAME, "prompt": "Quick", "max_tokens": 2})
  assert other.status_code == 200 and time.monotonic() - t0 < 2  # not after the 3 s of tokenizing
  assert worker.is_alive()  # still tokenizing
  worker.join(30)
  assert huge[0].status_code == 200
  settled(tiny)


# --------------------------------------------------------------------- servers of their own
def test_health_is_503_while_warming_up(model, monkeypatch):
  engine, gate = fresh_engine(model), threading.Event()
  monkeypatch.setattr(engine, "warmup", lambda: gate.wait(60))
  with serving(create_app(Tiny(engine), model_name=NAME)) as srv:
    for _ in range(3):
      r = httpx.get(f"{srv.url}/health")
      assert r.status_code == 503 and r.json() == {"status": "warming up"}
      time.sleep(0.1)
    gate.set()
    wait_healthy(srv.url, 10)


def test_a_draining_server_answers_503_to_new_requests(model):
  with serving(create_app(Tiny(fresh_engine(model)), model_name=NAME, warmup=False)) as srv:
    wait_healthy(srv.url, 10)
    srv.loop.close()  # what SIGTERM does first
    r = httpx.get(f"{srv.url}/health")
    assert r.status_code == 503 and r.json() == {"status": "draining"}
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2}
    assert_error(post(srv, body, timeout=5), 503, "server_overloaded", code="shutting_down")
    assert_error(post(srv, {**body, "stream": True}, timeout=5), 503, "server_overloaded", code="shutting_down")
    assert metric(srv, "jaxgen_requests_rejected_total", '{status="503"}') == 2


def test_a_dead_engine_loop_fails_its_requests_and_answers_503(model):
  app, gate = create_app(Tiny(fresh_engine(model)), model_name=NAME, warmup=False), threading.Event()

  def take(block):  # the loop fails outside any step, with two requests submitted and not taken
    gate.wait(60)
    raise RuntimeError("injected loop failure")

  app.state.loop._take = take
  with serving(app) as srv:
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2}
    got: dict = {}
    threads = [threading.Thread(target=lambda: got.update(whole=post(srv, body))),
               threading.Thread(target=lambda: got.update(streamed=stream(srv, body)))]
    for t in threads:
      t.start()
    deadline = time.monotonic() + 10
    while srv.loop.unfinished < 2:
      assert time.monotonic() < deadline
      time.sleep(0.01)
    gate.set()
    for t in threads:
      t.join(10)
    err = assert_error(got["whole"], 500, "server_error", code="engine_dead")
    assert "injected loop failure" in err["message"]
    status, chunks, done = got["streamed"]
    assert status == 200 and done == 1 and "injected loop failure" in chunks[0]["error"]["message"]
    assert srv.loop.unfinished == 0

    r = httpx.get(f"{srv.url}/health")
    assert r.status_code == 503 and r.json() == {"status": "the engine loop stopped"}
    t0 = time.monotonic()
    err = assert_error(post(srv, body, timeout=5), 503, "server_overloaded", code="engine_dead")
    assert "injected loop failure" in err["message"] and "restarted" in err["message"]
    assert_error(post(srv, {**body, "stream": True}, timeout=5), 503, "server_overloaded", code="engine_dead")
    assert time.monotonic() - t0 < 2


def test_run_exits_1_when_the_engine_loop_dies(model):
  """`jaxgen serve` returns what `run` returns: a dead loop stops the server with status 1."""
  app = create_app(Tiny(fresh_engine(model)), model_name=NAME, warmup=False)
  bound = threading.Event()

  def take(block):
    assert bound.wait(60)
    time.sleep(0.5)  # uvicorn is serving by now
    raise RuntimeError("injected loop failure")

  app.state.loop._take = take
  status: list = []
  server = threading.Thread(target=lambda: status.append(run(app, "127.0.0.1", 0, log_level="warning",
                                                             on_bound=lambda *_: bound.set())))
  server.start()
  server.join(30)
  assert not server.is_alive() and status == [1]
