"""The device check, one script for a lent TPU or GPU (about 5 minutes), green on CPU with --tiny.

1. Correctness on the device: the Pallas cache-attention kernel against the plain-XLA reference
   (float32 and bfloat16, ragged rows, a wrapped ring, GQA), and the plain and Pallas paths of a
   whole model agreeing on greedy tokens.
2. `jaxgen bench`'s measurements on an 8B-shaped Llama 3 (random bfloat16 weights made on the
   device from the config: nothing downloaded): decode at batch 1, 8 and 64 and prefill of 2,048
   tokens, with MBU against the device's spec-sheet bandwidth (weights + KV read per step) and MFU
   against its spec-sheet bfloat16 rate, beside the same ratios against the bandwidth and matmul
   rate measured here.

Writes a JSON (`--out`) and prints a table; targets on an H200-class device: batch-1 decode MBU
>= 80%, batch 64 >= 60%, prefill 2k MFU >= 50%.

  python benchmarks/accelerator.py [--out accelerator.json] [--attention-impl xla|pallas]
  python benchmarks/accelerator.py --tiny     # CPU: a small config, for CI
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jaxgen import LLM, SamplingParams, bench
from jaxgen.checkpoints.tokenizer import byte_tokenizer
from jaxgen.model.kernels import attention as A
from jaxgen.model import platform as platforms
from jaxgen.model.kernels.attention import KVBlock
from jaxgen.model.config import ModelConfig, layer_pattern
from jaxgen.model.kv import entry_positions
from jaxgen.model.params import param_specs

# (HBM bytes/s, dense bfloat16 FLOP/s) from the vendors' spec sheets, by device_kind substring.
SPEC_SHEETS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12),
               "L4": (300e9, 121e12), "TPU v6": (1.64e12, 918e12), "TPU v5p": (2.765e12, 459e12),
               "TPU v5": (819e9, 197e12), "TPU v4": (1.2e12, 275e12)}

LLAMA3_8B = ModelConfig(family="llama", vocab_size=128256, embed_dim=4096, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, mlp_dim=14336, max_context=8192, norm_eps=1e-5,
                        rope_base=500000.0, layer_kinds=layer_pattern(32, None, None), tie_embeddings=False)
TINY = ModelConfig(family="llama", vocab_size=512, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, mlp_dim=128, max_context=4096, layer_kinds=layer_pattern(2, None, None),
                   tie_embeddings=False)


def random_tree(cfg: ModelConfig, dtype: str, seed: int = 0) -> dict[str, jax.Array]:
  """Random weights made on the device, one jitted draw per parameter (never through the host)."""
  out = {}
  key = jax.random.key(seed)
  for i, (name, spec) in enumerate(param_specs(cfg, dtype).items()):
    draw = jax.jit(lambda k, shape=spec.shape, dt=spec.dtype: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dt))
    out[name] = draw(jax.random.fold_in(key, i)) if "norm" not in name else jnp.ones(spec.shape, spec.dtype)
  return out


def kernel_check(dtype) -> float:
  """Largest |Pallas - reference| over ragged rows, a wrapped ring and GQA 4, in `dtype`."""
  rng = np.random.default_rng(0)
  worst = 0.0
  for ring, size, lengths in ((False, 1024, [0, 1, 700, 1000]), (True, 256, [5000, 257, 100, 0])):
    b, kh, n, h = len(lengths), 2, 8, 128
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    q = cast(rng.normal(size=(b, 1, n, h)) / np.sqrt(h))
    lengths = jnp.asarray(lengths, jnp.int32)
    pos = entry_positions(lengths, size, ring)
    q_pos = lengths[:, None]
    held = KVBlock(cast(rng.normal(size=(b, kh, size, h))), cast(rng.normal(size=(b, kh, size, h))), pos,
                   jnp.minimum(jnp.max(lengths), size), jnp.arange(b, dtype=jnp.int32)[::-1], start=lengths)
    as_ring = lambda bl: [bl[0]._replace(ring=size if ring else None), bl[1]]  # noqa: E731  (static: not an argument)
    fresh = KVBlock(cast(rng.normal(size=(b, kh, 1, h))), cast(rng.normal(size=(b, kh, 1, h))), q_pos)
    window = size if ring else None
    want = jax.jit(lambda q, bl: A.attention_xla(q, bl, q_pos, window, None))(q, [held, fresh])
    platform = platforms.resolve(str(jnp.dtype(dtype)), attention="pallas")  # interpreted only on CPU
    got = jax.jit(lambda q, bl: A.attention_pallas(q, as_ring(bl), q_pos, window, None, platform))(q, [held, fresh])
    worst = max(worst, float(jnp.max(jnp.abs(want.astype(jnp.float32) - got.astype(jnp.float32)))))
  return worst


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tiny", action="store_true", help="a small config (CPU, CI)")
  p.add_argument("--attention-impl", default="xla", choices=["xla", "pallas"], help="the path benchmarked")
  p.add_argument("--out", default=None, help="write the report here as JSON")
  a = p.parse_args()
  t_start = time.perf_counter()
  cfg, dtype = (TINY, "float32") if a.tiny else (LLAMA3_8B, "bfloat16")
  device = jax.devices()[0].device_kind
  spec = next((v for k, v in SPEC_SHEETS.items() if k.lower() in device.lower()), None)
  report = dict(device=device, backend=jax.default_backend(), config="tiny" if a.tiny else "llama3-8b-shaped",
                dtype=dtype, attention_impl=a.attention_impl,
                kernel_max_abs_diff={d: kernel_check(d) for d in ("float32", "bfloat16")})
  tree = random_tree(cfg, dtype)
  context, batches, prompt = (256, [1, 8, 64], 2048)
  llm = LLM.from_weights(cfg, tree, byte_tokenizer(), max_len=prompt + 64, max_batch=1, prefill_chunk=1024,
                         attention_impl=a.attention_impl, compilation_cache_dir=None)
  ids = np.random.default_rng(0).integers(10, 500, 40).tolist()
  greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
  plain = llm.generate(ids, greedy, use_tqdm=False)[0].token_ids
  other = LLM.from_weights(cfg, tree, byte_tokenizer(), max_len=256, max_batch=1,
                           attention_impl="pallas" if a.attention_impl == "xla" else "xla", compilation_cache_dir=None)
  report["greedy_tokens_agree_xla_pallas"] = other.generate(ids, greedy, use_tqdm=False)[0].token_ids == plain
  del other
  roof = bench.roofline(dtype)
  report["measured_roofline"] = roof
  report["spec_sheet"] = None if spec is None else dict(mem_bw=spec[0], matmul=spec[1])
  report["prefill"] = bench.bench_prefill(llm, [prompt], roof)
  report["decode"] = bench.bench_decode(llm, batches, context=context, steps=8, roof=roof)
  for r in report["prefill"]:
    r["mfu_spec"] = None if spec is None else bench.prefill_flops(cfg, r["prompt_len"]) / r["seconds"] / spec[1]
  for r in report["decode"]:
    r["mbu_spec"] = None if spec is None else r["bytes_per_step"] * r["tok_s"] / r["batch"] / spec[0]
  report["seconds"] = time.perf_counter() - t_start
  if a.out:
    with open(a.out, "w") as f:
      json.dump(report, f, indent=1)
  pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
  print(f"{device} ({report['backend']}), {report['config']} {dtype}, attention {a.attention_impl}; "
        f"kernel vs reference: {report['kernel_max_abs_diff']}; greedy xla == pallas: "
        f"{report['greedy_tokens_agree_xla_pallas']}")
  print("| phase | size | tok/s | vs spec sheet | vs measured |\n|---|---|---|---|---|")
  for r in report["prefill"]:
    print(f"| prefill | {r['prompt_len']} tokens | {r['tok_s']:,.0f} | MFU {pct(r['mfu_spec'])} | MFU {pct(r['mfu'])} |")
  for r in report["decode"]:
    if r["slots"] > 1 or r["batch"] > 1:
      print(f"| decode | batch {r['batch']} | {r['tok_s']:,.0f} | MBU {pct(r['mbu_spec'])} | MBU {pct(r['mbu'])} |")
  print(f"({report['seconds']:.0f} s)")


if __name__ == "__main__":
  main()
