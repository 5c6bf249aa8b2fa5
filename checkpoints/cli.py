"""`jaxgen convert SRC DST` and `jaxgen chat`, registered with the `jaxgen` command (`decode/cli.py`)."""

from __future__ import annotations

import argparse
import sys

DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers, model_args, sampling_args) -> None:
  c = subparsers.add_parser("convert", help="convert a GGUF file or Hugging Face directory to an orbax checkpoint",
                            description="Writes DST (which must not exist) only when the whole conversion succeeded.")
  c.add_argument("src", help="GGUF file, Hugging Face model directory or jaxgen orbax checkpoint")
  c.add_argument("dst", help="directory to create")
  c.add_argument("--dtype", default="float32", choices=DTYPES, help="parameter dtype in the checkpoint")
  c.add_argument("--quiet", action="store_true", help="no progress bar")
  c.set_defaults(func=cmd_convert)

  ch = subparsers.add_parser("chat", help="chat in the terminal, with the model's own chat template")
  model_args(ch)
  sampling_args(ch)
  ch.add_argument("--system", default=None, help="system message that opens the conversation")
  ch.add_argument("--chat-template", default=None, help="jinja file to use instead of the model's template")
  ch.set_defaults(func=cmd_chat, max_tokens=512)


def cmd_convert(a: argparse.Namespace) -> int:
  from jaxgen.checkpoints.convert import convert

  try:
    summary = convert(a.src, a.dst, dtype=a.dtype, show_progress=not a.quiet)
  except FileExistsError as e:
    raise ValueError(str(e)) from None
  print(summary)
  return 0


def cmd_chat(a: argparse.Namespace) -> int:
  """Reads a line, streams the reply, repeats. /reset starts over, /exit (or Ctrl-D) quits."""
  from jaxgen import LLM
  from jaxgen.checkpoints.chat import chat_format
  from jaxgen.decode.cli import _params

  template = None
  if a.chat_template:
    with open(a.chat_template, encoding="utf-8") as f:
      template = f.read()
  llm = LLM(a.model, dtype=a.dtype, max_len=a.max_len, max_batch=1)
  fmt = chat_format(llm.tokenizer, template)
  params = _params(a)
  params.stop_token_ids = sorted(set(params.stop_token_ids) | fmt.stop_ids)
  params.validate(llm.cfg.vocab_size)
  if fmt.note:
    print(f"# note: {fmt.note}", file=sys.stderr)
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
