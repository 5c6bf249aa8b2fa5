"""`LLM.update_weights` on the embedded model: seconds and bytes moved per swap, beside a decode step.

Three trees of the same layout: one computed on the device (as a training step leaves it: no
byte moves, the engine takes the arrays as they are), the engine's own arrays (a no-op swap), and
host numpy arrays (every byte crosses to the device once). The goal is a swap well under one
decode step for on-device trees.

  python benchmarks/update_weights.py [--dtype bfloat16] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from jaxgen import LLM, SamplingParams


def timed(fn, repeat: int) -> float:
  best = float("inf")
  for _ in range(repeat):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=None)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--repeat", type=int, default=5)
  p.add_argument("--json", action="store_true")
  a = p.parse_args()
  llm = LLM(a.model, dtype=a.dtype, max_len=256, max_batch=1)
  llm.warmup()
  original = llm.weights()
  nbytes = sum(x.nbytes for x in original.values())
  on_device = jax.block_until_ready(jax.jit(lambda t: jax.tree.map(lambda w: w * 1, t))(original))
  host = {k: np.asarray(v) for k, v in original.items()}

  def swap(tree):
    llm.update_weights(tree)
    jax.block_until_ready(llm.engine.runner.params)

  out = llm.generate("The sea is", SamplingParams(max_tokens=33, temperature=0, ignore_eos=True), use_tqdm=False)[0]
  rows = dict(weights_bytes=nbytes, decode_step_s=out.metrics.tpot_s,
              on_device_s=timed(lambda: swap(on_device), a.repeat), same_arrays_s=timed(lambda: swap(original), a.repeat),
              host_s=timed(lambda: swap(host), a.repeat))
  if a.json:
    print(json.dumps(rows))
    return
  step = rows["decode_step_s"]
  print(f"weights: {nbytes / 2**20:.0f} MiB ({a.dtype}); one decode step (batch 1): {step * 1e3:.1f} ms")
  for key, what, moved in (("on_device_s", "tree on the device", 0), ("same_arrays_s", "the engine's own arrays", 0),
                           ("host_s", "host numpy arrays", nbytes)):
    print(f"  {what:<26} {rows[key] * 1e3:8.2f} ms  ({rows[key] / step:5.2f} decode steps), "
          f"{moved / 2**20:.0f} MiB moved")


if __name__ == "__main__":
  main()
