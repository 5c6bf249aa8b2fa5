"""Compiling for TPU without one: the Pallas attention kernel through Mosaic at real shapes, and
`jaxgen plan` compiling an engine's programs with libtpu for slices that are not here.

What the TPU compiler answers is the test: a block shape Mosaic refuses, a cache relaid out on
every step, a donated state that is copied, weights gathered in a decode step or a program that
does not fit all fail here, on a CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import tiny_config
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxgen import plan, targets
from jaxgen.decode.cache import CacheSpec
from jaxgen.decode.config import EngineConfig, program_count
from jaxgen.decode.steps import Programs, state_axes
from jaxgen.model.kernels.attention import pallas as pallas_kernels
from jaxgen.model import params as model_params
from jaxgen.model.kernels.attention import KVBlock, attention_pallas
from jaxgen.model.config import GLOBAL, LOCAL
from jaxgen.model.platform import Platform, resolve
from jaxgen.sharding.mesh import MeshConfig

try:
  from jax.experimental import topologies

  topologies.get_topology_desc("v5e:2x2", "tpu")
  HAVE_LIBTPU = True
except Exception:  # no libtpu: the test extra installs it
  HAVE_LIBTPU = False
needs_libtpu = pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not installed (pip install -e '.[test]')")
# The suite's persistent cache cannot load an executable compiled for a described topology back.
pytestmark = pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")


def _one_chip(generation: str):
  devices = plan.topology_devices(targets.TARGETS[f"tpu-{generation}-1"])
  return NamedSharding(Mesh(devices, ("x",)), P())


def _kernel_args(sharding, *, b, kh, r, h, s, dtype, int8):
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
  run = (sds((b, kh, r, 1), jnp.float32), sds((b, kh, r, 1), jnp.float32), sds((b, kh, r, h), jnp.float32))
  cache = jnp.int8 if int8 else dtype
  args = [run, sds((b, kh, r, h), dtype), sds((b, kh, s, h), cache), sds((b, kh, s, h), cache),
          sds((b, r), jnp.int32), sds((b,), jnp.int32), sds((b,), jnp.int32), sds((b,), jnp.int32)]
  scales = [sds((b, kh, s, h // 16), jnp.float32)] * 2 if int8 else []
  return args, scales


def _products(shape) -> set[int]:
  """Sizes of every run of adjacent dimensions (a gathered weight may come flattened)."""
  out = set()
  for i in range(len(shape)):
    n = 1
    for d in shape[i:]:
      n *= d
      out.add(n)
  return out


def _layer_entries(max_len: int, window: int | None, dtype: str) -> int:
  """A cache layer's entries as the engine lays them out on TPU (aligned to the sublane tile)."""
  platform = Platform(backend="tpu", cache_dtype=dtype)
  cfg = tiny_config(sliding_window=window or 8)
  spec = CacheSpec(slots=1, max_len=max_len, dtype=dtype, align=platform.cache_align)
  return spec.layer_len(cfg, LOCAL if window else GLOBAL) + 1


# (name, rows, kv heads, grouped query rows, head dim, max_len, ring) at real models' shapes.
KERNEL_CASES = [
    ("gemma3-270m-global", 8, 1, 4, 256, 2048, None),
    ("gemma3-270m-ring", 8, 1, 4, 256, 2048, 512),
    ("gemma3-270m-prefill", 1, 1, 4 * 512, 256, 2048, None),
    ("llama3-8b-decode", 64, 8, 4, 128, 8192, None),
    ("llama3-8b-verify", 16, 8, 4 * 5, 128, 8192, None),
]


@needs_libtpu
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_mosaic_compiles_the_kernel_and_reads_the_cache_in_place(generation, case):
  _, b, kh, r, h, max_len, ring = case
  s = _layer_entries(max_len, ring, "bfloat16")
  args, _ = _kernel_args(_one_chip(generation), b=b, kh=kh, r=r, h=h, s=s, dtype=jnp.bfloat16, int8=False)

  def f(run, q, k, v, q_pos, start, length, rows):
    return pallas_kernels.cache_attention(run, q, k, v, q_pos, start, length, rows, ring=ring, window=ring,
                                          softcap=None)

  compiled = jax.jit(f).lower(*args).compile()
  mem = compiled.memory_analysis()
  # No temporaries: the cache (GBs at the 8B shape) is read where it lies, never relaid out.
  # An unaligned length (the scratch entry alone: 8193) made XLA copy K and V into the kernel's
  # layout on every call (2.15 GB of temporaries at the 8B decode shape).
  cache_bytes = 2 * b * kh * s * h * 2
  assert mem.temp_size_in_bytes < 0.01 * cache_bytes, (mem.temp_size_in_bytes, cache_bytes)


