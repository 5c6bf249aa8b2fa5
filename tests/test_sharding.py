"""Sharded == single device, on 8 simulated CPU devices in a subprocess (the rest of the session keeps 1).

The worker (this file run as a script) builds every configuration, generates and measures, and
prints one JSON object; the tests below assert on it. Layout expectations are written out here,
independently of `jaxgen.sharding.rules`, so a wrong rule cannot agree with itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test here starts subprocesses with 8 simulated devices

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
EMBEDDED_MESH = (2, 4)  # Gemma 3 270M: N=4 divides model=4; K=1 does not (kv replicated)
PROMPTS = [[5, 17, 99, 3, 250], [7, 7, 7], [1000, 2, 4095, 8, 16, 300, 11]]
SCORED = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


def run_worker(mode: str, timeout: int) -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, __file__, mode], env=env, capture_output=True, text=True, timeout=timeout)
  if proc.returncode != 0:
    raise AssertionError(f"worker {mode} failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny():
  return run_worker("tiny", timeout=400)


# ------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"data{m[0]}-model{m[1]}")
def test_tokens_and_logits_match_one_device(tiny, mesh):
  got = tiny["meshes"][f"{mesh[0]}x{mesh[1]}"]
  assert got["tokens"] == tiny["reference"]["tokens"]
  assert got["logits_max_abs_diff"] <= 1e-4
  assert got["sampled"] == tiny["reference"]["sampled"]  # seeded sampling, n=2 (cache rows forked)
  assert got["logprobs_max_abs_diff"] <= 1e-4


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"data{m[0]}-model{m[1]}")
def test_parameters_and_state_are_placed_as_the_rules_say(tiny, mesh):
  got = tiny["meshes"][f"{mesh[0]}x{mesh[1]}"]
  assert got["layout_mismatches"] == []
  assert got["checked_arrays"] > 20


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"data{m[0]}-model{m[1]}")
def test_decode_program_gathers_no_weight_matrix(tiny, mesh):
  got = tiny["meshes"][f"{mesh[0]}x{mesh[1]}"]
  assert got["weight_gathers"] == []


def test_the_pallas_kernel_runs_per_shard_and_equals_one_device(tiny):
  """What `attention_impl="auto"` takes on a TPU slice: the kernel inside shard_map (slots over
  data, kv heads over model), each shard folding the rows it holds, the shards' softmax states
  merged. Through the engine (emulated TPU, interpreted) and for the kernel alone (float32)."""
  got = tiny["pallas"]
  assert got["attention"] == "pallas" and got["kernel_mesh"] == ["data", "model"]
  assert got["tokens"] == got["reference_tokens"] and got["sampled"] == got["reference_sampled"]
  assert got["logprobs_max_abs_diff"] <= 1e-4
  assert set(got["kernel"]) == {"data2-model4", "kv1-replicated-model8", "data8-ring-int8"}
  for case, err in got["kernel"].items():
    assert err <= 1e-5, (case, err)  # measured 2e-6 to 5e-6


def test_weight_gather_detector_sees_a_gathered_weight(tiny):
  # The same check applied to a program that replicates the embedding must flag it.
  assert tiny["control_weight_gathers"], "the HLO check would not notice a gathered weight"


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"data{m[0]}-model{m[1]}")
def test_planner_matches_allocated_bytes(tiny, mesh):
  got = tiny["meshes"][f"{mesh[0]}x{mesh[1]}"]
  for part in ("weights", "kv_cache", "sampler"):
    planned, allocated = got["plan"][part], got["allocated"][part]
    assert abs(planned - allocated) <= 0.05 * allocated, (part, planned, allocated)
  assert "weights" in got["plan_text"] and "KV cache" in got["plan_text"]


def test_prefix_cache_on_a_mesh_hits_and_changes_no_token(tiny):
  got = tiny["prefix"]
  assert got["tokens_on"] == got["tokens_off"]
  assert got["hit_tokens"] == [0, 64, 128, 192]  # 70 shared tokens: 4 blocks per later prompt
  # Split like the cache's kv heads (8 over model=4); blocks whole on every device.
  assert got["store_spec"] == [None, "model", None, None] and got["cache_spec"][1] == "model"
  assert got["plan_store"] == got["allocated_store"] > 0
  assert got["allocated_store"] * 4 <= got["budget_bytes"]  # each device holds a quarter of the budget


def test_int8_weights_and_cache_sharded_equal_one_device(tiny):
  got = tiny["int8"]
  assert got["tokens"] == got["reference_tokens"]
  assert got["logits_max_abs_diff"] <= 1e-4
  assert 0 < got["float_logits_max_abs_diff"]  # the weights really are quantized
  assert got["layout_mismatches"] == [] and got["checked_arrays"] > 30
  assert abs(got["plan_weights"] - got["allocated_weights"]) <= 0.05 * got["allocated_weights"]
  assert got["allocated_weights"] <= 0.3 * got["float_weights"]
  # The int8 cache: split like the float one (scales too), the plan right, a third of float32's bytes
  # (int8 entries plus a float32 scale per 16).
  assert got["cache_dtype"] == "int8" and got["sampled"] == got["reference_sampled"]
  assert abs(got["plan_kv"] - got["allocated_kv"]) <= 0.05 * got["allocated_kv"]
  assert got["allocated_kv"] <= 0.32 * got["float_kv"]


def test_speculation_on_a_mesh_is_plain_decoding(tiny):
  got = tiny["speculative"]
  assert got["ngram"] == got["plain"] and got["draft"] == got["plain"]
  assert got["ngram_drafted"] > 0 and got["draft_accepted"] > 0
  assert got["draft_cache_spec"][1] == "model"  # [slots, kv heads, ...]: split as the target's cache
  assert got["draft_weight_spec"] == got["target_weight_spec"] != [None, None, None]
  # The memory plan counts the draft's cache (and no second copy of weights it shares).
  assert got["plan_draft"] == got["allocated_draft"] > 0 and got["plan_draft_ngram"] == 0
  assert "draft model" in got["plan_text"]
  assert got["plan_kv"] == got["allocated_kv"]


def test_bad_meshes_are_clear_errors_before_any_compile(tiny):
  errors = tiny["errors"]
  assert re.search(r"needs 16 devices but only 8", errors["too_large"])
  assert re.search(r"unknown mesh axis 'tensor'.*\['data', 'model'\]", errors["unknown_axis_parse"])
  assert re.search(r"unknown mesh axis 'expert'", errors["unknown_axis_kw"])
  assert re.search(r"'heads' has size 6.*'model' of size 4", errors["heads_do_not_divide"])
  assert re.search(r"'mlp' has size 100.*'model' of size 8", errors["mlp_do_not_divide"])
  assert re.search(r"'cache_batch' has size 6.*'data' of size 4.*max_batch", errors["slots_do_not_divide"])
  assert re.search(r"needs .* per device .* a device has", errors["does_not_fit"])
  assert tiny["compiles_during_errors"] == 0


def test_mqa_kv_heads_replicate_instead_of_failing(tiny):
  # K=2 does not divide model=4: kv weights and cache are replicated over model, the rest still splits.
  got = tiny["mqa"]
  assert got["kv_spec"] == [None, None, None, None]
  assert got["cache_spec"] == ["data", None, None, None]
  assert got["q_spec"] == ["model", None, None]
  assert got["logits_max_abs_diff"] <= 1e-4


@pytest.mark.slow
def test_embedded_model_sharded_matches_one_device():
  got = run_worker("embedded", timeout=600)
  assert got["tokens"] == got["reference_tokens"]
  assert got["logits_max_abs_diff"] <= 1e-4
  assert got["layout_mismatches"] == []
  assert got["weight_gathers"] == []
  assert got["shard_shapes"]["embed"] == [262144 // EMBEDDED_MESH[1], 640]
  assert got["shard_shapes"]["layers.0.kv"] == [1, 2, 256, 640]  # K=1: replicated


# ------------------------------------------------------------------------------------ the worker
# Expected placement by parameter kind, for a config whose K divides the model axis
# (kv_replicated=True: K does not divide, so kv is replicated).
def expected_spec(name: str, ndim: int, kv_replicated: bool):
  leaf = name.split(".")[-1]
  table = {
      "embed": ("model", None), "unembed": ("model", None),
      "q": ("model", None, None), "o": (None, "model"),
      "kv": (None if kv_replicated else "model", None, None, None),
      "gate_up": ("model", None, None), "down": (None, "model"),
      # int8 block scales (tiny config at model=4): with their blocks where the blocks divide
      # evenly (q, kv, gate_up by output; o's 4 blocks of inputs over 4 shards), replicated where
      # they do not (down's 3 blocks of 32 mlp inputs)
      "embed_scale": ("model", None), "unembed_scale": ("model", None), "q_scale": ("model", None, None),
      "kv_scale": (None if kv_replicated else "model", None, None, None), "o_scale": (None, "model"),
      "gate_up_scale": ("model", None, None), "down_scale": (None, None),
  }
  return table.get(leaf, (None,) * ndim)


def _tiny_cfg(heads=8, kv_heads=8, mlp=96):
  from jaxgen.model.config import GLOBAL, LOCAL, ModelConfig

  return ModelConfig(family="gemma3", vocab_size=8192, embed_dim=40, num_layers=2, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=16, mlp_dim=mlp, max_context=256, norm_offset=1.0,
                     sliding_window=8, layer_kinds=(LOCAL, GLOBAL), embed_scale=True, activation="gelu_tanh",
                     qk_norm=True, sandwich_norm=True, tie_embeddings=False)


class FakeTokenizer:
  stop_ids = frozenset({1})

  def encode(self, text, add_special_tokens=True):
    return [2 + (ord(c) % 50) for c in text]

  def decode(self, ids, skip_special_tokens=True):
    return "".join(chr(97 + i % 26) for i in ids)


def _use_tiny_model(cfg):
  """Makes `load(None)` return a random model of `cfg`, built like the real loader builds one."""
  import dataclasses

  import jaxgen.checkpoints.source as load_mod
  import numpy as np
  from jaxgen.model.params import build_model, param_specs
  from jaxgen.sharding import rules

  rng = np.random.default_rng(0)
  # Unit-scale (un)embeddings spread the logits, so greedy choices are far from ties.
  arrays = {name: ((1.0 if name in ("embed", "unembed") else 0.05) * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in ((n, s.shape) for n, s in param_specs(cfg, "float32").items())}

  def fake_load(path, dtype="float32", place=None, mesh=None, progress=None, quantization=None, timings=None,
                defer_tokenizer=False):
    qcfg = dataclasses.replace(cfg, weight_quant=quantization)
    if place is None and mesh is not None:
      place = rules.placer(rules.param_shardings(qcfg, dtype, mesh))
    tokenizer = FakeTokenizer()
    return (qcfg, build_model(qcfg, arrays, dtype, source="tiny", place=place),
            (lambda: tokenizer) if defer_tokenizer else tokenizer)

  load_mod.load = fake_load


def weight_gathers(hlo: str, weight_sizes: dict[str, int]) -> list[str]:
  """All-gathers in compiled HLO whose result is as large as a whole weight matrix."""
  found = []
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) all-gather(?:-start)?\(", line)
    if not m:
      continue
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      hits = [w for w, size in weight_sizes.items() if n == size]
      if hits:
        found.append(f"{dtype}[{dims}] = {hits}")
  return found


def _greedy(llm, prompts, max_tokens=10):
  from jaxgen import SamplingParams

  outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True),
                      use_tqdm=False)
  tokens = [o.outputs[0].token_ids for o in outs]
  logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
  return tokens, logprobs


def _spec(arr) -> tuple:
  """The array's PartitionSpec as a tuple with one entry per dimension."""
  spec = tuple(arr.sharding.spec)
  return spec + (None,) * (arr.ndim - len(spec))


