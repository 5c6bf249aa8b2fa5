"""Generation from weights in memory: `LLM.from_weights`, `weights()`, `update_weights`.

Swaps must change what is generated exactly as the new weights say, compile nothing, copy
nothing that is already in place, and refuse a tree that does not fit while keeping the old one.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ToyTokenizer, tiny_config, tiny_model
from flax import nnx
from jaxgen import LLM, SamplingParams
from jaxgen.checkpoints.hf import tree_from_hf
from jaxgen.checkpoints.hf_tokenizer import tokenizer_from_hf_dir
from jaxgen.decode import compiles
from jaxgen.model import quant
from jaxgen.model.params import abstract_model, flat_params, logits_fn
from jaxgen.model.transformer import Transformer
from safetensors.numpy import load_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
scale = jax.jit(lambda tree, f: jax.tree.map(lambda w: w * f, tree))


@pytest.fixture(scope="module")
def tiny_llm():
  cfg = tiny_config(sliding_window=32)  # a window of two prefix-cache blocks: caching on
  return LLM.from_weights(cfg, flat_params(tiny_model(cfg)), ToyTokenizer(cfg.vocab_size), max_len=64, max_batch=2,
                          prefill_chunk=32, seed=0)


@pytest.mark.slow
def test_update_weights_equals_from_weights_and_swaps_back_bit_exactly(llm, golden):
  ids = [int(t) for t in golden["english"]["ids"]]
  greedy = SamplingParams(max_tokens=8, temperature=0)
  original = llm.weights()
  before = llm.logits(ids)
  tokens_before = llm.generate(ids, greedy, use_tqdm=False)[0].token_ids
  scaled = scale(original, 0.97)
  c0 = compiles.count()
  llm.update_weights(scaled)
  after = llm.logits(ids)
  tokens_after = llm.generate(ids, greedy, use_tqdm=False)[0].token_ids
  assert compiles.count() == c0  # swapping compiled nothing
  assert all(llm.weights()[k] is not original[k] for k in original)
  other = LLM.from_weights(llm.cfg, scaled, llm.tokenizer, max_len=256, max_batch=1, prefill_chunk=256)
  np.testing.assert_allclose(after, other.logits(ids), atol=1e-5, rtol=0)
  assert tokens_after == other.generate(ids, greedy, use_tqdm=False)[0].token_ids
  assert np.abs(after - before).max() > 1e-2  # the new weights were used
  del other
  c1 = compiles.count()
  llm.update_weights(original)
  assert np.array_equal(llm.logits(ids), before)  # back: bit for bit
  assert llm.generate(ids, greedy, use_tqdm=False)[0].token_ids == tokens_before
  assert compiles.count() == c1


def test_weights_are_the_engines_arrays_and_from_weights_copies_nothing():
  cfg = tiny_config()
  tree = flat_params(tiny_model(cfg))
  llm = LLM.from_weights(cfg, tree, ToyTokenizer(cfg.vocab_size), max_len=64, max_batch=1, prefill_chunk=32)
  got = llm.weights()
  assert sorted(got) == sorted(tree) and llm.dtype == "float32"
  assert all(got[k].unsafe_buffer_pointer() == tree[k].unsafe_buffer_pointer() for k in tree)


@pytest.mark.parametrize("change,message", [
    (lambda t: {k: v for k, v in t.items() if k != "layers.1.o"}, "lacks parameter 'layers.1.o'"),
    (lambda t: {**t, "layers.9.q": t["layers.1.q"]}, "has 'layers.9.q'"),
    (lambda t: {**t, "layers.2.q": t["layers.2.q"][:, :1]}, "['layers.2.q'] has shape (4, 1, 32), expected (4, 16, 32)"),
    (lambda t: {**t, "final_norm": t["final_norm"].astype(jnp.bfloat16)}, "['final_norm'] has dtype bfloat16, expected float32"),
    (lambda t: [t], "give a mapping"),
])
def test_a_mismatched_tree_is_refused_and_the_old_weights_stay(tiny_llm, change, message):
  prompt = [2, 10, 11, 12, 13]
  before = tiny_llm.logits(prompt)
  with pytest.raises(ValueError) as e:
    tiny_llm.update_weights(change(tiny_llm.weights()))
  assert message in str(e.value)
  assert np.array_equal(tiny_llm.logits(prompt), before)


def test_requests_in_flight_are_aborted_and_the_prefix_cache_emptied(tiny_llm):
  eng = tiny_llm.engine
  prompt = list(range(3, 40))
  tiny_llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
  again = tiny_llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
  assert again.num_cached_tokens > 0
  rid = eng.add_request(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
  for _ in range(3):
    eng.step()
  tiny_llm.update_weights(scale(tiny_llm.weights(), 1.0))
  assert not eng.has_unfinished() and rid not in eng.requests and all(s is None for s in eng.scheduler.slots)
  out = tiny_llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
  assert out.num_cached_tokens == 0  # the store was emptied: nothing is reused across weights


def test_int8_engine_takes_float_weights_and_quantizes_them_on_device():
  cfg = tiny_config()
  tree = flat_params(tiny_model(cfg))
  llm = LLM.from_weights(cfg, tree, ToyTokenizer(cfg.vocab_size), max_len=64, max_batch=1, prefill_chunk=32,
                         quantization="int8")
  assert llm.weights()["layers.0.q"].dtype == jnp.int8
  prompt = [2, 10, 11, 12]
  llm.logits(prompt)
  new = scale(tree, 0.5)
  llm.update_weights(new)
  values, scales = quant.quantize(new["layers.0.q"])
  assert np.array_equal(llm.weights()["layers.0.q"], values)
  assert np.array_equal(llm.weights()["layers.0.q_scale"], scales)
  after = llm.logits(prompt)
  c0 = compiles.count()  # the quantizer compiled once per weight shape; the model's programs not at all
  llm.update_weights(scale(tree, 0.25))
  assert np.abs(llm.logits(prompt) - after).max() > 1e-3
  assert compiles.count() == c0


def test_training_loop_interleaved_with_generation(tiny_llm):
  """Plain-JAX gradient steps raise log p(target | prompt); the engine's log-probs follow them."""
  llm, forward = tiny_llm, logits_fn(tiny_llm.cfg, tiny_llm.dtype)
  prompt, target = [2, 10, 11, 12, 13, 14], 77

  def loss(tree):
    logits = forward(tree, jnp.asarray([prompt], jnp.int32))[0, -1]
    return -jax.nn.log_softmax(logits)[target]

  step = jax.jit(lambda tree: jax.tree.map(lambda w, g: w - 0.05 * g, tree, jax.grad(loss)(tree)))
  value = jax.jit(loss)
  tree = llm.weights()
  losses, engine_lp = [], []
  c0 = None
  for r in range(8):
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=20), use_tqdm=False)[0]
    first = out.outputs[0].logprobs[0]
    if target in first:
      engine_lp.append(first[target].logprob)
      assert first[target].logprob == pytest.approx(-float(value(tree)), abs=1e-4)
    losses.append(float(value(tree)))
    tree = step(tree)
    llm.update_weights(tree)
    if r == 0:
      c0 = compiles.count()
  assert compiles.count() == c0  # nothing compiled after the first round
  assert all(b < a for a, b in zip(losses, losses[1:]))  # each step lowered the loss...
  assert len(engine_lp) >= 3 and all(b > a for a, b in zip(engine_lp, engine_lp[1:]))  # ...and generation saw it
  final = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
  assert final.token_ids == [target]


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_an_hf_state_dict_in_memory_gives_transformers_logits(name):
  """{HF name: [out, in] array} and config.json's dict -> jaxgen's tree (`tree_from_hf`), against
  the logits transformers computed for the same weights (tests/data/hf, see test_hf.py)."""
  model_dir = ROOT / "tests" / "data" / "hf" / name
  config = json.loads((model_dir / "config.json").read_text())
  tensors = {}
  for file in sorted(model_dir.glob("*.safetensors")):
    tensors.update(load_file(str(file)))
  cfg, tree = tree_from_hf(config, tensors)
  llm = LLM.from_weights(cfg, tree, tokenizer_from_hf_dir(str(model_dir)), max_len=128, max_batch=1)
  arrays = dict(np.load(ROOT / "tests" / "data" / "hf" / f"{name}.npz"))
  np.testing.assert_allclose(llm.logits(arrays["ids_0"].tolist()), arrays["logits_0"], atol=1e-4, rtol=0)
  some = next(k for k in tensors if "layers.0.mlp" in k)
  with pytest.raises(ValueError, match=re.escape(some)):
    tree_from_hf(config, {k: v for k, v in tensors.items() if k != some})
  with pytest.raises(ValueError, match="no place"):
    tree_from_hf(config, {**tensors, "model.layers.0.extra.weight": tensors[some]})


