"""The `jaxgen` command: generate (default), chat, serve, bench, convert, info, plan.

`jaxgen` alone generates from a default prompt with the embedded Gemma 3 270M and prints the
phase report (prefill and decode apart, never one blended speed). Options given without a
subcommand go to `generate`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jaxgen import bench, info, plan, serve, targets
from jaxgen.checkpoints.chat import chat_format
from jaxgen.checkpoints.convert import convert
from jaxgen.decode import compiles
from jaxgen.decode.params import SamplingParams
from jaxgen.llm import DEFAULT_COMPILATION_CACHE, LLM
from jaxgen.model.platform import ATTENTION_CHOICES, CACHE_DTYPES, CHOICES, DTYPES
from jaxgen.sharding import distributed
from jaxgen.sharding.mesh import MeshConfig

DEFAULT_PROMPT = "The three most important ideas in computer science are"
BASE_MODEL_NOTE = ("the embedded Gemma 3 270M is a base model, not instruction-tuned: it continues text (asked a "
                   "question it may repeat it) rather than answering; chat with an instruction-tuned checkpoint "
                   "via --model (a GGUF file or HF directory of, e.g., gemma-3-270m-it)")


def model_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default=None, help="GGUF file, HF directory or orbax directory (default: embedded Gemma 3 270M)")
  p.add_argument("--dtype", default="float32", choices=DTYPES)
  p.add_argument("--max-len", type=int, default=2048, help="tokens per cache slot (prompt + output)")
  p.add_argument("--compilation-cache", default=os.environ.get("JAXGEN_COMPILATION_CACHE", DEFAULT_COMPILATION_CACHE),
                 help="JAX's persistent compilation cache directory ('' disables): a second start skips compiling")
  p.add_argument("--max-batch", type=int, default=1, help="cache slots decoded together")
  p.add_argument("--quantization", default=None, choices=["int8"],
                 help="store the projection and embedding weights int8 (a float32 scale per block of 32)")
  p.add_argument("--cache-dtype", default=None, choices=CACHE_DTYPES,
                 help="KV cache dtype (default: the platform's)")
  p.add_argument("--speculative", default=None, metavar="METHOD:K",
                 help="speculative decoding, K tokens verified in one step: ngram:K (prompt lookup), "
                      "draft_model:K (the model itself as draft), or vLLM's JSON speculative_config, e.g. "
                      "'{\"method\": \"draft_model\", \"model\": \"self\", \"draft_layers\": 6, "
                      "\"num_speculative_tokens\": 4}'")
  p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse the KV cache of earlier prompts")
  p.add_argument("--attention-impl", default="auto", choices=ATTENTION_CHOICES, help="attention kernel (see `jaxgen info`)")
  p.add_argument("--matmul-impl", default="auto", choices=CHOICES, help="matmul kernel (see `jaxgen info`)")
  p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                 help="split the model over devices: 'model' splits the weights, 'data' the slots; -1 = the rest")
  p.add_argument("--distributed", action="store_true",
                 help="join a multi-process run (jax.distributed); every process runs the same command")
  p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="with --distributed: process 0's address (leave out where JAX detects it: Cloud TPU, SLURM)")
  p.add_argument("--num-processes", type=int, default=None, help="with --distributed: number of processes")
  p.add_argument("--process-id", type=int, default=None, help="with --distributed: this process's rank")


def sampling_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--max-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-k", type=int, default=-1)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--min-p", type=float, default=0.0)
  p.add_argument("--seed", type=int, default=None)
  p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
  p.add_argument("--ignore-eos", action="store_true")


def sampling_params(a) -> SamplingParams:
  return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                        min_p=a.min_p, seed=a.seed, stop=a.stop, ignore_eos=a.ignore_eos)


def make_llm(a, max_batch: int | None = None) -> LLM:
  """The LLM the model options describe; a multi-process run without --mesh splits the weights."""
  mesh = MeshConfig.parse(a.mesh) if a.mesh else (MeshConfig(data=1) if a.distributed else None)
  return LLM(a.model, dtype=a.dtype, max_len=a.max_len, max_batch=max_batch or a.max_batch, mesh=mesh,
             compilation_cache_dir=a.compilation_cache or None, attention_impl=a.attention_impl,
             matmul_impl=a.matmul_impl, prefill_chunk=getattr(a, "prefill_chunk", None),
             quantization=a.quantization, cache_dtype=a.cache_dtype, speculative_config=a.speculative,
             enable_prefix_caching=not a.no_prefix_caching)


def phase_report(out, wall_s: float) -> str:
  """One line: TTFT, prefill tok/s, decode tok/s, share of wall time per phase, finish reason."""
  m = out.metrics
  prefill_s = m.ttft_s or 0.0
  decode_s = m.decode_s
  pre_tps = m.prompt_tokens / prefill_s if prefill_s else float("nan")
  dec_tps = (m.generated_tokens - 1) / decode_s if decode_s else float("nan")
  total = max(wall_s, 1e-9)
  return (f"[prefill] {m.prompt_tokens} tok, TTFT {prefill_s * 1e3:.0f} ms, {pre_tps:.0f} tok/s, "
          f"{100 * prefill_s / total:.0f}% of wall | [decode] {m.generated_tokens} tok, "
          f"{(m.tpot_s or float('nan')) * 1e3:.1f} ms/tok, {dec_tps:.1f} tok/s, {100 * decode_s / total:.0f}% of wall "
          f"| finish_reason={out.finish_reason}")


def programs_report(p: dict) -> str:
  """Where the programs' time went (outside the request metrics): a later start finds them in the
  persistent compilation cache and still traces and lowers them to look them up."""
  return (f"# programs: traced {p['trace_s']:.1f} s, lowered {p['lower_s']:.1f} s, compiled or loaded "
          f"{p['compile_s']:.1f} s ({p['cache_hits']} from the compilation cache, {p['cache_misses']} compiled)")


def cmd_generate(a) -> int:
  t0 = time.perf_counter()
  llm = make_llm(a)
  load_s = time.perf_counter() - t0
  main_process = distributed.is_main()
  if llm.plan is not None and main_process and not a.quiet:
    print(llm.plan, file=sys.stderr)
  warm_s = llm.warmup() if a.warmup else 0.0
  prompt = a.prompt if a.prompt is not None else DEFAULT_PROMPT
  params = sampling_params(a)
  start = time.perf_counter()
  if not main_process:  # multi-process: the others run the same programs and print nothing
    llm.generate(prompt, params, use_tqdm=False)
    return 0
  if a.json:
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    wall = time.perf_counter() - start
    print(json.dumps(dict(prompt=prompt, text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason,
                          metrics=out.metrics.as_dict(), load_s=load_s, warmup_s=warm_s, wall_s=wall,
                          dtype=a.dtype, quantization=llm.cfg.weight_quant, cache_dtype=llm.config.cache.dtype)))
    return 0
  if not a.quiet:
    spec = llm.config.cache
    t = llm.timings
    print(f"# loaded in {load_s:.1f} s (weights {t.get('read_s', 0):.1f} s, weight cache: {t.get('weight_cache')}; "
          f"placed {t.get('place_s', 0):.1f} s, tokenizer {t.get('tokenizer_s', 0):.1f} s), warm-up {warm_s:.1f} s; "
          f"KV cache "
          f"{spec.total_bytes(llm.cfg) / 2**20:.0f} MiB: {spec.bytes_per_slot(llm.cfg) / 2**20:.1f} MiB per slot, "
          f"{spec.bytes_per_token(llm.cfg) / 1024:.1f} KiB per token", file=sys.stderr)
  sys.stdout.write(prompt)
  stream = llm.stream(prompt, params)
  for delta in stream:
    sys.stdout.write(delta)
    sys.stdout.flush()
  wall = time.perf_counter() - start
  sys.stdout.write("\n")
  print(phase_report(stream.output, wall), file=sys.stderr)
  if not a.quiet:
    print(programs_report(compiles.phases()), file=sys.stderr)
  return 0


def cmd_chat(a) -> int:
  """Reads a line, streams the reply, repeats. /reset starts over, /exit (or Ctrl-D) quits."""
  template = None
  if a.chat_template:
    with open(a.chat_template, encoding="utf-8") as f:
      template = f.read()
  llm = make_llm(a, max_batch=1)
  fmt = chat_format(llm.tokenizer, template)
  params = sampling_params(a)
  params.stop_token_ids = sorted(set(params.stop_token_ids) | fmt.stop_ids)
  params.validate(llm.cfg.vocab_size)
  if fmt.note:
    print(f"# note: {fmt.note}", file=sys.stderr)
  if a.model is None:
    print(f"# note: {BASE_MODEL_NOTE}", file=sys.stderr)
  print(f"# loaded in {llm.load_s:.1f} s; /reset starts over, /exit or Ctrl-D quits", file=sys.stderr)
  opening = [{"role": "system", "content": a.system}] if a.system else []
  messages = list(opening)
  while True:
    try:
      line = input(">>> ")
    except (EOFError, KeyboardInterrupt):
      print()
      return 0
    command = line.strip()
    if not command:
      continue
    if command in ("/exit", "/quit"):
      return 0
    if command == "/reset":
      messages = list(opening)
      continue
    messages.append({"role": "user", "content": line})
    reply = []
    try:
      for delta in llm.stream(fmt.encode(llm.tokenizer, messages), params):
        sys.stdout.write(delta)
        sys.stdout.flush()
        reply.append(delta)
    except ValueError as e:  # the template refused the conversation, or it outgrew max_len
      print(f"jaxgen: error: {e}", file=sys.stderr)
      messages.pop()
      continue
    except KeyboardInterrupt:
      sys.stdout.write(" [interrupted]")
    print()
    messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(a) -> int:
  if a.enable_auto_tool_choice and a.tool_call_parser is None:
    raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                     f"{', '.join(sorted(serve.TOOL_CALL_PARSERS))})")
  if a.distributed:
    raise ValueError("serve does not run across several processes yet; use --mesh within one process")
  llm = make_llm(a)
  name = a.served_model_name or (os.path.basename(os.path.normpath(a.model)) if a.model else serve.EMBEDDED_NAME)
  app = serve.create_app(llm, model_name=name, max_queue=a.max_queue, request_timeout=a.request_timeout,
                         api_key=a.api_key or None, warmup=not a.no_warmup,
                         tool_call_parser=a.tool_call_parser if a.enable_auto_tool_choice else None)

  def bound(host, port):
    print(f"# jaxgen: serving {name!r} (OpenAI API under /v1) on http://{host}:{port}; /health says 200 once warm",
          file=sys.stderr, flush=True)

  return serve.run(app, a.host, a.port, on_bound=bound, log_level=a.log_level)


def cmd_convert(a) -> int:
  try:
    summary = convert(a.src, a.dst, dtype=a.dtype, show_progress=not a.quiet, quantization=a.quantize)
  except FileExistsError as e:
    raise ValueError(str(e)) from None
  print(summary)
  return 0


def cmd_plan(a) -> int:
  cfg, where = plan.model_config(a.model)
  mesh = MeshConfig.parse(a.mesh) if a.mesh else None
  only = None
  if a.programs:
    prefixes = tuple(p.strip() for p in a.programs.split(",") if p.strip())
    only = lambda name: name.startswith(prefixes)  # noqa: E731
  report = plan.plan(cfg, a.target, model_name=where, dtype=a.dtype, quantization=a.quantization,
                     cache_dtype=a.cache_dtype, max_batch=a.max_batch, max_len=a.max_len, mesh=mesh,
                     attention_impl=a.attention_impl, speculative_config=a.speculative,
                     prefix_caching=not a.no_prefix_caching, only=only)
  print(json.dumps(report.as_json(), indent=1) if a.json else report)
  return 0 if report.fits else 1


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxgen", description="JAX/XLA compiled LLM inference")
  sub = parser.add_subparsers(dest="command")
  g = sub.add_parser("generate", help="stream a completion and print the phase report")
  g.add_argument("prompt", nargs="?", default=None)
  model_args(g)
  sampling_args(g)
  g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
  g.add_argument("--warmup", action="store_true",
                 help="compile every program up front (default: only what this prompt needs, on first use)")
  g.add_argument("--quiet", action="store_true")
  g.set_defaults(func=cmd_generate)

  ch = sub.add_parser("chat", help="chat in the terminal, with the model's own chat template")
  model_args(ch)
  sampling_args(ch)
  ch.add_argument("--system", default=None, help="system message that opens the conversation")
  ch.add_argument("--chat-template", default=None, help="jinja file to use instead of the model's template")
  ch.set_defaults(func=cmd_chat, max_tokens=512)

  s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
                     description="Serves /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
                     "SIGTERM or Ctrl-C stops admitting, lets running requests finish, and exits 0.")
  model_args(s)
  s.add_argument("--host", default="127.0.0.1")
  s.add_argument("--port", type=int, default=8000, help="0 takes a free port (printed on stderr)")
  s.add_argument("--served-model-name", default=None, help="the name clients send as `model`")
  s.add_argument("--api-key", default=os.environ.get("JAXGEN_API_KEY"),
                 help="require `Authorization: Bearer KEY` (default: $JAXGEN_API_KEY; none: open)")
  s.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a slot; more get 429")
  s.add_argument("--request-timeout", type=float, default=600.0, help="seconds after which a request is aborted")
  s.add_argument("--no-warmup", action="store_true", help="compile on first use instead of before /health is 200")
  s.add_argument("--enable-auto-tool-choice", action="store_true",
                 help="tool_choice=\"auto\": the model decides, its calls parsed by --tool-call-parser")
  s.add_argument("--tool-call-parser", choices=sorted(serve.TOOL_CALL_PARSERS), default=None,
                 help="the model's tool-call format (hermes: <tool_call>{\"name\", \"arguments\"}</tool_call>)")
  s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
  s.set_defaults(func=cmd_serve, max_batch=8)

  c = sub.add_parser("convert", help="convert a GGUF file or Hugging Face directory to an orbax checkpoint",
                     description="Writes DST (which must not exist) only when the whole conversion succeeded.")
  c.add_argument("src", help="GGUF file, Hugging Face model directory or jaxgen orbax checkpoint")
  c.add_argument("dst", help="directory to create")
  c.add_argument("--dtype", default="float32", choices=DTYPES, help="parameter dtype in the checkpoint")
  c.add_argument("--quiet", action="store_true", help="no progress bar")
  c.add_argument("--quantize", default=None, choices=["int8"], help="write int8 weights with a float32 scale per block of 32")
  c.set_defaults(func=cmd_convert)

  b = sub.add_parser("bench", help="measure prefill and decode apart, against the roofline")
  model_args(b)
  bench.add_arguments(b)
  b.set_defaults(func=lambda a: bench.run(a, make_llm))

  pl = sub.add_parser("plan", help="compile every program for a TPU slice that is not here; HBM, bytes, FLOPs, "
                      "predicted rates", description="Builds the engine's programs from the model's configuration "
                      "alone (no weight is read) and compiles them with libtpu for --target. Exit status 1 when a "
                      "program fails to compile or does not fit in HBM.")
  pl.add_argument("--target", required=True, choices=sorted(targets.TARGETS), metavar="TARGET",
                  help=f"the slice: {', '.join(sorted(targets.TARGETS))}")
  pl.add_argument("--model", default=None, help=f"a preset ({', '.join(targets.MODELS)}), an HF config.json or "
                  "directory, or a GGUF file (default: the embedded Gemma 3 270M); only its shapes are read")
  pl.add_argument("--dtype", default="bfloat16", choices=DTYPES)
  pl.add_argument("--quantization", default=None, choices=["int8"])
  pl.add_argument("--cache-dtype", default=None, choices=CACHE_DTYPES, help="default: the weights' dtype")
  pl.add_argument("--max-batch", type=int, default=8, help="cache slots")
  pl.add_argument("--max-len", type=int, default=2048, help="tokens per slot")
  pl.add_argument("--mesh", default=None, metavar="data=D,model=M", help="default: every chip on 'model'")
  pl.add_argument("--attention-impl", default="auto", choices=ATTENTION_CHOICES)
  pl.add_argument("--speculative", default=None, metavar="METHOD:K", help="as for generate: adds the verify programs")
  pl.add_argument("--no-prefix-caching", action="store_true", help="leave out the prefix store and its programs")
  pl.add_argument("--programs", default=None, metavar="PREFIXES",
                  help="compile only the programs whose names start with one of these (e.g. 'decode,prefill_fresh')")
  pl.add_argument("--json", action="store_true", help="print one JSON object")
  pl.set_defaults(func=cmd_plan)

  i = sub.add_parser("info", help="versions, devices, and which kernel serves each op, and why")
  i.add_argument("--dtype", default="float32", choices=DTYPES)
  i.add_argument("--max-batch", type=int, default=8, help="slots, for the count of compiled programs")
  i.add_argument("--json", action="store_true")
  i.set_defaults(func=info.run)
  return parser


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
    argv = ["generate", *argv]
  a = parser.parse_args(argv)
  try:
    if getattr(a, "distributed", False):
      distributed.initialize(a.coordinator, a.num_processes, a.process_id)
    return a.func(a)
  except (ValueError, FileNotFoundError) as e:
    print(f"jaxgen: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
