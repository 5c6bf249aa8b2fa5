"""`jaxgen bench`: prefill and decode measured apart, against this device's own roofline.

Roofline: the memory bandwidth (a large on-device reduction: bytes read per second, the access
pattern of decode) and the matmul rate (a large square matmul in the weights' dtype and in
float32) are measured once. Then:
- prefill, batch 1, over prompt lengths: tokens/s and MFU = model FLOPs / time / matmul rate;
- decode at each number of running rows, all on one engine with as many slots as the largest:
  aggregate tokens/s, ms per step, and MBU = bytes a step must read (weights + the KV entries it
  attends over) / step time / bandwidth; then one row on a one-slot engine beside it (a step
  costs what its rows cost, not what the slots do);
- offline throughput: many requests through the engine (continuous batching), aggregate output
  tokens/s and its ratio to the batch-1 decode rate; HF transformers beside it when installed.
No figure blends the phases.

`--prefix` runs the prefix-caching scenarios instead, each with the cache off and on, side by side:
a shared 1,000-token prefix with 16 different 20-token questions submitted together (TTFT of
the first request, median TTFT of requests 2..16, wall time, prompt tokens prefilled), and a
5-turn chat in the model's template (TTFT of each turn).

`--speculative ngram:K` (or draft_model:K, or a JSON config) runs speculative decoding's scenarios
instead, batch 1, plain decode and speculation side by side: a prompt whose answer repeats its
input (rewrite a function with one change) and an ordinary one (decode tokens/s, TPOT,
acceptance, mean accepted length).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxgen.checkpoints.chat import chat_format
from jaxgen.checkpoints.source import default_model_path
from jaxgen.decode.buckets import bucket
from jaxgen.decode.engine import Engine
from jaxgen.decode.params import SamplingParams
from jaxgen.model import kv
from jaxgen.model.kernels.attention import KVBlock, cpu_chunk, kernel_takes
from jaxgen.model.config import LOCAL


def _timed(fn, *args, reps: int = 5) -> float:
  """Best-of-`reps` seconds of fn(*args) (after one warm-up call)."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t)
  return best


