"""Start-up as a new user meets it: seconds from the command to the first token, and peak memory.

Each run is a fresh Python process that imports jaxgen, builds `LLM()` on the embedded model and
streams 8 tokens. "fresh" runs with an empty home directory (no weight cache, no compilation
cache, the model's parts not yet assembled: a first start after `pip install`); "later" runs
reuse that home, as every later start, notebook kernel restart or CLI call does. Reported per
run: first token after the process was launched, `LLM()` construction, its phases
(`LLM.timings`), the programs' tracing, lowering and compilation (or load from the persistent
cache) until the first token (`jaxgen.decode.compiles`), and peak resident memory against the
weights' bytes.

  python benchmarks/startup.py [--dtype float32] [--later 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, resource, sys, time
t0 = time.time()
from jaxgen import LLM, SamplingParams
from jaxgen.decode import compiles
t1 = time.time()
llm = LLM(dtype=sys.argv[1], max_len=512, max_batch=1)
t2 = time.time()
first = None
for _ in llm.stream("The capital of France is", SamplingParams(max_tokens=8, temperature=0)):
    first = first or time.time()
weights = sum(x.nbytes for x in llm.weights().values())
print(json.dumps(dict(t_import_start=t0, import_s=t1 - t0, llm_s=t2 - t1, first_s=first - t2, t_first=first,
                      timings=llm.timings,
                      programs=compiles.phases(),
                      peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, weights_bytes=weights)))
"""


def run(home: str, dtype: str) -> dict:
  env = dict(os.environ, HOME=home)
  for var in ("JAXGEN_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR", "JAXGEN_COMPILATION_CACHE"):
    env.pop(var, None)
  launched = time.time()
  out = subprocess.run([sys.executable, "-c", CHILD, dtype], env=env, capture_output=True, text=True, check=True)
  r = json.loads(out.stdout.strip().splitlines()[-1])
  r["first_token_s"] = r["t_first"] - launched
  r["python_start_s"] = r["t_import_start"] - launched
  return r


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--later", type=int, default=2, help="later starts to measure (the best is reported)")
  p.add_argument("--json", action="store_true")
  a = p.parse_args()
  with tempfile.TemporaryDirectory(prefix="jaxgen-startup-") as home:
    fresh = run(home, a.dtype)
    later = min((run(home, a.dtype) for _ in range(a.later)), key=lambda r: r["first_token_s"])
  if a.json:
    print(json.dumps(dict(dtype=a.dtype, fresh=fresh, later=later)))
    return
  print(f"embedded Gemma 3 270M, {a.dtype}: weights {fresh['weights_bytes'] / 2**20:.0f} MiB")
  print(f"{'':24} {'fresh':>8} {'later':>8}")
  rows = [("first token", "first_token_s"), ("  python start", "python_start_s"), ("  import jaxgen", "import_s"),
          ("  LLM()", "llm_s")]
  for label, key in rows:
    print(f"{label:<24} {fresh[key]:7.1f}s {later[key]:7.1f}s")
  for key in ("read_s", "place_s", "engine_s", "tokenizer_s"):
    print(f"{'    ' + key:<24} {fresh['timings'].get(key, 0):7.1f}s {later['timings'].get(key, 0):7.1f}s")
  print(f"{'    weight cache':<24} {fresh['timings'].get('weight_cache', '').split(' ')[0]:>8} "
        f"{later['timings'].get('weight_cache', ''):>8}")
  print(f"{'  then the first token':<24} {fresh['first_s']:7.1f}s {later['first_s']:7.1f}s")
  for key in ("trace_s", "lower_s", "compile_s"):
    print(f"{'    ' + key:<24} {fresh['programs'][key]:7.1f}s {later['programs'][key]:7.1f}s")
  print(f"{'    compilation cache':<24} {_hits(fresh['programs']):>8} {_hits(later['programs']):>8}")
  print(f"{'peak memory':<24} {fresh['peak_rss'] / 2**30:6.2f}G {later['peak_rss'] / 2**30:6.2f}G "
        f"({later['peak_rss'] / later['weights_bytes']:.2f}x the weights, later)")


def _hits(p: dict) -> str:
  return f"{p['cache_hits']}/{p['cache_hits'] + p['cache_misses']} hit"


if __name__ == "__main__":
  main()
