"""The HTTP server: OpenAI's API over one engine loop, on FastAPI and uvicorn.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both also as server-sent
events with `stream: true`), GET /health (200 once warm and serving, 503 otherwise), GET /metrics
(Prometheus).

Every request is checked and tokenized here (on a small thread pool: a long prompt must not stall
the event loop that every other client waits on), then submitted to the loop. As vLLM's server,
with OpenAI's error object: a bad request (a prompt plus max_tokens over the context included)
answers 400, a body over `max_body_bytes` 413, a full queue 429, a failed generation 500, a
draining or dead server 503; none disturbs anything running. A client that disconnects aborts its
requests (their slots free for the next step); a request that outlives `request_timeout` is
aborted and returns what it made, with finish_reason "abort". When the engine loop itself dies,
`run` stops the server and returns a non-zero exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jaxgen.checkpoints.chat import chat_format
from jaxgen.llm import LLM
from jaxgen.serve.loop import Closed, EngineLoop, QueueFull
from jaxgen.serve.metrics import Metrics
from jaxgen.serve.protocol import (
  ApiError,
  ChatRequest,
  CompletionRequest,
  Responder,
  check_context,
  invalid,
  output_constraint,
  sampling_params,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

EMBEDDED_NAME = "gemma-3-270m"  # what the embedded model is called when no --model is given
TOKENIZER_THREADS = 4  # prompts tokenized at once: a huge one leaves three threads to the rest
log = logging.getLogger("jaxgen.serve")


def create_app(llm: LLM, *, model_name: str = EMBEDDED_NAME, max_queue: int = 256, request_timeout: float = 600.0,
               api_key: str | None = None, warmup: bool = True, max_body_bytes: int = 16 * 2**20,
               tool_call_parser: str | None = None) -> FastAPI:
  """An app serving `llm` (its engine is owned by the app's loop while the app runs).

  max_queue: requests that may wait for a slot (beyond them: 429). request_timeout: seconds from
  arrival after which a request is aborted. api_key: when set, /v1 routes want
  `Authorization: Bearer <api_key>` (401 otherwise). warmup: compile everything before /health
  says ready. max_body_bytes: larger request bodies are refused with 413 (checked from
  Content-Length, and while reading a body sent without one). tool_call_parser: the model's
  tool-call format for tool_choice="auto" (`protocol.TOOL_CALL_PARSERS`; None refuses "auto").
  `llm` needs only `.engine`, `.tokenizer` and `.max_len`.
  """
  if request_timeout <= 0:
    raise ValueError(f"request_timeout={request_timeout} must be > 0 seconds")
  if max_body_bytes <= 0:
    raise ValueError(f"max_body_bytes={max_body_bytes} must be > 0")
  holder: dict = {}
  loop = EngineLoop(llm.engine, max_queue=max_queue, warmup=warmup,
                    on_finish=lambda out: holder["metrics"].on_finish(out))
  metrics = holder["metrics"] = Metrics(loop)
  try:
    fmt = chat_format(llm.tokenizer)
  except ValueError as e:  # chat needs a template; completions still work
    fmt, fmt_error = None, str(e)

  tokenizing = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="jaxgen-tokenize")

  async def off_loop(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(tokenizing, functools.partial(fn, *args))

  @contextlib.asynccontextmanager
  async def lifespan(app: FastAPI):
    loop.start()
    yield
    await asyncio.to_thread(loop.stop, 60)  # the join must not hold the event loop
    tokenizing.shutdown(wait=False, cancel_futures=True)

  app = FastAPI(title="jaxgen", lifespan=lifespan)
  app.state.loop, app.state.metrics, app.state.llm = loop, metrics, llm
  app.state.request_timeout = request_timeout  # read per request: may be changed while serving

  @app.exception_handler(ApiError)
  async def api_error(request: Request, e: ApiError):
    if e.status in (429, 503):
      metrics.rejected.labels(str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status)

  def authorize(request: Request) -> None:
    # A check in each /v1 route, not an HTTP middleware: Starlette's middleware wraps `receive`,
    # and a request behind it no longer learns that its client disconnected.
    if api_key:
      given = request.headers.get("authorization", "")
      if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)", None, "invalid_api_key")

  @app.get("/health")
  async def health():
    if loop.stopped.is_set():
      return JSONResponse({"status": "the engine loop stopped"}, status_code=503)
    if not loop.ready.is_set():
      return JSONResponse({"status": "warming up"}, status_code=503)
    if loop.closed:
      return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok"}

  @app.get("/metrics")
  async def prometheus():
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

  @app.get("/v1/models")
  async def models(request: Request):
    authorize(request)
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "jaxgen",
                                        "max_model_len": llm.max_len}]}

  @app.post("/v1/completions")
  async def completions(request: Request):
    authorize(request)
    req = await _parse(request, CompletionRequest, max_body_bytes)
    _check_model(req.model, model_name)
    constraint = output_constraint(req)
    if req.echo:
      raise ApiError(400, "echo=true is not supported", "echo")
    if req.suffix:
      raise ApiError(400, "suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
      raise ApiError(400, f"best_of={req.best_of} is not supported (only best_of == n)", "best_of")
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, constraint=constraint)
    prompts = await off_loop(_check_prompts, llm, _prompt_list(req.prompt), params, constraint)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await _run(request, prompts, params, Responder(model_name, llm.tokenizer, req.n, False, include_usage),
                      req.stream)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    authorize(request)
    req = await _parse(request, ChatRequest, max_body_bytes)
    _check_model(req.model, model_name)
    if fmt is None:
      raise ApiError(400, fmt_error, "messages")
    constraint = output_constraint(req, tool_call_parser)
    if req.top_logprobs is not None and not req.logprobs:
      raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    if req.max_completion_tokens is not None:  # OpenAI's newer name wins, as in vLLM
      max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
    else:
      max_tokens, field = req.max_tokens, "max_tokens"
    params = sampling_params(req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             stop_token_ids=fmt.stop_ids, constraint=constraint)
    messages = [m.plain() for m in req.messages]
    tool = "" if constraint is None else constraint.tool
    extra = {"tools": req.tools} if tool else {}  # the template shows the model its tools where it can

    def prepare() -> list[list[int]]:
      try:
        ids = fmt.encode(llm.tokenizer, messages, req.add_generation_prompt, **extra)
      except ValueError as e:  # the template refused the conversation
        raise ApiError(400, str(e), "messages") from None
      return [_check_prompt(llm, ids, params, "messages", field, constraint)]

    prompts = await off_loop(prepare)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await _run(request, prompts, params,
                      Responder(model_name, llm.tokenizer, req.n, True, include_usage, tool), req.stream)

  async def _run(request: Request, prompts: list[list[int]], params, responder: Responder, stream: bool):
    job = _Job(loop, prompts, params, deadline=time.monotonic() + app.state.request_timeout)
    if stream:
      return StreamingResponse(_events(job, responder), media_type="text/event-stream",
                               background=BackgroundTask(job.abort))
    finals: list = [None] * len(prompts)
    async for p, out in job.updates(request.is_disconnected):
      finals[p] = out
    if any(f is None for f in finals):  # the client left; nobody reads this
      return Response(status_code=499)
    return responder.whole(finals)

  return app


async def _events(job: "_Job", responder: Responder) -> AsyncIterator[str]:
  """Server-sent events: a chunk per update, the usage chunk when asked, then [DONE]."""
  finals: dict[int, object] = {}
  try:
    try:
      async for p, out in job.updates(None):
        if out.finished:
          finals[p] = out
        for chunk in responder.chunks(p, out):
          yield f"data: {json.dumps(chunk)}\n\n"
    except ApiError as e:  # the headers went out already: the error travels as an event
      yield f"data: {json.dumps(e.body())}\n\n"
      yield "data: [DONE]\n\n"
      return
    if responder.include_usage:
      yield f"data: {json.dumps(responder.usage_chunk([finals[p] for p in sorted(finals)]))}\n\n"
    yield "data: [DONE]\n\n"
  finally:
    job.abort()  # the client went away mid-stream (or all is done, and this changes nothing)


class _Job:
  """One HTTP request's engine requests; their updates come back to the event loop.

  Outputs are cumulative, so a job keeps only the newest of each prompt: a reader that falls
  behind (a client reading its stream slowly) holds one output per prompt, not one per step, and
  the engine loop never waits for it. A stream then sends what accumulated as one chunk.
  """

  def __init__(self, loop: EngineLoop, prompts: list[list[int]], params, deadline: float):
    self.loop, self.deadline, self.n = loop, deadline, len(prompts)
    self.latest: dict[int, object] = {}  # prompt index -> its newest output not yet yielded
    self.error: BaseException | None = None
    self.wake = asyncio.Event()
    self.finished: set[int] = set()
    aio = asyncio.get_running_loop()

    def sink(p, out, error):
      aio.call_soon_threadsafe(self._put, p, out, error)

    try:
      self.rids = loop.submit(prompts, params, sink)
    except QueueFull as e:
      raise ApiError(429, str(e), None, "queue_full") from None
    except Closed as e:
      raise ApiError(503, str(e), None, "shutting_down" if loop.error is None else "engine_dead") from None

  def _put(self, p: int, out, error: BaseException | None) -> None:
    if error is not None:
      self.error = self.error or error
    else:
      self.latest[p] = out
    self.wake.set()

  def abort(self) -> None:
    if len(self.finished) < self.n:
      self.loop.abort([r for p, r in enumerate(self.rids) if p not in self.finished])

  async def updates(self, disconnected: Callable | None) -> AsyncIterator[tuple[int, object]]:
    """(prompt index, output) per update until every request finished. A request past its deadline,
    or whose client is gone (`disconnected()` polled each second), is aborted: its last output says so."""
    aborted, polled = False, time.monotonic()
    while len(self.finished) < self.n:
      now = time.monotonic()
      if disconnected is not None and now - polled >= 1.0:  # time-based: updates may never pause
        polled = now
        if await disconnected():
          self.abort()
          return
      if not aborted and now >= self.deadline:
        self.abort()
        aborted = True
      if self.error is not None:
        self.abort()
        raise ApiError(500, f"generation failed: {type(self.error).__name__}: {self.error}", None,
                       "engine_dead" if self.loop.error is not None else None) from self.error
      if self.latest:
        ready, self.latest = self.latest, {}
        for p in sorted(ready):
          if ready[p].finished:
            self.finished.add(p)
          yield p, ready[p]
        continue
      self.wake.clear()  # nothing pending; `_put` runs on this event loop, so no wake-up is lost
      try:  # at least each second: a loop that stopped without a word must not leave this waiting
        await asyncio.wait_for(self.wake.wait(), timeout=1.0 if aborted else max(min(1.0, self.deadline - now), 0.0))
      except asyncio.TimeoutError:
        if self.loop.stopped.is_set() and not self.latest and self.error is None:
          raise ApiError(500, "the engine loop stopped", None, "engine_dead") from None


async def _parse(request: Request, model: type[pydantic.BaseModel], max_body_bytes: int):
  """The JSON body as `model`; 400 naming the first bad field, or saying the body is not UTF-8 JSON."""
  raw = await _read_body(request, max_body_bytes)
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ApiError(400, f"the request body is not valid UTF-8: byte {e.start} is {raw[e.start:e.start + 1]!r} "
                   "(JSON bodies are UTF-8)") from None
  try:
    body = json.loads(text)
  except ValueError as e:
    raise ApiError(400, f"the request body is not valid JSON: {e}") from None
  if not isinstance(body, dict):
    raise ApiError(400, "the request body must be a JSON object")
  try:
    return model.model_validate(body)
  except pydantic.ValidationError as e:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or None
    raise ApiError(400, f"{where}: {err['msg']} (got {err.get('input')!r})"[:500], where) from None


async def _read_body(request: Request, limit: int) -> bytes:
  """The body; 413 past `limit` bytes, at once from Content-Length, else as soon as the bytes read
  pass it (a chunked body declares no length), so a huge body is never held whole."""
  declared = request.headers.get("content-length", "")
  if declared.isdigit() and int(declared) > limit:
    raise ApiError(413, f"the request body has {int(declared)} bytes; the limit is max_body_bytes={limit}", None,
                   "request_too_large")
  body = bytearray()
  try:
    async for chunk in request.stream():
      body += chunk
      if len(body) > limit:
        raise ApiError(413, f"the request body has more than max_body_bytes={limit} bytes", None,
                       "request_too_large")
  except ClientDisconnect:  # nobody reads the answer; nothing was submitted
    raise ApiError(499, "the client left before sending the whole body") from None
  return bytes(body)


def _check_model(name: str | None, served: str) -> None:
  if name is not None and name != served:
    raise ApiError(400, f"model {name!r} is not served here; this server serves {served!r}", "model",
                   "model_not_found")


def _prompt_list(prompt) -> list:
  """OpenAI's prompt forms: a string, a list of strings, a list of token ids, a list of id lists."""
  if isinstance(prompt, str) or (prompt and all(isinstance(x, int) for x in prompt)):
    return [prompt]
  if not prompt:
    raise ApiError(400, "prompt is empty", "prompt")
  return list(prompt)


def _check_prompts(llm: LLM, prompts: list, params, constraint=None) -> list[list[int]]:
  """Each prompt's token ids (`_check_prompt`); an error names the prompt when there are several."""
  out = []
  for i, prompt in enumerate(prompts):
    try:
      out.append(_check_prompt(llm, prompt, params, constraint=constraint))
    except ApiError as e:
      if len(prompts) > 1:
        e.message = f"prompt {i}: {e.message}"
      raise
  return out


def _check_prompt(llm: LLM, prompt, params, what: str = "prompt", max_tokens_field: str = "max_tokens",
                  constraint=None) -> list[int]:
  """The prompt's token ids, checked as the engine will (ids, n <= slots, a constraint compiled)
  and against the context: prompt + max_tokens over max_len is a 400 here, where the engine would
  shorten max_tokens."""
  ids = llm.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
  check_context(len(ids), params.max_tokens, llm.max_len, what=what, max_tokens_field=max_tokens_field)
  try:
    return llm.engine.check_request(ids, params)[1]
  except ValueError as e:
    err = invalid(e, constraint)
    err.param = err.param or what
    raise err from None


def run(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
        on_bound: Callable[[str, int], None] | None = None) -> int:
  """Serves `app` until SIGINT/SIGTERM (then stops accepting and lets running requests finish) or
  until its engine loop dies (then stops at once). Returns the exit status: 0 after SIGINT/SIGTERM,
  1 when the engine loop died, 3 when the server could not start (uvicorn's code for it).

  port 0 takes a free port; on_bound(host, port) is told which before serving starts.
  """
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  if on_bound is not None:
    on_bound(host, sock.getsockname()[1])
  server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=None))
  previous = {}
  if threading.current_thread() is threading.main_thread():
    # uvicorn drains, then re-raises the signal it caught to the handler found before it: one that
    # does nothing lets a drained server return (and the process exit 0) instead of dying of it.
    for sig in (signal.SIGINT, signal.SIGTERM):
      previous[sig] = signal.signal(sig, lambda *_: None)
  loop: EngineLoop = app.state.loop
  done = threading.Event()
  threading.Thread(target=_exit_when_dead, args=(loop, server, done), name="jaxgen-loop-watch", daemon=True).start()
  try:
    server.run(sockets=[sock])
  finally:
    done.set()
    for sig, handler in previous.items():
      signal.signal(sig, handler)
  if loop.error is not None:
    return 1
  return 0 if server.started else 3


def _exit_when_dead(loop: EngineLoop, server: uvicorn.Server, done: threading.Event) -> None:
  """Stops `server` when the engine loop dies: a server that can only answer 503 should exit, so
  that whatever supervises it (systemd, Kubernetes) starts a new one."""
  while not done.is_set():
    if loop.stopped.wait(0.5):
      if loop.error is not None:
        log.error("the engine loop died (%s: %s); stopping the server", type(loop.error).__name__, loop.error)
        server.should_exit = True
      return