def roofline(dtype: str = "float32") -> dict:
  """Measured memory read bandwidth (bytes/s) and matmul rate (FLOP/s) of the default device."""
  # The fastest of three ways to stream 256 MiB (a column sum, a row sum, a matrix-vector
  # product): the ceiling is what the device can be made to read, not what one kernel reads.
  n = 256 * 1024 * 1024 // 4
  x = jnp.ones((n // 1024, 1024), jnp.float32)
  vec = jnp.ones((1024,), jnp.float32)
  bw = max(x.nbytes / _timed(jax.jit(fn), x, vec) for fn in
           (lambda a, _: jnp.sum(a, axis=0), lambda a, _: jnp.sum(a, axis=1), lambda a, u: a @ u))
  del x
  out = {"mem_bw": bw}
  for name in sorted({"float32", dtype}):
    # The formulation the model uses: 16-bit operands accumulate in float32.
    m = 2048
    a = jnp.ones((m, m), name)
    out[f"matmul_{name}"] = 2 * m**3 / _timed(
        jax.jit(lambda p, q: jax.lax.dot_general(p, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)), a, a)
  out["matmul"] = out[f"matmul_{dtype}"]
  return out


def model_bytes(llm) -> int:
  return sum(int(x.nbytes) for x in jax.tree.leaves(llm.engine.runner.params))


def prefill_flops(cfg, t: int) -> float:
  """Matmul FLOPs of prefilling t tokens (weights, attention over the causal/windowed prefix, and
  the logits of the last position)."""
  d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  per_tok = 2 * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f) * cfg.num_layers
  attn = 0
  for kind in cfg.layer_kinds:
    w = cfg.sliding_window if kind == LOCAL and cfg.sliding_window else t
    pairs = sum(min(i + 1, w) for i in range(t))  # (query, visible key) pairs
    attn += 4 * n * h * pairs  # q.k and p.v
  return per_tok * t + attn + 2 * cfg.vocab_size * d


def _bench_params(max_tokens: int) -> SamplingParams:
  return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt_ids(rng: np.random.Generator, shape, vocab_size: int) -> np.ndarray:
  """Random ordinary token ids (above the first specials, within any vocabulary) for timing."""
  return rng.integers(min(10, vocab_size - 1), min(1000, vocab_size), shape)


def _engine(llm, slots: int) -> Engine:
  return Engine(llm.model, llm.tokenizer, max_batch=slots, max_len=llm.max_len, platform=llm.platform)


def _fill(engine: Engine, rows: int, prompt_len: int) -> Engine:
  """Runs `rows` requests of random prompts until every one is prefilled and decoding."""
  rng = np.random.default_rng(0)
  for _ in range(rows):
    engine.add_request(prompt_ids(rng, prompt_len, engine.cfg.vocab_size).tolist(),
                       _bench_params(engine.max_len - prompt_len - 1))
  while engine.metrics()["running"] < rows:
    engine.step()
  return engine


def bench_prefill(llm, lengths, roof) -> list[dict]:
  eng = llm.engine
  rows = []
  for t in lengths:
    if t >= eng.max_len:
      continue
    tokens = prompt_ids(np.random.default_rng(t), t, llm.cfg.vocab_size).astype(np.int32)
    run = functools.partial(eng.runner.prefill_prompt, tokens)  # chunked as the engine chunks prompts

    sec = _timed(run, reps=3)
    flops = prefill_flops(llm.cfg, t)
    rows.append(dict(prompt_len=t, seconds=sec, tok_s=t / sec, mfu=flops / sec / roof["matmul"]))
  return rows


def kv_bytes_read(cache, length: int, platform, rows: int | None = None) -> int:
  """KV bytes a decode step over the first `rows` rows (default: all) reads when each holds `length` tokens.

  The CPU kernel reads just the filled entries of a float32 cache; XLA:CPU's chunked loop reads
  whole chunks of `cpu_chunk` entries up to the filled length; the plain formulation reads every
  entry of every layer.
  """
  total = 0
  for layer in cache.layers:
    b, kh, size, h = layer.k.shape
    if platform.attention == "xla":
      entries = size
    else:
      # The kernel's own rule, asked of a one-token query of the platform's activations.
      q = jax.ShapeDtypeStruct((b, 1, kh, h), platform.compute_dtype(layer.k.dtype))
      kernel = platform.attention == "cpu" and kernel_takes(q, KVBlock(layer.k, layer.v, None, limit=0))
      c = 1 if kernel else min(cpu_chunk(b * kh, 1), size)
      entries = min(-(-min(length, kv.capacity(layer)) // c) * c, size)
    held = layer.k.nbytes + layer.v.nbytes + (layer.k_scale.nbytes + layer.v_scale.nbytes if layer.quantized else 0)
    total += int(held) * (rows or b) * entries // (size * b)
  return total


def _decode_rate(eng: Engine, rows: int, steps: int, weights: int, context: int, roof) -> dict:
  step_rows = bucket(rows, eng.config.row_buckets)

  def run():
    for _ in range(steps):
      out = eng.runner.decode_rows(rows)
    return out

  sec = _timed(run, reps=3) / steps
  moved = weights + kv_bytes_read(eng.runner.state.cache, context + 2 * steps, eng.config.platform, step_rows)
  return dict(batch=rows, slots=eng.config.max_batch, step_rows=step_rows, step_ms=sec * 1e3, tok_s=rows / sec,
              mbu=moved / sec / roof["mem_bw"], bytes_per_step=moved)


def bench_decode(llm, batches, context: int, steps: int, roof) -> list[dict]:
  """Decode at each number of running rows on one engine of max(batches) slots, then one row on a
  one-slot engine (the `slots_1` row): a step costs what its rows cost, not what the slots do."""
  weights = model_bytes(llm)
  eng = _fill(_engine(llm, max(batches)), max(batches), context)
  out = [_decode_rate(eng, b, steps, weights, context, roof) for b in batches]
  del eng
  out.append(_decode_rate(_fill(_engine(llm, 1), 1, context), 1, steps, weights, context, roof))
  return out


def bench_throughput(llm, n_requests: int, prompt_len: int, out_len: int, slots: int) -> dict:
  eng = _engine(llm, slots)
  eng.warmup()
  rng = np.random.default_rng(1)
  prompts = [prompt_ids(rng, prompt_len, llm.cfg.vocab_size).tolist() for _ in range(n_requests)]
  t = time.perf_counter()
  for p in prompts:
    eng.add_request(p, _bench_params(out_len))
  generated = 0
  while eng.has_unfinished():
    for out in eng.step():
      if out.finished:
        generated += sum(len(o.token_ids) for o in out.outputs)
  sec = time.perf_counter() - t
  m = eng.metrics()
  return dict(requests=n_requests, prompt_len=prompt_len, out_len=out_len, slots=slots, seconds=sec,
              out_tok_s=generated / sec, prefill_s=m["prefill_s"], decode_s=m["decode_s"])


def _prefix_engine(llm, slots: int, on: bool) -> Engine:
  eng = Engine(llm.model, llm.tokenizer, max_batch=slots, max_len=llm.max_len, platform=llm.platform,
               enable_prefix_caching=on)
  eng.warmup()
  return eng


def _serve(eng: Engine, prompts, params) -> tuple[list, float]:
  """All prompts submitted at once; (outputs in order, wall seconds)."""
  t = time.perf_counter()
  ids = [eng.add_request(p, params) for p in prompts]
  done = {}
  while eng.has_unfinished():
    for out in eng.step():
      if out.finished:
        done[out.request_id] = out
  return [done[i] for i in ids], time.perf_counter() - t


def bench_prefix(llm, prefix_len: int, questions: int, question_len: int, out_len: int) -> list[dict]:
  """A shared prefix + different questions, submitted together, with the cache off and on."""
  rng = np.random.default_rng(2)
  shared = prompt_ids(rng, prefix_len, llm.cfg.vocab_size).tolist()
  prompts = [shared + prompt_ids(rng, question_len, llm.cfg.vocab_size).tolist() for _ in range(questions)]
  rows = []
  for on in (False, True):
    eng = _prefix_engine(llm, questions, on)
    outs, wall = _serve(eng, prompts, _bench_params(out_len))
    ttft = [o.metrics.ttft_s for o in outs]
    m = eng.metrics()
    rows.append(dict(prefix_caching=on, requests=questions, prefix_len=prefix_len, question_len=question_len,
                     out_len=out_len, ttft_first_s=ttft[0], ttft_rest_median_s=float(np.median(ttft[1:])),
                     wall_s=wall, prefill_tokens=m["prefill_tokens"], prefill_s=m["prefill_s"], decode_s=m["decode_s"],
                     cached_tokens=sum(o.num_cached_tokens or 0 for o in outs)))
  rows[1]["ttft_rest_speedup"] = rows[0]["ttft_rest_median_s"] / rows[1]["ttft_rest_median_s"]
  rows[1]["wall_speedup"] = rows[0]["wall_s"] / rows[1]["wall_s"]
  return rows


CHAT_TURNS = ["Tell me about the river Danube in two sentences.", "Which countries does it flow through?",
              "How long is it compared with the Rhine?", "Name a city on its banks famous for music.",
              "Summarise our conversation in one line."]


def bench_chat(llm, out_len: int) -> list[dict]:
  """Five chat turns in the model's own template, each prompt the whole conversation so far."""
  fmt = chat_format(llm.tokenizer)
  params = SamplingParams(max_tokens=out_len, temperature=0.0, stop_token_ids=sorted(fmt.stop_ids))
  rows = []
  for on in (False, True):
    eng = _prefix_engine(llm, 1, on)
    conv, turns = [], []
    for text in CHAT_TURNS:
      conv.append({"role": "user", "content": text})
      (out,), _ = _serve(eng, [fmt.encode(llm.tokenizer, conv)], params)
      conv.append({"role": "assistant", "content": out.text})
      turns.append(dict(prompt_tokens=len(out.prompt_token_ids), cached_tokens=out.num_cached_tokens or 0,
                        ttft_s=out.metrics.ttft_s))
    rows.append(dict(prefix_caching=on, turns=turns, last_over_first=turns[-1]["ttft_s"] / turns[0]["ttft_s"]))
  return rows


SPEC_PROMPTS = {
    "repeats its input": "Rewrite this function so that it is called `total_price` instead of `f`; change "
                         "nothing else and print the whole function.\n\n```python\ndef f(items, tax_rate):\n"
                         "    subtotal = 0.0\n    for item in items:\n        price = item['price'] * "
                         "item['quantity']\n        if item.get('discount'):\n            price = price * "
                         "(1.0 - item['discount'])\n        subtotal += price\n    tax = subtotal * tax_rate\n"
                         "    return round(subtotal + tax, 2)\n```",
    "ordinary text": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
SPEC_RUNS = [("repeats its input", 0.0), ("ordinary text", 0.0), ("ordinary text", 0.8)]  # (prompt, temperature)


def bench_speculative(llm, spec: str, out_len: int) -> list[dict]:
  """Batch-1 decode with and without speculation on SPEC_RUNS (chat template; sampled runs seeded,
  so both give the same tokens)."""
  fmt = chat_format(llm.tokenizer)
  drafter = llm.engine.runner.drafter  # the draft `LLM(speculative_config=spec)` loaded, if the method uses one
  draft_model = None if drafter is None else nnx.merge(drafter.graphdef, drafter.params)
  rows = []
  for name, temperature in SPEC_RUNS:
    params = SamplingParams(max_tokens=out_len, temperature=temperature, seed=0, stop_token_ids=sorted(fmt.stop_ids))
    ids = fmt.encode(llm.tokenizer, [{"role": "user", "content": SPEC_PROMPTS[name]}])
    row = dict(prompt=name, temperature=temperature, prompt_tokens=len(ids), out_len=out_len)
    for config in (None, spec):
      eng = Engine(llm.model, llm.tokenizer, max_batch=1, max_len=llm.max_len, platform=llm.platform,
                   speculative_config=config, enable_prefix_caching=False, draft_model=config and draft_model)
      eng.warmup()
      (out,), _ = _serve(eng, [ids], params)
      m = eng.metrics()
      key = "spec" if config else "plain"
      row[key] = dict(decode_tok_s=(len(out.token_ids) - 1) / out.metrics.decode_s, tpot_ms=out.metrics.tpot_s * 1e3,
                      acceptance=m["spec_acceptance_rate"], mean_accepted_length=m["spec_mean_accepted_length"],
                      generated=len(out.token_ids), token_ids=out.token_ids)
    row["same_tokens"] = row["spec"].pop("token_ids") == row["plain"].pop("token_ids")
    row["speedup"] = row["spec"]["decode_tok_s"] / row["plain"]["decode_tok_s"]
    rows.append(row)
  return rows


def bench_hf(n_requests: int, prompt_len: int, out_len: int, batch: int, dtype: str) -> dict | None:
  """HF transformers' batched generate on the same GGUF, if the reference extra is installed."""
  try:
    import torch
    import transformers
  except ImportError:
    return None
  path = default_model_path()
  torch.set_num_threads(os.cpu_count() or 1)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype))
  rng = np.random.default_rng(1)
  prompts = torch.tensor(rng.integers(10, 1000, (n_requests, prompt_len)))
  t = time.perf_counter()
  for i in range(0, n_requests, batch):
    model.generate(prompts[i:i + batch], attention_mask=torch.ones_like(prompts[i:i + batch]),
                   max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False)
  sec = time.perf_counter() - t
  return dict(peer=f"transformers {transformers.__version__}", batch=batch, seconds=sec,
              out_tok_s=n_requests * out_len / sec)


def run(a, make_llm) -> int:
  """`jaxgen bench` with the parsed arguments; make_llm(a, max_batch) builds the LLM the options describe."""
  quick = a.quick
  lengths = [int(x) for x in a.prompt_lengths.split(",")]
  batches = [int(x) for x in a.batches.split(",")]
  a.max_len = max(max(lengths) + 64, a.context + 256, 512)
  if a.prefix:
    a.max_len = max(a.max_len, 2048)
  llm = make_llm(a, max_batch=1)
  info = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), cores=jax.device_count(),
              dtype=a.dtype, quantization=llm.cfg.weight_quant, cache_dtype=llm.platform.cache_dtype,
              weights_bytes=model_bytes(llm), model=llm.cfg.family, kernels=llm.platform.kernels)
  if a.speculative:
    report = dict(info=info, speculative=a.speculative, spec=bench_speculative(llm, a.speculative, 32 if quick else 160))
    print(json.dumps(report, indent=1)) if a.json else _print_spec(report)
    return 0
  if a.prefix:
    out_len = 8 if quick else 16
    prefix_len = min(1000, llm.max_len - 20 - out_len - 1)  # a small model's context may be shorter
    report = dict(info=info, prefix=bench_prefix(llm, prefix_len, 8 if quick else 16, 20, out_len),
                  chat=bench_chat(llm, 32 if quick else 64))
    print(json.dumps(report, indent=1)) if a.json else _print_prefix(report)
    return 0
  roof = roofline(a.dtype)
  report = dict(info=info, roofline=roof)
  report["prefill"] = bench_prefill(llm, lengths, roof)
  report["decode"] = bench_decode(llm, batches, context=a.context, steps=4 if quick else 16, roof=roof)
  if a.throughput:
    n, pl, ol, slots = (8, 64, 16, 4) if quick else (64, 256, 128, 16)
    report["throughput"] = bench_throughput(llm, n, pl, ol, slots)
    b1 = next((r["tok_s"] for r in report["decode"] if r["batch"] == 1), None)
    if b1:
      report["throughput"]["ratio_to_batch1_decode"] = report["throughput"]["out_tok_s"] / b1
    if a.peers:
      report["throughput"]["hf"] = bench_hf(n, pl, ol, slots, a.dtype)
  if a.json:
    print(json.dumps(report, indent=1))
  else:
    _print(report)
  return 0


