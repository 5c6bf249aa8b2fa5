"""What a TPU runs, run on this CPU against the golden data: `LLM(emulate="tpu")` takes the TPU's
choices (activations and KV cache in the weights' 16-bit dtype, plain XLA ops, a cache aligned to
the sublane tile) and runs them on XLA:CPU. The CPU's own platform computes in float32 whatever
the weights' dtype, so without this the accelerators' numerics would go untested.

Checked through the engine, not one step: prefill and decode over a bf16 cache, a second sample
of a prompt (n=2, a forked row), a prefix-cache hit, and speculative verify steps. bf16 on
XLA:CPU is slow (its 16-bit matmuls fall off the fast paths): the prompts are the short golden
ones, 12 tokens each.
"""

from __future__ import annotations

import numpy as np
import pytest
from jaxgen import LLM, SamplingParams

pytestmark = pytest.mark.slow
SHORT = ("english", "code", "list", "multilingual", "chat")  # "long" (1,177 tokens) takes minutes here


def log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def tpu_bf16():
  return LLM(dtype="bfloat16", emulate="tpu", attention_impl="xla", max_len=256, max_batch=4, seed=0,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def test_the_platform_is_the_tpus(tpu_bf16):
  p = tpu_bf16.platform
  assert p.backend == "tpu" and p.emulated and p.activation_dtype is None and p.cache_dtype == "bfloat16"
  assert p.matmul == "xla" and p.attention == "xla" and p.cache_align == 16
  assert tpu_bf16.engine.config.cache.layer_len(tpu_bf16.cfg, "global") % 16 == 15  # + the scratch entry: a multiple of 16


def test_bf16_activations_and_cache_stay_close_to_the_reference(tpu_bf16, golden):
  """The uncached forward pass in bf16 throughout, against HF transformers in float32: top-1 and
  KL over the reference's top 32 at every prompt position."""
  agree = total = 0
  kls = []
  for name in SHORT:
    g = golden[name]
    lp = log_softmax(tpu_bf16.logits(g["ids"].tolist()).astype(np.float64))
    agree += int((lp.argmax(-1) == g["top_ids"][:, 0]).sum())
    total += len(g["ids"])
    got = np.take_along_axis(lp, g["top_ids"], axis=-1)
    kls.append((np.exp(g["top_logprobs"]) * (g["top_logprobs"] - got)).sum(-1))
  top1, kl = agree / total, float(np.concatenate(kls).mean())
  print(f"bf16 activations and cache vs float32 reference ({total} positions): top-1 {top1:.3f}, KL {kl:.2e}")
  # Measured here (243 positions): top-1 0.975, KL 6.9e-5 nats over the top 32 (all six prompts,
  # 1,420 positions: 0.968 and 2.6e-4). Bounds within 3x: the disagreement and the KL.
  assert top1 >= 0.93 and kl < 2e-4, (top1, kl)


def test_the_engine_in_bf16_decodes_the_reference_continuations(tpu_bf16, golden):
  """Greedy through prefill, decode and verify over the bf16 cache: the reference's tokens up to
  the first position where its own top-2 margin is under 0.01 (a tie bf16 may break either way)."""
  greedy = SamplingParams(max_tokens=12, temperature=0)
  prompts = [golden[name]["ids"].tolist() for name in SHORT]
  outs = tpu_bf16.generate(prompts, greedy, use_tqdm=False)
  for name, out in zip(SHORT, outs):
    want, margin = golden[name]["greedy_ids"][:12], golden[name]["greedy_margin"][:12]
    clear = int(np.argmax(margin < 1e-2)) if (margin < 1e-2).any() else 12
    assert out.outputs[0].token_ids[:clear] == want[:clear].tolist(), name
  metrics = tpu_bf16.engine.metrics()
  assert metrics["spec_verify_steps"] > 0  # the verify program ran, in bf16 too

  # n=2 greedy: the forked row decodes the same tokens; the prompt again: a prefix-cache hit, same output.
  again = tpu_bf16.generate(prompts[1], SamplingParams(max_tokens=12, temperature=0, n=2), use_tqdm=False)[0]
  assert [c.token_ids for c in again.outputs] == [outs[1].outputs[0].token_ids] * 2
  assert again.num_cached_tokens > 0


def test_float16_serves_a_llama_and_refuses_gemma_with_the_reason():
  """float16 activations (a GPU's choice for float16 weights), emulated: a Llama-shaped model's
  logits and greedy tokens as in float32; Gemma's activations overflow float16's range (the
  embedded model gave NaN at every golden position), so an engine for it is refused by name."""
  from conftest import ToyTokenizer, tiny_config, tiny_model
  from jaxgen import plan
  from jaxgen.decode.config import EngineConfig
  from jaxgen.model.params import flat_params
  from jaxgen.model.platform import resolve

  gemma, _ = plan.model_config(None)
  with pytest.raises(ValueError, match=r"dtype='float16' computes in float16 .* gemma3 .*'bfloat16' or 'float32'"):
    EngineConfig.resolve(gemma, "float16", max_batch=1, max_len=64, platform=resolve("float16", emulate="gpu"))

  cfg = tiny_config(family="llama", norm_offset=0.0, qk_norm=False, sandwich_norm=False, activation="silu",
                    embed_scale=False, layer_kinds=("global",) * 4, sliding_window=None)
  tree = {name: np.asarray(x).astype(np.float16) for name, x in flat_params(tiny_model(cfg, seed=3)).items()}
  kw = dict(max_len=64, max_batch=2, prefill_chunk=32, seed=0)
  f16 = LLM.from_weights(cfg, tree, ToyTokenizer(cfg.vocab_size), dtype="float16", emulate="gpu", **kw)
  # The same (float16-rounded) weights in float32: what differs is the activations' precision.
  f32 = LLM.from_weights(cfg, {name: x.astype(np.float32) for name, x in tree.items()}, ToyTokenizer(cfg.vocab_size),
                         dtype="float32", **kw)
  assert f16.platform.activation_dtype is None and f16.platform.cache_dtype == "float16"
  prompt = [5, 17, 99, 3, 250, 41, 8]
  err = np.abs(f16.logits(prompt) - f32.logits(prompt)).max()
  greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
  outs = [llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids for llm in (f16, f32)]
  print(f"float16 vs float32 logits: max |diff| {err:.2e}")
  assert 0 < err < 2.5e-4, err  # measured 8.5e-5 (not 0: the activations were float16)
  assert outs[0] == outs[1]