def _sampled(llm):
  """Two seeded samples per prompt (the second forks the first's cache rows)."""
  from jaxgen import SamplingParams

  params = SamplingParams(n=2, max_tokens=6, temperature=0.8, top_k=50, seed=7, ignore_eos=True)
  return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]


def _layout(llm, kv_replicated: bool):
  """Mismatches between each array's placement and the expectation written above."""
  import jax
  from flax import nnx
  from jaxgen.model.params import path_str

  mesh = llm.mesh
  bad, n = [], 0
  for path, var in nnx.to_flat_state(nnx.state(llm.model)):
    name, arr = path_str(path), var.get_value()
    spec = expected_spec(name, arr.ndim, kv_replicated)
    got = _spec(arr)
    shard = tuple(d // (mesh.shape[a] if a else 1) for d, a in zip(arr.shape, spec))
    n += 1
    if got != spec or any(s.data.shape != shard for s in arr.addressable_shards):
      bad.append(f"{name}: spec {got} shard {arr.addressable_shards[0].data.shape}, expected {spec} {shard}")
  state = llm.engine.runner.state
  kv_axis = None if kv_replicated else "model"
  for i, layer in enumerate(state.cache.layers):
    for arr in (layer.k, layer.v) + ((layer.k_scale, layer.v_scale) if layer.quantized else ()):
      n += 1
      if _spec(arr) != ("data", kv_axis, None, None):  # [B, K, S, H]
        bad.append(f"cache layer {i}: {arr.sharding.spec}")
  for path, arr in jax.tree_util.tree_flatten_with_path(state.sampler)[0]:
    n += 1
    if _spec(arr) != ("data",) + (None,) * (arr.ndim - 1):
      bad.append(f"sampler{jax.tree_util.keystr(path)}: {arr.sharding.spec}")
  return bad, n


def _device0_bytes(tree) -> int:
  import jax

  total = 0
  for arr in jax.tree.leaves(tree):
    total += sum(s.data.nbytes for s in arr.addressable_shards if s.device == jax.devices()[0])
  return total


def _decode_hlo(llm) -> str:
  import numpy as np

  eng = llm.engine
  active = np.zeros(len(eng.scheduler.slots), np.bool_)
  return eng.runner.programs.decode.lower(eng.runner.params, eng.runner.state, active).compile().as_text()


def _weight_sizes(cfg) -> dict[str, int]:
  from jaxgen.model.params import param_specs

  out = {}
  for name, shape in ((n, s.shape) for n, s in param_specs(cfg, "float32").items()):
    if len(shape) >= 2:
      n = 1
      for d in shape:
        n *= d
      out[name.split(".")[-1]] = n
  return out


def _kernel_per_shard() -> dict:
  """The kernel alone under shard_map against the plain formulation on one device: rows spread
  over the data shards (a batch row may read another shard's cache row), kv heads split or
  replicated (K=1 on model=4), a wrapped ring with its window, an int8 cache."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  from jaxgen.model.kernels import attention as A
  from jaxgen.model.platform import KernelMesh, Platform
  from test_pallas import blocks_for

  out = {}
  # Three layouts cover the five cases, each compile in interpret mode being costly: kv heads split
  # (data2-model4); one kv head replicated over model=8 with the rows whole; rows spread over eight
  # data shards through a wrapped ring with its window, from an int8 cache.
  cases = {"data2-model4": ((2, 4), 4, False, False), "kv1-replicated-model8": ((1, 8), 1, False, False),
           "data8-ring-int8": ((8, 1), 2, True, True)}
  for name, ((d, m), kh, ring, int8) in cases.items():
    mesh = Mesh(np.array(jax.devices()).reshape(d, m), ("data", "model"))
    km = KernelMesh(mesh.abstract_mesh, "data", "model" if kh % m == 0 else None)
    platform = Platform(backend="cpu", devices=8, attention="pallas", kernel_mesh=km)
    size, window = (64, 64) if ring else (300, None)
    q, blocks, q_pos = blocks_for(np.random.default_rng(d * 10 + kh), b=7, t=2, n=8, kh=kh, h=32, size=size,
                                  lengths=[0, 1, 137, 290, 5, 60, 1000 if ring else 299], ring=ring, int8=int8)
    want = A.attention_xla(q, blocks, q_pos, window, None)
    put = lambda x: None if x is None else jax.device_put(x, NamedSharding(mesh, P(km.rows, km.heads)))  # noqa: E731
    held, fresh = blocks
    arrays = [put(x) for x in (held.k, held.v, held.k_scale, held.v_scale)]

    def run(k, v, k_scale, v_scale):  # the block's ring size stays static
      block = held._replace(k=k, v=v, k_scale=k_scale, v_scale=v_scale)
      return A.attention_pallas(q, [block, fresh], q_pos, window, None, platform)

    out[name] = float(np.max(np.abs(np.asarray(jax.jit(run)(*arrays)) - np.asarray(want))))
  return out


def worker_tiny() -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxgen import LLM
  from jaxgen.decode import compiles
  from jaxgen.decode.cache import CacheSpec
  from jaxgen.decode.steps import memory_plan
  from jaxgen.sharding.mesh import MeshConfig

  assert jax.device_count() == 8
  cfg = _tiny_cfg()
  _use_tiny_model(cfg)
  kw = dict(max_len=64, max_batch=8, prefill_chunk=16)
  ref = LLM(None, **kw)
  ref_tokens, ref_lp = _greedy(ref, PROMPTS)
  ref_logits = ref.logits(SCORED)
  result = {"reference": {"tokens": ref_tokens, "sampled": _sampled(ref)}, "meshes": {}}
  sizes = _weight_sizes(cfg)
  llms = {}
  for d, m in MESHES:
    llm = llms[d, m] = LLM(None, mesh=MeshConfig(data=d, model=m), **kw)
    tokens, lp = _greedy(llm, PROMPTS)
    bad, n = _layout(llm, kv_replicated=False)
    hlo = _decode_hlo(llm)
    plan = llm.plan
    result["meshes"][f"{d}x{m}"] = {
        "tokens": tokens, "sampled": _sampled(llm),
        "logits_max_abs_diff": float(np.max(np.abs(llm.logits(SCORED) - ref_logits))),
        "logprobs_max_abs_diff": max(abs(a - b) for x, y in zip(lp, ref_lp) for a, b in zip(x, y)),
        "layout_mismatches": bad, "checked_arrays": n,
        "weight_gathers": weight_gathers(hlo, sizes),
        "plan": {"weights": plan.weights, "kv_cache": plan.kv_cache, "sampler": plan.sampler},
        "allocated": {"weights": _device0_bytes(llm.engine.runner.params), "kv_cache": _device0_bytes(llm.engine.runner.state.cache),
                      "sampler": _device0_bytes(llm.engine.runner.state.sampler)},
        "plan_text": str(plan),
    }

  # int8 weights and KV cache: sharded equals one device, scales placed with what they scale,
  # the plan holds. One device runs the formulation a mesh runs (the CPU kernels have no sharding
  # rule); the int8 kernel against it, which rounds activations differently: test_quant.py.
  ref_q = LLM(None, quantization="int8", cache_dtype="int8", matmul_impl="xla", **kw)
  q_tokens, _ = _greedy(ref_q, PROMPTS)
  llm_q = LLM(None, mesh=MeshConfig(data=2, model=4), quantization="int8", cache_dtype="int8", **kw)
  bad, n = _layout(llm_q, kv_replicated=False)
  result["int8"] = {
      "reference_tokens": q_tokens, "tokens": _greedy(llm_q, PROMPTS)[0],
      "logits_max_abs_diff": float(np.max(np.abs(llm_q.logits(SCORED) - ref_q.logits(SCORED)))),
      "float_logits_max_abs_diff": float(np.max(np.abs(ref_q.logits(SCORED) - ref_logits))),
      "layout_mismatches": bad, "checked_arrays": n,
      "plan_weights": llm_q.plan.weights, "allocated_weights": _device0_bytes(llm_q.engine.runner.params),
      "float_weights": result["meshes"]["2x4"]["allocated"]["weights"],
      "plan_kv": llm_q.plan.kv_cache, "allocated_kv": _device0_bytes(llm_q.engine.runner.state.cache),
      "float_kv": result["meshes"]["2x4"]["allocated"]["kv_cache"],
      "cache_dtype": str(llm_q.engine.runner.state.cache.layers[0].k.dtype), "sampled": _sampled(llm_q),
      "reference_sampled": _sampled(ref_q),
  }

  # The Pallas kernel per shard, as a TPU slice runs it (interpreted here): emulated TPU with the
  # slots over data=2 and the kv heads over model=4, against one device's plain formulation.
  one = LLM(None, emulate="tpu", attention_impl="xla", **kw)
  sharded = LLM(None, mesh=MeshConfig(data=2, model=4), emulate="tpu", **kw)
  platform = sharded.engine.config.platform
  one_tokens, one_lp = _greedy(one, PROMPTS)
  tokens, lp = _greedy(sharded, PROMPTS)
  result["pallas"] = {
      "attention": platform.attention, "kernel_mesh": [platform.kernel_mesh.rows, platform.kernel_mesh.heads],
      "reference_tokens": one_tokens, "tokens": tokens,
      "logprobs_max_abs_diff": max(abs(a - b) for x, y in zip(lp, one_lp) for a, b in zip(x, y)),
      "reference_sampled": _sampled(one), "sampled": _sampled(sharded),
      "kernel": _kernel_per_shard(),
  }

  # The detector, on a program that gathers the vocabulary-split embedding on purpose.
  llm = llms[2, 4]
  params = llm.engine.runner.params
  replicate = jax.sharding.NamedSharding(llm.mesh, jax.sharding.PartitionSpec())
  gathered = jax.jit(lambda p: jax.lax.with_sharding_constraint(p["embed"][...], replicate) * 2)
  result["control_weight_gathers"] = weight_gathers(gathered.lower(params).compile().as_text(), sizes)

  # Bad input: each a ValueError, and nothing compiles on the way.
  errors = {}
  _use_tiny_model(_tiny_cfg(heads=6, kv_heads=2))
  before = compiles.count()
  attempts = {
      "too_large": lambda: MeshConfig(data=16).build(),
      "unknown_axis_parse": lambda: MeshConfig.parse("data=2,tensor=4"),
      "unknown_axis_kw": lambda: MeshConfig.from_sizes(data=2, expert=4),
      "heads_do_not_divide": lambda: LLM(None, mesh=MeshConfig(data=2, model=4), **kw),
      "mlp_do_not_divide": lambda: memory_plan(_tiny_cfg(mlp=100), jnp.float32, llm.engine.config.cache, MeshConfig(data=1)),
      "slots_do_not_divide": lambda: memory_plan(cfg, jnp.float32, CacheSpec(6, 64), MeshConfig(data=4)),
      "does_not_fit": lambda: memory_plan(cfg, jnp.float32, llm.engine.config.cache, MeshConfig(data=2),
                                           capacity=1 << 16).check(),
  }
  for key, attempt in attempts.items():
    try:
      attempt()
      errors[key] = "no error"
    except ValueError as e:
      errors[key] = str(e)
  result["errors"] = errors
  result["compiles_during_errors"] = compiles.count() - before

  # Grouped/multi-query: K=2 on model=4 replicates kv (weights and cache), splits everything else.
  mqa = _tiny_cfg(heads=8, kv_heads=2)
  _use_tiny_model(mqa)
  ref = LLM(None, **kw)
  llm = LLM(None, mesh=MeshConfig(data=2, model=4), **kw)
  result["mqa"] = {
      "kv_spec": list(_spec(llm.model.layers[0].kv[...])), "q_spec": list(_spec(llm.model.layers[0].q[...])),
      "cache_spec": list(_spec(llm.engine.runner.state.cache.layers[0].k)),
      "logits_max_abs_diff": float(np.max(np.abs(llm.logits(SCORED) - ref.logits(SCORED)))),
  }

  # Prefix caching on a mesh: prompts sharing 70 tokens, one after another, hit; tokens equal one
  # device without the cache; the store's kv heads are split like the cache's; planned = allocated.
  import dataclasses

  _use_tiny_model(dataclasses.replace(_tiny_cfg(), sliding_window=32))
  pkw = dict(max_len=128, max_batch=8, prefill_chunk=32)
  shared = [10 + i for i in range(70)]
  prompts = [shared + [200 + i, 300 + i, 7] for i in range(4)]
  off = LLM(None, enable_prefix_caching=False, **pkw)
  on = LLM(None, mesh=MeshConfig(data=2, model=4), prefix_cache_tokens=20 * 16, **pkw)
  tokens_on, cached = [], []
  for p in prompts:
    tokens, _ = _greedy(on, [p])
    tokens_on += tokens
    cached.append(on.engine.metrics()["prefix_cache_hit_tokens"])
  result["prefix"] = {
      "tokens_off": _greedy(off, prompts)[0], "tokens_on": tokens_on, "hit_tokens": cached,
      "store_spec": list(_spec(on.engine.runner.store[0].k)), "cache_spec": list(_spec(on.engine.runner.state.cache.layers[0].k)),
      "plan_store": on.plan.prefix_store, "allocated_store": _device0_bytes(on.engine.runner.store),
      "budget_bytes": 20 * on.engine.config.store.total_bytes(on.cfg) // on.engine.config.store.blocks,
  }

  # Speculative decoding on a mesh: n-gram and a draft (the model's first 2 layers) give plain
  # decoding's tokens; the draft's cache is split over kv heads as the target's is.
  _use_tiny_model(_tiny_cfg())
  repeat = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 8 + [4]]
  plain = LLM(None, **kw)
  spec_kw = dict(kw, mesh=MeshConfig(data=2, model=4))
  ngram = LLM(None, speculative_config="ngram:3", **spec_kw)
  drafted = LLM(None, speculative_config={"method": "draft_model", "model": "self", "draft_layers": 2,
                                          "num_speculative_tokens": 3}, **spec_kw)
  result["speculative"] = {
      "plain": _greedy(plain, repeat, 24)[0], "ngram": _greedy(ngram, repeat, 24)[0],
      "draft": _greedy(drafted, repeat, 24)[0],
      "ngram_drafted": ngram.engine.metrics()["spec_draft_tokens"],
      "draft_accepted": drafted.engine.metrics()["spec_accepted_tokens"],
      "draft_cache_spec": list(_spec(drafted.engine.runner.drafter.cache.layers[0].k)),
      "draft_weight_spec": list(_spec(drafted.engine.runner.drafter.params["layers"][0]["q"][...])),
      "target_weight_spec": list(_spec(drafted.model.layers[0].q[...])),
      # Per device: the draft's cache, planned and allocated (its weights are the target's arrays).
      "plan_draft": drafted.plan.draft, "plan_draft_ngram": ngram.plan.draft, "plan_text": str(drafted.plan),
      "allocated_draft": sum(x.addressable_shards[0].data.nbytes
                             for x in jax.tree.leaves(drafted.engine.runner.drafter.cache)),
      "plan_kv": drafted.plan.kv_cache,  # rings k entries longer under speculation
      "allocated_kv": sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(drafted.engine.runner.state.cache)),
  }
  return result


def worker_embedded() -> dict:
  import jax
  import numpy as np
  from flax import nnx
  from jaxgen import LLM
  from jaxgen.decode.engine import Engine
  from jaxgen.sharding.mesh import MeshConfig

  d, m = EMBEDDED_MESH
  kw = dict(max_len=64, max_batch=2, prefill_chunk=16)
  llm = LLM(None, mesh=MeshConfig(data=d, model=m), **kw)
  prompts = ["The capital of France is", "def fibonacci(n):"]
  tokens, _ = _greedy(llm, prompts, max_tokens=8)
  ids = llm.tokenizer.encode("Sharding splits every weight matrix across devices.", add_special_tokens=True)
  logits = llm.logits(ids)
  bad, _ = _layout(llm, kv_replicated=True)
  hlo = _decode_hlo(llm)
  shard_shapes = {name: list(llm.model.layers[0].kv[...].addressable_shards[0].data.shape) if name != "embed"
                  else list(llm.model.embed[...].addressable_shards[0].data.shape) for name in ("embed", "layers.0.kv")}

  # One device, same weights (gathered back to the host), same engine settings.
  graphdef, state = nnx.split(llm.model)
  one = nnx.merge(graphdef, jax.tree.map(lambda a: jax.device_put(np.asarray(a), jax.devices()[0]), state))
  eng = Engine(one, llm.tokenizer, max_batch=2, max_len=64, prefill_chunk=16, cache_dtype="float32")
  from jaxgen import SamplingParams

  rids = [eng.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for p in prompts]
  done = {}
  while eng.has_unfinished():
    for out in eng.step():
      if out.finished:
        done[out.request_id] = out.outputs[0].token_ids
  padded = np.asarray([ids + [0] * (16 - len(ids) % 16)], np.int32)
  ref_logits = np.asarray(eng.runner.programs.logits(eng.runner.params, padded))[0, :len(ids)]
  return {
      "tokens": tokens, "reference_tokens": [done[r] for r in rids],
      "logits_max_abs_diff": float(np.max(np.abs(logits - ref_logits))),
      "layout_mismatches": bad, "weight_gathers": weight_gathers(hlo, _weight_sizes(llm.cfg)),
      "shard_shapes": shard_shapes, "plan": str(llm.plan),
  }


if __name__ == "__main__":
  out = {"tiny": worker_tiny, "embedded": worker_embedded}[sys.argv[1]]()
  print(json.dumps(out))