def _print(r: dict) -> None:
  i, roof = r["info"], r["roofline"]
  weights = f"{i['quantization']} blocks (model {i['dtype']})" if i.get("quantization") else i["dtype"]
  print(f"device: {i['device']} ({i['backend']}), weights {weights} {i['weights_bytes'] / 1e6:.0f} MB, "
        f"KV cache {i.get('cache_dtype')}, kernels {i['kernels']}")
  print(f"roofline: memory {roof['mem_bw'] / 1e9:.1f} GB/s, matmul {roof['matmul'] / 1e9:.0f} GFLOP/s ({i['dtype']})")
  print("\nprefill (batch 1)      tokens   ms       tok/s   MFU")
  for p in r["prefill"]:
    print(f"                       {p['prompt_len']:6d} {p['seconds'] * 1e3:8.1f} {p['tok_s']:9.0f} {100 * p['mfu']:5.1f}%")
  print("\ndecode          rows  slots  ms/step  tok/s   MBU")
  for d in r["decode"]:
    print(f"               {d['batch']:5d} {d['slots']:6d} {d['step_ms']:8.1f} {d['tok_s']:8.1f} {100 * d['mbu']:5.1f}%")
  t = r.get("throughput")
  if t:
    print(f"\noffline throughput: {t['requests']} requests x (prompt {t['prompt_len']}, output {t['out_len']}), "
          f"{t['slots']} slots: {t['out_tok_s']:.1f} output tok/s "
          f"({t.get('ratio_to_batch1_decode', float('nan')):.1f}x batch-1 decode)")
    if t.get("hf"):
      h = t["hf"]
      print(f"  {h['peer']} generate, batch {h['batch']}: {h['out_tok_s']:.1f} output tok/s")


