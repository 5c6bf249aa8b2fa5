"""One request on an 8-slot engine against the same request on a 1-slot engine, side by side.

A decode step runs over the smallest power-of-two bucket of rows that holds the running requests,
so a lone request should decode as fast with 8 slots as with 1 (the target: >= 0.95x). Both
engines share one model; the rounds alternate so the machine's load moves both alike.

  python benchmarks/active_rows.py [--dtype bfloat16] [--rounds 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import statistics

from jaxgen import LLM, SamplingParams
from jaxgen.decode.engine import Engine


def decode_tok_s(engine: Engine, prompt: str, tokens: int) -> float:
  engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
  out = None
  while engine.has_unfinished():
    for o in engine.step():
      out = o
  return 1.0 / out.metrics.tpot_s


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--tokens", type=int, default=128)
  a = ap.parse_args()
  llm = LLM(dtype=a.dtype, max_batch=8, max_len=1024)
  one = Engine(llm.model, llm.tokenizer, max_batch=1, max_len=1024, platform=llm.platform)
  eight = llm.engine
  prompt = "The three most important ideas in computer science are"
  for eng in (one, eight):
    eng.warmup()
    decode_tok_s(eng, prompt, 8)
  ratios = []
  for r in range(a.rounds):
    s1 = decode_tok_s(one, prompt, a.tokens)
    s8 = decode_tok_s(eight, prompt, a.tokens)
    ratios.append(s8 / s1)
    print(f"round {r}: 1 slot {s1:.1f} tok/s, 8 slots {s8:.1f} tok/s, ratio {s8 / s1:.3f}")
  print(f"{a.dtype}: one request on 8 slots decodes at {statistics.median(ratios):.3f}x a 1-slot engine "
        f"(median of {a.rounds} rounds; {eight.metrics()['decode_rows']} rows per step on the 8-slot engine)")


if __name__ == "__main__":
  main()
