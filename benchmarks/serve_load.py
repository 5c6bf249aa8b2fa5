"""Load on the OpenAI-compatible server, the way vLLM's serving benchmark measures it.

For each request rate (Poisson arrivals; `inf` sends everything at once) it streams
`--num-requests` completions and reports, from the client's side: p50/p99 time to first token
(queue + prefill), p50/p99 time per output token (decode), and output tokens per second over the
run. Prefill and decode stay apart, as in every jaxgen report.

By default it starts `jaxgen serve`'s app in this process over the embedded model; `--url` points
it at any running OpenAI-compatible server instead (another engine, side by side).

  python benchmarks/serve_load.py [--dtype bfloat16] [--max-batch 8] [--rates 1,2,4,inf] [--json]
  python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import httpx
import numpy as np
import uvicorn

WORDS = ("the river carries cold water past old stone bridges while children count boats and traders "
         "argue about the price of salt fish bread wool copper and time").split()


def prompts(n: int, words: int, seed: int = 0) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, words)) for _ in range(n)]


async def one(http, model, prompt, max_tokens, t_send):
  """(ttft, tpot or None, output tokens, finish time) of one streamed completion."""
  body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
          "stream": True, "stream_options": {"include_usage": True}}
  first = last = None
  tokens = 0
  async with http.stream("POST", "/v1/completions", json=body) as r:
    r.raise_for_status()
    async for line in r.aiter_lines():
      if not line.startswith("data: {"):
        continue
      chunk = json.loads(line[6:])
      now = time.perf_counter()
      if chunk.get("usage"):
        tokens = chunk["usage"]["completion_tokens"]
      if chunk["choices"]:
        first = first or now
        last = now
  tpot = (last - first) / (tokens - 1) if tokens > 1 else None
  return first - t_send, tpot, tokens, last


async def run_rate(url, model, key, rate, texts, max_tokens, seed):
  rng = np.random.default_rng(seed)
  headers = {"Authorization": f"Bearer {key}"} if key else {}
  async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None,
                               limits=httpx.Limits(max_connections=len(texts))) as http:
    tasks, t0 = [], time.perf_counter()
    for text in texts:
      tasks.append(asyncio.create_task(one(http, model, text, max_tokens, time.perf_counter())))
      if rate != float("inf"):
        await asyncio.sleep(rng.exponential(1.0 / rate))
    results = await asyncio.gather(*tasks)
  ttft = [r[0] for r in results]
  tpot = [r[1] for r in results if r[1] is not None]
  tokens = sum(r[2] for r in results)
  wall = max(r[3] for r in results) - t0
  pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3  # noqa: E731
  return dict(rate=rate, requests=len(texts), ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99),
              tpot_p50_ms=pct(tpot, 50), tpot_p99_ms=pct(tpot, 99), output_tok_s=tokens / wall, wall_s=wall)


def start_local(a):
  """The jaxgen app on a free local port, on a thread; its URL and model name."""
  from jaxgen import LLM
  from jaxgen.serve import EMBEDDED_NAME, create_app

  llm = LLM(a.model, dtype=a.dtype, max_batch=a.max_batch, max_len=a.max_len, quantization=a.quantization)
  app = create_app(llm, model_name=EMBEDDED_NAME, max_queue=max(a.num_requests, 256))
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  url = f"http://127.0.0.1:{sock.getsockname()[1]}"
  server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
  threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
  while True:
    try:
      if httpx.get(f"{url}/health").status_code == 200:
        return url, EMBEDDED_NAME
    except httpx.TransportError:
      pass
    time.sleep(0.5)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--url", default=None, help="an OpenAI-compatible server (default: start jaxgen's here)")
  p.add_argument("--model", default=None, help="with --url: the served model name; else the model to load")
  p.add_argument("--api-key", default=None)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--quantization", default=None)
  p.add_argument("--max-batch", type=int, default=8)
  p.add_argument("--max-len", type=int, default=1024)
  p.add_argument("--rates", default="1,2,4,inf", help="requests per second, comma-separated; inf: all at once")
  p.add_argument("--num-requests", type=int, default=32, help="per rate")
  p.add_argument("--prompt-words", type=int, default=96)
  p.add_argument("--max-tokens", type=int, default=64)
  p.add_argument("--json", action="store_true")
  a = p.parse_args()
  url, model = (a.url, a.model) if a.url else start_local(a)
  warm = prompts(2, a.prompt_words, seed=99)
  asyncio.run(run_rate(url, model, a.api_key, float("inf"), warm, 4, 0))  # first contact, not measured
  rows = []
  for i, rate in enumerate(float(r) for r in a.rates.split(",")):
    texts = prompts(a.num_requests, a.prompt_words, seed=i + 1)  # new prompts: no prefix-cache hits across rates
    r = asyncio.run(run_rate(url, model, a.api_key, rate, texts, a.max_tokens, i))
    rows.append(r)
    if not a.json:
      print(f"rate {r['rate']:>5} req/s: TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms | "
            f"TPOT p50 {r['tpot_p50_ms']:.1f} ms p99 {r['tpot_p99_ms']:.1f} ms | {r['output_tok_s']:.0f} output tok/s",
            flush=True)
  if a.json:
    print(json.dumps(dict(url=url, model=model, dtype=a.dtype, max_batch=a.max_batch, rows=rows)))

if __name__ == "__main__":
  main()