@needs_libtpu
def test_mosaic_compiles_the_int8_cache_path():
  """It compiles; its scales' narrow lane dim is relaid out (see `platform.resolve`), which is why
  "auto" keeps XLA for an int8 cache."""
  s = _layer_entries(2048, None, "int8")
  args, scales = _kernel_args(_one_chip("v5e"), b=8, kh=1, r=4, h=256, s=s, dtype=jnp.bfloat16, int8=True)

  def f(run, q, k, v, q_pos, start, length, rows, ks, vs):
    return pallas_kernels.cache_attention(run, q, k, v, q_pos, start, length, rows, ring=None, window=None,
                                          softcap=50.0, k_scale=ks, v_scale=vs)

  assert jax.jit(f).lower(*args, *scales).compile().memory_analysis() is not None
  assert resolve("bfloat16", cache_dtype="int8", backend="tpu", device_kind="TPU v5 lite").attention == "xla"


def test_auto_takes_the_kernel_on_tpu_chips_and_slices():
  tpu = dict(backend="tpu", device_kind="TPU v6 lite")
  assert resolve("bfloat16", **tpu).attention == "pallas"
  assert resolve("bfloat16", devices=8, **tpu).attention == "pallas"
  assert "shard_map" in resolve("bfloat16", devices=8, **tpu).why("attention")
  assert resolve("bfloat16", backend="gpu", device_kind="NVIDIA H100").attention == "xla"
  assert resolve("bfloat16", attention="xla", **tpu).attention == "xla"
  with pytest.raises(ValueError, match="emulate='tpu5' is not supported"):
    resolve("bfloat16", emulate="tpu5")


def _tiny_config_json(tmp_path):
  """An HF config.json of a tiny Llama-shaped model: no weights exist anywhere."""
  path = tmp_path / "config.json"
  path.write_text(json.dumps(dict(
      model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=4096, rms_norm_eps=1e-5,
      hidden_act="silu", tie_word_embeddings=False)))
  return path


@needs_libtpu
def test_plan_lists_every_program_the_engine_warms(tmp_path):
  cfg, _ = plan.model_config(str(_tiny_config_json(tmp_path)))
  names = []
  report = plan.plan(cfg, "tpu-v5e-1", max_batch=4, max_len=512, speculative_config="ngram:3",
                     only=lambda n: names.append(n) and False)
  assert report.programs == []  # nothing compiled: only listed
  assert len(names) == len(set(names)) == program_count(4, 512, prefix_caching=True, speculative=True)
  assert {"decode_1", "decode_4", "verify_4", "prefix_save", "prefix_restore", "fork", "move"} <= set(names)


@needs_libtpu
@pytest.mark.slow
def test_jaxgen_plan_json_for_a_config_with_no_weights(tmp_path):
  """Every program of a small engine compiled for a v5e chip through the CLI, as scripts use it."""
  proc = subprocess.run([sys.executable, "-m", "jaxgen.cli", "plan", "--target", "tpu-v5e-1", "--model",
                         str(_tiny_config_json(tmp_path)), "--max-batch", "2", "--max-len", "256", "--json"],
                        capture_output=True, text=True, timeout=500)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout)
  assert r["target"] == "tpu-v5e-1" and r["chips"] == 1 and r["fits"] is True
  assert r["hbm_capacity_bytes"] == targets.CHIPS["v5e"].hbm_bytes
  names = [p["name"] for p in r["programs"]]
  assert len(names) == program_count(2, 256, prefix_caching=True)
  assert all(p["compiled"] and p["error"] is None for p in r["programs"])
  assert r["attention"] == "pallas"
  for p in r["programs"]:
    assert 0 < p["hbm_bytes"] <= r["hbm_bytes"] and p["bytes_accessed"] > 0, p
    if p["name"].startswith(("decode", "prefill", "fork", "move")):
      # The donated state comes back in place: its bytes are aliased, not copied.
      assert p["alias_bytes"] >= r["state_bytes"], p
  pred = r["predicted"]
  assert pred["decode_tok_s"] > 0 and pred["prefill_tok_s"] > 0 and "roofline prediction" in pred["basis"]


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("generation,attention,quantization", [("v5e", "auto", None), ("v6e", "xla", "int8")])
def test_the_embedded_models_programs_compile_for_one_chip(generation, attention, quantization):
  cfg, _ = plan.model_config(None)
  # A prompt chunk with the kernel; decode in both (docs/accelerators.md has every program's compile).
  wanted = ("prefill_fresh_16", "decode_8") if attention == "auto" else ("decode_8",)
  r = plan.plan(cfg, f"tpu-{generation}-1", max_batch=8, max_len=2048, attention_impl=attention,
                quantization=quantization, only=lambda n: n in wanted)
  assert tuple(p.name for p in r.programs) == wanted
  assert all(p.compiled for p in r.programs), [p.error for p in r.programs]
  assert r.attention == ("pallas" if attention == "auto" else "xla")
  decode = r.programs[-1]
  assert decode.alias_bytes >= r.state_bytes  # the cache is donated and aliased
  assert r.fits and r.hbm_bytes < r.hbm_capacity_bytes


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("data,model", [(1, 8), (2, 4)])
def test_llama3_8b_decode_compiles_for_v5e_8_split_by_heads_without_gathering_weights(data, model):
  cfg, _ = plan.model_config("llama-3.1-8b")
  r = plan.plan(cfg, "tpu-v5e-8", max_batch=8, max_len=2048, mesh=MeshConfig(data=data, model=model),
                only=lambda n: n == "decode_8")
  (decode,) = r.programs
  assert decode.compiled, decode.error
  assert r.mesh == {"data": data, "model": model} and r.fits
  assert r.attention == "pallas"  # the kernel per shard (shard_map), compiled by Mosaic for each chip
  # Megatron split: all-reduces after attention and MLP; weights stay where they are.
  assert decode.collectives["all-reduce"] >= cfg.num_layers
  # What is gathered is the [rows, vocab] logits for the sampler (a few MB), never a weight.
  weights = {tuple(sorted(spec.shape)) for spec in model_params.param_specs(cfg, jnp.bfloat16).values()}
  assert decode.collectives["all-gather"] >= 1
  for shape in decode.all_gather_shapes:
    assert tuple(sorted(shape)) not in weights and cfg.vocab_size * cfg.embed_dim not in _products(shape), shape
  assert decode.all_gather_bytes < 0.02 * r.weight_bytes, decode.all_gather_bytes
  assert decode.alias_bytes >= r.state_bytes
  # Per chip, 1/model of the 16 GB of bf16 weights plus the cache and temporaries.
  assert r.weight_bytes < 1.1 * 16.1e9 / model and decode.hbm_bytes < targets.CHIPS["v5e"].hbm_bytes


