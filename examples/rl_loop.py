"""Reinforcement learning with jaxgen as the sampler: sample, score, step, update; repeat.

Each round the policy samples n completions per prompt with their log-probabilities (jaxgen's
engine, compiled once), a toy reward scores them (the share of lowercase letters among the tokens),
REINFORCE with a mean baseline takes one gradient step in plain JAX on the same weight tree, and
`llm.update_weights` swaps the new tree in: no checkpoint written, nothing recompiled.

By default the policy is a small random Gemma-3-shaped model with a byte-level tokenizer, so this
runs in seconds on a CPU; `--model PATH` trains a real checkpoint instead (GGUF, HF or orbax).
The last line printed is a JSON summary (rewards per round, the largest gap between the engine's
log-probabilities and the training graph's, compiles after the first round).

  python examples/rl_loop.py [--rounds 12] [--lr 1.0] [--model PATH]
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxgen import LLM, SamplingParams
from jaxgen.checkpoints.tokenizer import byte_tokenizer
from jaxgen.decode import compiles
from jaxgen.model.config import ModelConfig, layer_pattern
from jaxgen.model.params import flat_params, logits_fn
from jaxgen.model.transformer import Transformer

PROMPTS = ["Say it:  ", "Now say: ", "Go on:   "]  # the same length in bytes: one shape for the step


def small_policy(seed: int = 0) -> LLM:
  """A 2-layer random policy over a byte-level vocabulary."""
  tokenizer = byte_tokenizer()
  cfg = ModelConfig(family="gemma3", vocab_size=tokenizer.vocab_size, embed_dim=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, mlp_dim=128, max_context=256, norm_offset=1.0, rope_base=1e6,
                    rope_base_local=1e4, sliding_window=32, query_scale=0.25, embed_scale=True,
                    activation="gelu_tanh", qk_norm=True, sandwich_norm=True, layer_kinds=layer_pattern(2, 2, 32))
  tree = flat_params(Transformer(cfg, rngs=nnx.Rngs(seed)))
  return LLM.from_weights(cfg, tree, tokenizer, max_len=64, max_batch=16, prefill_chunk=16, seed=seed)


def reward(tokenizer, token_ids) -> float:
  """The toy task: the share of tokens that are one lowercase letter."""
  pieces = [tokenizer.decode([t]) for t in token_ids]
  return sum(len(x) == 1 and "a" <= x <= "z" for x in pieces) / max(len(pieces), 1)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=None, help="a checkpoint to train (default: a small random policy)")
  p.add_argument("--rounds", type=int, default=12)
  p.add_argument("--samples", type=int, default=4, help="completions per prompt (n)")
  p.add_argument("--tokens", type=int, default=12, help="tokens per completion")
  p.add_argument("--lr", type=float, default=1.0)
  a = p.parse_args(argv)
  llm = small_policy() if a.model is None else LLM(a.model, max_len=256, max_batch=16)
  forward = logits_fn(llm.cfg, llm.dtype)
  prompt_ids = [llm.tokenizer.encode(t) for t in PROMPTS]
  if len({len(x) for x in prompt_ids}) != 1:
    raise ValueError("the prompts must have the same number of tokens (one shape for the gradient step)")

  def sequence_logprobs(tree, tokens, start):
    """Sum of log p(token t | tokens before t) over t >= start: [B]."""
    logp = jax.nn.log_softmax(forward(tree, tokens[:, :-1]), axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return picked[:, start - 1:].sum(axis=-1), picked[:, start - 1:]

  @functools.partial(jax.jit, static_argnums=3)
  def step(tree, tokens, advantages, start):
    def loss(tree):
      return -jnp.mean(advantages * sequence_logprobs(tree, tokens, start)[0])
    value, grads = jax.value_and_grad(loss)(tree)
    return jax.tree.map(lambda w, g: w - a.lr * g, tree, grads), value

  tree = llm.weights()
  rewards, gaps, compiles_after_first = [], [], None
  for r in range(a.rounds):
    params = SamplingParams(n=a.samples, max_tokens=a.tokens, min_tokens=a.tokens, temperature=1.0, seed=r,
                            logprobs=0, ignore_eos=True)
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    tokens, engine_lp, scores = [], [], []
    for ids, out in zip(prompt_ids, outs):
      for c in out.outputs:
        tokens.append(ids + c.token_ids)
        engine_lp.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        scores.append(reward(llm.tokenizer, c.token_ids))
    tokens, scores = jnp.asarray(tokens, jnp.int32), np.asarray(scores, np.float32)
    start = len(prompt_ids[0])
    # The engine sampled with the weights being trained: its log-probabilities are the graph's.
    _, graph_lp = jax.jit(sequence_logprobs, static_argnums=2)(tree, tokens, start)
    gaps.append(float(np.max(np.abs(np.asarray(graph_lp) - np.asarray(engine_lp)))))
    advantages = jnp.asarray(scores - scores.mean())
    tree, loss = step(tree, tokens, advantages, start)
    llm.update_weights(tree)
    rewards.append(float(scores.mean()))
    print(f"round {r:2d}: mean reward {rewards[-1]:.3f}  loss {float(loss):+.4f}  "
          f"engine vs graph log-prob gap {gaps[-1]:.1e}", flush=True)
    if r == 0:
      compiles_after_first = compiles.count()
  summary = dict(rewards=rewards, max_logprob_gap=max(gaps),
                 compiles_after_first_round=compiles.count() - compiles_after_first)
  print(json.dumps(summary))
  return summary


if __name__ == "__main__":
  main()