@pytest.mark.slow
def test_sharded_update_moves_no_byte_through_the_host():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, __file__, "sharded"], env=env, capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stderr[-5000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["devices"] == 8
  assert got["reused_buffers"] == got["shards"] > 100
  assert got["compiles"] == 0
  assert got["max_diff_vs_single_device"] <= 1e-4
  assert got["host_tree_max_diff"] <= 1e-4


@pytest.mark.slow
def test_rl_example_runs_and_learns():
  proc = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--rounds", "10"], capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-5000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["compiles_after_first_round"] == 0
  assert got["max_logprob_gap"] <= 1e-4  # the engine samples from the weights being trained
  assert np.mean(got["rewards"][-3:]) > np.mean(got["rewards"][:3]) + 0.2


def worker_sharded() -> dict:
  """8 devices, data=2 x model=4: an on-device update reuses every shard's buffer, with no transfer."""
  from jaxgen.sharding.mesh import MeshConfig

  cfg = tiny_config(num_heads=8, num_kv_heads=4, embed_dim=64, mlp_dim=128)
  tree = flat_params(tiny_model(cfg))
  host = {k: np.asarray(v) for k, v in tree.items()}
  llm = LLM.from_weights(cfg, tree, ToyTokenizer(cfg.vocab_size), mesh=MeshConfig(data=2, model=4), max_len=64,
                         max_batch=2, prefill_chunk=32)
  prompt = [2, 10, 11, 12, 13]
  llm.logits(prompt)
  llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
  new = scale(llm.weights(), 0.9)  # computed on the mesh, laid out as the rules say
  c0 = compiles.count()
  with jax.transfer_guard("disallow_explicit"):
    llm.update_weights(new)
  got = llm.weights()
  shards = reused = 0
  for k, x in got.items():
    for a, b in zip(x.addressable_shards, new[k].addressable_shards):
      shards += 1
      reused += a.data.unsafe_buffer_pointer() == b.data.unsafe_buffer_pointer()
  sharded_logits = llm.logits(prompt)
  llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
  compiled = compiles.count() - c0
  single = LLM.from_weights(cfg, {k: jnp.asarray(v * np.float32(0.9)) for k, v in host.items()},
                            ToyTokenizer(cfg.vocab_size), max_len=64, max_batch=2, prefill_chunk=32)
  diff = float(np.abs(sharded_logits - single.logits(prompt)).max())
  llm.update_weights({k: v * np.float32(0.9) for k, v in host.items()})  # host arrays: placed shard by shard
  host_diff = float(np.abs(llm.logits(prompt) - sharded_logits).max())
  return dict(devices=jax.device_count(), shards=shards, reused_buffers=reused, compiles=compiled,
              max_diff_vs_single_device=diff, host_tree_max_diff=host_diff)


if __name__ == "__main__":
  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  print(json.dumps({"sharded": worker_sharded}[sys.argv[1]]()))


def test_a_model_without_rngs_is_zeros_with_the_same_structure():
  """`Transformer(cfg)` without `rngs` has zero weights (what `abstract_model` traces: 200 random
  initialisers cost a start ~0.1 s), and the same parameters, shapes and dtypes as a random one."""
  cfg = tiny_config()
  random = flat_params(Transformer(cfg, rngs=nnx.Rngs(0)))
  zeros = flat_params(Transformer(cfg))
  shapes = {k: (v.shape, v.dtype) for k, v in flat_params(abstract_model(cfg, jnp.float32)).items()}
  assert shapes == {k: (v.shape, v.dtype) for k, v in random.items()}
  assert shapes == {k: (v.shape, v.dtype) for k, v in zeros.items()}
  assert np.abs(np.asarray(random["layers.0.q"])).max() > 0 and not np.asarray(zeros["layers.0.q"]).any()