def test_every_program_of_an_engine_exports_for_cuda():
  """The programs lower for GPU (StableHLO for the CUDA platform) as they do for TPU; compiling
  them needs the CUDA plugin, which the suite does not install (docs/accelerators.md)."""
  cfg = tiny_config(sliding_window=32)
  platform = resolve("bfloat16", backend="gpu", device_kind="NVIDIA H100 80GB HBM3")
  assert platform.attention == "xla" and platform.cache_align == 16
  config = EngineConfig.resolve(cfg, "bfloat16", max_batch=4, max_len=256, platform=platform,
                                speculative_config="ngram:2", prefix_cache_tokens=64)
  spec, chunk = config.cache, config.chunk
  assert spec.slack == 2 and config.store is not None
  graphdef, abstract = nnx.split(model_params.abstract_model(cfg, jnp.bfloat16))
  programs = Programs(graphdef, cfg, spec, platform)
  state = state_axes(cfg, spec)[0]
  exported = []
  for name, fn, args, _ in plan.program_args(config, programs, abstract, state, config.store.shapes(cfg)):
    exp = jax.export.export(fn, platforms=["cuda"])(*args)
    assert exp.platforms == ("cuda",) and exp.mlir_module_serialized, name
    exported.append(name)
  assert len(exported) == program_count(4, chunk, prefix_caching=True, speculative=True)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["auto", "pallas"])
def test_a_decode_step_compiles_for_an_h100_without_one(tmp_path, attention):
  """XLA:GPU through the CUDA plugin and the card's target config: no driver, no device. With
  attention_impl="pallas" the GPU kernel (Pallas' Triton backend) is compiled by XLA:GPU's Triton
  pipeline for sm_90 in a decode step (a prompt chunk over the cache compiles too:
  docs/accelerators.md; each XLA:GPU compile here costs about 15 s, never cached)."""
  cfg, _ = plan.model_config(str(_tiny_config_json(tmp_path)))
  r = plan.plan(cfg, "gpu-h100-1", max_batch=4, max_len=512, attention_impl=attention, only=lambda n: n == "decode_4")
  (decode,) = r.programs
  assert decode.compiled, decode.error
  assert r.attention == ("xla" if attention == "auto" else "pallas")
  assert r.hbm_capacity_bytes == targets.CHIPS["h100"].hbm_bytes
  assert decode.alias_bytes >= r.state_bytes and r.fits
  pred = r.predicted()
  assert pred["decode"]["bound"] == "memory" and pred["decode_tok_s"] > 0


@pytest.mark.parametrize("kw,match", [(dict(max_batch=0), "max_batch=0 must be >= 1"),
                                      (dict(max_len=1), "max_len=1 must be >= 2"),
                                      (dict(max_len=10**6), "max_len=1000000 exceeds the model's context length 4096")])
def test_plan_refuses_bad_sizes_naming_them(tmp_path, kw, match):
  cfg, _ = plan.model_config(str(_tiny_config_json(tmp_path)))
  with pytest.raises(ValueError, match=match):
    plan.plan(cfg, "tpu-v5e-1", **kw)


def test_plan_refuses_unknown_targets_and_models(tmp_path):
  with pytest.raises(ValueError, match="--target 'tpu-v9-1' is not known"):
    targets.target("tpu-v9-1")
  with pytest.raises(ValueError, match="neither a preset"):
    plan.model_config(str(tmp_path / "missing"))


def test_the_kernel_path_refuses_a_block_that_is_not_a_cache():
  q = jnp.zeros((1, 1, 2, 16), jnp.float32)
  blk = KVBlock(jnp.zeros((1, 1, 8, 16)), jnp.zeros((1, 1, 8, 16)), jnp.zeros((1, 8), jnp.int32), jnp.int32(4))
  with pytest.raises(ValueError, match="KVBlock.start"):
    attention_pallas(q, [blk], jnp.zeros((1, 1), jnp.int32), None, None)
