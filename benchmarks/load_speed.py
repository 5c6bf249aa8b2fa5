"""Load time of the embedded Gemma 3 270M: from its GGUF file vs from a jaxgen orbax checkpoint.

Both paths end with the same thing: a Transformer with every parameter on the device and a
tokenizer. GGUF dequantizes Q4_K/Q6_K blocks on the host and derives the tokenizer's merges from
the vocabulary; orbax reads ready float arrays (each device its own shards) and a saved
`tokenizer.json`. Each load runs `--repeat` times in this process (files are in the page cache
after the first read); the best and the median are printed.

  python benchmarks/load_speed.py [--orbax DIR] [--dtype float32] [--repeat 3]

Without --orbax the GGUF is converted into a temporary directory first (not timed) and removed.
Exits with status 1 if orbax is not faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax


def timed_load(path: str, dtype: str) -> float:
  from jaxgen.checkpoints.load import load

  t0 = time.perf_counter()
  _, model, _ = load(path, dtype)
  jax.block_until_ready(jax.tree.leaves(model))
  return time.perf_counter() - t0


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--orbax", default=None, help="existing orbax checkpoint of the embedded model")
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--repeat", type=int, default=3)
  a = ap.parse_args()

  from jaxgen.checkpoints.convert import convert
  from jaxgen.checkpoints.load import default_model_path

  gguf = default_model_path()
  with tempfile.TemporaryDirectory(prefix="jaxgen-load-speed-") as tmp:
    orbax_dir = a.orbax
    if orbax_dir is None:
      orbax_dir = os.path.join(tmp, "gemma3-270m")
      print(f"# converting {os.path.basename(gguf)} -> {orbax_dir} (not timed)", file=sys.stderr)
      print(f"# {convert(gguf, orbax_dir, dtype=a.dtype, show_progress=False)}", file=sys.stderr)
    times = {"gguf": [], "orbax": []}
    for _ in range(a.repeat):  # interleaved, so neither source gets a quieter machine
      times["gguf"].append(timed_load(gguf, a.dtype))
      times["orbax"].append(timed_load(orbax_dir, a.dtype))
  print(f"load of the embedded Gemma 3 270M ({a.dtype}, {jax.device_count()} {jax.default_backend()} device(s), "
        f"{a.repeat} runs each):")
  for name, ts in times.items():
    print(f"  {name:6s} best {min(ts):6.2f} s   median {statistics.median(ts):6.2f} s")
  speedup = min(times["gguf"]) / min(times["orbax"])
  print(f"  orbax is {speedup:.1f}x faster" if speedup > 1 else f"  orbax is SLOWER ({speedup:.2f}x)")
  return 0 if speedup > 1 else 1


if __name__ == "__main__":
  sys.exit(main())
