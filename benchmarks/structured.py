"""Structured output on the embedded model: its decode cost, its compile time, and its validity.

1. Speed: 8 rows decoding, none constrained against half constrained (a JSON list of integers long
   enough to run to the token limit), in alternating rounds on one engine. The decode rate is the
   engine's own (decode tokens over decode seconds). The target is >= 0.85x.
2. Compile time of each schema in tests/data/structured_schemas.json, first compile (the
   vocabulary indexed before) and cached.
3. Validity: each schema sampled at temperature 1.0 with --seeds seeds, and a regex and a choice:
   every output must parse and validate (`jsonschema`, `re`).
4. With --speculative: constrained rows under prompt lookup (ngram:4), greedy, on a prompt whose
   examples it can copy: proposals checked against the grammar before verify (what jaxgen does)
   against constrained rows that do not propose (`structured.valid_prefix` patched to 0), and
   plain decoding.

  python benchmarks/structured.py [--dtype float32] [--rounds 3] [--tokens 96] [--seeds 100] [--speculative]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import time

import jsonschema
from jaxgen import LLM, SamplingParams
from jaxgen.decode import structured
from jaxgen.decode.engine import Engine
from jaxgen.decode.structured import StructuredOutputsParams as SO

CASES = json.loads((pathlib.Path(__file__).parent.parent / "tests/data/structured_schemas.json").read_text())
SCHEMAS = {name: case["schema"] for name, case in CASES.items()}
PROMPTS = {name: case["prompt"] for name, case in CASES.items()}
LONG_LIST = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 500}
REGEX = r"[A-Z][a-z]{2,9} [0-9]{1,3}(, [A-Z][a-z]{2,9} [0-9]{1,3}){0,3}"
CHOICES = ["north", "south", "east", "west"]


def decode_rate(llm: LLM, constrained: int, tokens: int) -> float:
  """Decode tok/s of 8 rows running `tokens` tokens each, `constrained` of them held to LONG_LIST."""
  engine = llm.engine
  for i in range(8):
    so = SO(json=LONG_LIST) if i < constrained else None
    engine.add_request(f"Count from {i}:", SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                                            structured_outputs=so))
  before = engine.metrics()
  while engine.has_unfinished():
    engine.step()
  after = engine.metrics()
  return (after["decode_tokens"] - before["decode_tokens"]) / (after["decode_s"] - before["decode_s"])


def validity(llm: LLM, seeds: int) -> dict:
  out = {}
  for name, schema in SCHEMAS.items():
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured_outputs=SO(json=schema))
              for s in range(seeds)]
    bad = 0
    for o in llm.generate([PROMPTS[name]] * seeds, params, use_tqdm=False):
      try:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
      except (json.JSONDecodeError, jsonschema.ValidationError):
        bad += 1
    out[name] = bad
  params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_outputs=SO(regex=REGEX))
            for s in range(seeds)]
  out["regex"] = sum(not re.fullmatch(REGEX, o.outputs[0].text)
                     for o in llm.generate(["Cities and their sizes:"] * seeds, params, use_tqdm=False))
  params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, structured_outputs=SO(choice=CHOICES))
            for s in range(seeds)]
  out["choice"] = sum(o.outputs[0].text not in CHOICES
                      for o in llm.generate(["Which way?"] * seeds, params, use_tqdm=False))
  return out


PEOPLE = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                     "city": {"type": "string", "maxLength": 12}},
    "required": ["name", "age", "city"], "additionalProperties": False}}
FEW_SHOT = ('People as JSON:\n[{"name": "Ann", "age": 31, "city": "Paris"}, {"name": "Bob", "age": 42, "city": '
            '"Rome"}, {"name": "Cy", "age": 25, "city": "Oslo"}]\nMore people as JSON:\n')


def speculative_rate(engine: Engine, rows: int) -> tuple[float, float]:
  """(decode tok/s, acceptance) of `rows` greedy requests held to PEOPLE on the few-shot prompt."""
  params = SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=SO(json=PEOPLE))
  before = engine.metrics()
  for i in range(rows):
    engine.add_request(FEW_SHOT + " " * i, params)
  while engine.has_unfinished():
    engine.step()
  after = engine.metrics()
  drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"] if after["speculative"] else 0
  accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"] if drafts else 0
  rate = (after["decode_tokens"] - before["decode_tokens"]) / (after["decode_s"] - before["decode_s"])
  return rate, accepted / drafts if drafts else 0.0


def compare_speculation(llm: LLM, rounds: int) -> None:
  spec = Engine(llm.model, llm.tokenizer, max_batch=8, max_len=1024, platform=llm.platform,
                speculative_config={"method": "ngram", "num_speculative_tokens": 4})
  spec.warmup()
  checked = structured.valid_prefix
  refused = lambda matcher, proposals: 0  # noqa: E731
  for r in range(rounds + 1):
    plain, _ = speculative_rate(llm.engine, 4)
    structured.valid_prefix = checked
    proposing, acceptance = speculative_rate(spec, 4)
    structured.valid_prefix = refused
    silent, _ = speculative_rate(spec, 4)
    structured.valid_prefix = checked
    if r:  # round 0 builds what the runs need
      print(f"round {r}: 4 constrained rows, plain {plain:.1f} tok/s; ngram:4 with checked proposals "
            f"{proposing:.1f} tok/s (acceptance {acceptance:.0%}); ngram:4, constrained rows not proposing "
            f"{silent:.1f} tok/s")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--tokens", type=int, default=96)
  ap.add_argument("--seeds", type=int, default=100)
  ap.add_argument("--speculative", action="store_true")
  a = ap.parse_args()
  llm = LLM(dtype=a.dtype, max_batch=8, max_len=1024)
  llm.warmup()
  if a.speculative:
    compare_speculation(llm, a.rounds)
    return

  grammars = structured.Grammars(llm.tokenizer, llm.cfg.vocab_size)
  t0 = time.perf_counter()
  grammars.compile(SO(regex="a"))
  print(f"vocabulary index (once per tokenizer): {time.perf_counter() - t0:.2f} s")
  for name, schema in SCHEMAS.items():
    t0 = time.perf_counter()
    grammars.compile(SO(json=schema))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars.compile(SO(json=schema))
    print(f"schema {name}: compile {first * 1e3:.2f} ms, cached {(time.perf_counter() - t0) * 1e6:.0f} us")

  decode_rate(llm, 4, 8)  # the masks' first programs and the vocabulary index, outside the rounds
  ratios = []
  for r in range(a.rounds):
    plain = decode_rate(llm, 0, a.tokens)
    half = decode_rate(llm, 4, a.tokens)
    ratios.append(half / plain)
    print(f"round {r}: 8 rows unconstrained {plain:.1f} tok/s, half constrained {half:.1f} tok/s, "
          f"ratio {half / plain:.3f}")
  print(f"{a.dtype}: 8 rows with 4 held to a JSON schema decode at {statistics.median(ratios):.3f}x the "
        f"unconstrained rate (median of {a.rounds} rounds)")

  t0 = time.perf_counter()
  bad = validity(llm, a.seeds)
  print(f"validity at temperature 1.0, {a.seeds} seeds each ({time.perf_counter() - t0:.0f} s): "
        + ", ".join(f"{k} {a.seeds - v}/{a.seeds}" for k, v in bad.items()))


if __name__ == "__main__":
  main()