def _print_spec(r: dict) -> None:
  i = r["info"]
  print(f"device: {i['device']} ({i['backend']}), weights {i['dtype']}; speculative decoding {r['speculative']}, "
        "batch 1")
  print("  prompt (temperature)    tokens  plain tok/s   spec tok/s   speed-up   acceptance   mean accepted   same")
  for row in r["spec"]:
    p, s = row["plain"], row["spec"]
    acc = "-" if s["acceptance"] is None else f"{100 * s['acceptance']:.0f}%"
    mal = "-" if s["mean_accepted_length"] is None else f"{s['mean_accepted_length']:.2f}"
    name = f"{row['prompt']} ({row['temperature']:g})"
    print(f"  {name:<24}{p['generated']:6d} {p['decode_tok_s']:12.1f} {s['decode_tok_s']:12.1f} {row['speedup']:9.2f}x "
          f"{acc:>11} {mal:>14}   {row['same_tokens']}")


def _print_prefix(r: dict) -> None:
  i = r["info"]
  print(f"device: {i['device']} ({i['backend']}), weights {i['dtype']}, KV cache {i.get('cache_dtype')}")
  p = r["prefix"][0]
  print(f"\nshared prefix: {p['requests']} requests x ({p['prefix_len']}-token prefix + {p['question_len']}-token "
        f"question), {p['out_len']} output tokens each, submitted together")
  print("  prefix cache   TTFT first   TTFT 2..n (median)   wall     prompt tokens prefilled")
  for row in r["prefix"]:
    print(f"  {'on' if row['prefix_caching'] else 'off':<14}{row['ttft_first_s'] * 1e3:9.0f} ms"
          f"{row['ttft_rest_median_s'] * 1e3:14.0f} ms {row['wall_s']:11.2f} s {row['prefill_tokens']:10d}")
  on = r["prefix"][1]
  print(f"  with the cache: median TTFT of requests 2..n {on['ttft_rest_speedup']:.1f}x lower, "
        f"wall time {on['wall_speedup']:.2f}x lower")
  print("\nchat, 5 turns (TTFT per turn, ms; prompt tokens / reused)")
  for row in r["chat"]:
    cells = "  ".join(f"{t['ttft_s'] * 1e3:6.0f} ({t['prompt_tokens']}/{t['cached_tokens']})" for t in row["turns"])
    print(f"  cache {'on ' if row['prefix_caching'] else 'off'}  {cells}   turn 5 / turn 1: {row['last_over_first']:.2f}")


def add_arguments(p) -> None:
  """The bench options (the model options are added by the CLI)."""
  p.add_argument("--prompt-lengths", default="128,512,1024,2048")
  p.add_argument("--batches", default="1,4,16", help="running rows to time decode at (one engine of the largest)")
  p.add_argument("--context", type=int, default=128, help="tokens in each slot while decode is timed")
  p.add_argument("--prefill-chunk", type=int, default=None, help="largest prefill bucket (default: the platform's)")
  p.add_argument("--throughput", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--peers", action="store_true", help="also run HF transformers (needs the reference extra)")
  p.add_argument("--quick", action="store_true", help="fewer steps and a small throughput run")
  p.add_argument("--prefix", action="store_true",
                 help="run the prefix-caching scenarios instead (shared prefix, multi-turn chat), cache off and on")
  p.add_argument("--json", action="store_true")
