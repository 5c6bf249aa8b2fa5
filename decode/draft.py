"""Draft-model proposals for speculative decoding: a cheaper model with a cache of its own.

The draft has one cache row per engine slot, moved with it. A row's draft cache holds the row's
first `RowSpec.draft_held` positions; before the draft proposes for a row it is caught up to all
but the row's last two tokens (a prompt chunk through the draft, as prefill does), then

  `propose` feeds those two tokens (positions L-1 and L, L the row's length; the first rewrites
  what the draft already holds) and greedily continues k-1 more steps in one compiled program:
  proposals d1..dk, the draft's cache written up to position L+k-1.

The target's verify step accepts a of them; the draft then holds positions up to L+min(a, k-1),
which is at least the row's new length minus one: the next `propose` needs no catch-up. A row that
did not propose for a while (paused, penalised) is caught up when it next does.

Greedy proposals keep verification exact for sampled rows too (a proposal is one fixed token,
accepted when it equals the row's own draw: `steps.verify_step`); they are accepted less often
there than the draft's own distribution would be.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxgen.checkpoints import source
from jaxgen.decode.buckets import bucket
from jaxgen.decode.cache import CacheSpec, KVCache, allocate
from jaxgen.model.batch import BatchMeta
from jaxgen.model.platform import Platform
from jaxgen.model.transformer import Transformer, first_layers
from jaxgen.sharding import rules

PROBE = "The quick brown fox, 1234 -- jumps! Über déjà vu."  # a draft's tokenizer must encode it alike


def load(spec_cfg, target: Transformer, target_source: str | None, tokenizer, dtype: str,
         mesh: jax.sharding.Mesh | None = None) -> Transformer:
  """The draft model a `SpecConfig` names: "self" is the target's own checkpoint (the target itself,
  re-read quantized when `quantization` asks for other weights); `draft_layers` keeps its first N
  layers. A draft must share the target's vocabulary (ValueError naming the field otherwise). On a
  mesh a draft read from a checkpoint is placed shard by shard, as the target is."""
  q = spec_cfg.quantization
  if spec_cfg.model == "self":
    same = q in (None, target.cfg.weight_quant)
    draft = target if same else source.load(target_source, dtype, mesh=mesh, quantization=q)[1]
  else:
    _, draft, draft_tokenizer = source.load(spec_cfg.model, dtype, mesh=mesh, quantization=q)
    if draft.cfg.vocab_size != target.cfg.vocab_size:
      raise ValueError(f"speculative_config model={spec_cfg.model!r} has vocab_size={draft.cfg.vocab_size}; the "
                       f"target's is {target.cfg.vocab_size} (a draft must share the target's vocabulary)")
    if draft_tokenizer.encode(PROBE) != tokenizer.encode(PROBE):
      raise ValueError(f"speculative_config model={spec_cfg.model!r} has another tokenizer than the target "
                       "(a draft must share the target's vocabulary)")
  return draft if spec_cfg.draft_layers is None else first_layers(draft, spec_cfg.draft_layers)


def catch_up(graphdef, params, cache: KVCache, tokens, start, counts, slots, *, platform: Platform) -> KVCache:
  """Writes tokens [P, T] (the first counts[p] of each row) at positions start[p].. of rows `slots`."""
  model = nnx.merge(graphdef, params)
  t = tokens.shape[1]
  positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  _, layers = model(tokens, positions, platform, cache.layers, BatchMeta(start, counts, slots))
  return KVCache(layers, cache.lengths.at[slots].set(start + counts))


def propose(graphdef, params, cache: KVCache, active, window, start, *, k: int, platform: Platform):
  """Among the lowest R rows, each active one is fed window [R, 2] at positions start, start + 1
  and proposes k tokens greedily. -> (cache, proposals [R, k])."""
  model = nnx.merge(graphdef, params)
  r = active.shape[0]
  fed = active.astype(jnp.int32)
  positions = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
  hidden, layers = model(window, positions, platform, cache.layers, BatchMeta(start, 2 * fed))
  first = jnp.argmax(model.logits(hidden[:, 1], platform), axis=-1).astype(jnp.int32)

  def step(i, carry):
    layers, tokens = carry
    lengths = start + 1 + i  # held before this step: the window, then i - 1 proposals
    hidden, layers = model(tokens[:, i - 1, None], lengths[:, None], platform, layers, BatchMeta(lengths, fed))
    nxt = jnp.argmax(model.logits(hidden[:, 0], platform), axis=-1).astype(jnp.int32)
    return layers, tokens.at[:, i].set(nxt)

  tokens = jnp.zeros((r, k), jnp.int32).at[:, 0].set(first)
  layers, tokens = jax.lax.fori_loop(1, k, step, (layers, tokens))
  lengths = jax.lax.dynamic_update_slice(cache.lengths, jnp.where(active, start + k + 1, cache.lengths[:r]), (0,))
  return KVCache(layers, lengths), tokens


def move(cache: KVCache, src, dst) -> KVCache:
  return jax.tree.map(lambda a: a.at[dst].set(a[src]), cache)


class Drafter:
  """A draft model's cache and programs, driven by the runner (`Runner._draft`)."""

  def __init__(self, model: Transformer, spec: CacheSpec, platform: Platform, k: int, prompt_buckets, row_buckets,
               mesh: jax.sharding.Mesh | None = None):
    self.cfg, self.k = model.cfg, k
    self.graphdef, self.params = nnx.split(model)
    self.prompt_buckets, self.row_buckets = prompt_buckets, row_buckets
    part = functools.partial
    kw = {"catch_up": {}, "propose": {}, "move": {}}
    if mesh is None:
      self.cache = allocate(model.cfg, spec)
    else:
      # On a mesh the draft's weights and cache follow the rules table, as the target's do: its
      # programs declare them, so nothing is gathered or moved between steps.
      ps = rules.param_tree(self.params, rules.param_shardings(model.cfg, model.dtype, mesh))
      cs = rules.tree_shardings(spec.shapes(model.cfg), spec.axes(model.cfg), mesh, "draft.")
      rep = rules.replicated(mesh)
      self.params = jax.device_put(self.params, ps)  # no copy for arrays laid out so already
      self.cache = jax.jit(part(allocate, model.cfg, spec), out_shardings=cs)()  # each device its own part
      kw = {"catch_up": dict(in_shardings=(ps, cs) + (rep,) * 4, out_shardings=cs),
            "propose": dict(in_shardings=(ps, cs) + (rep,) * 3, out_shardings=(cs, rep)),
            "move": dict(in_shardings=(cs, rep, rep), out_shardings=cs)}
    self._catch_up = jax.jit(part(catch_up, self.graphdef, platform=platform), donate_argnums=(1,), **kw["catch_up"])
    self._propose = jax.jit(part(propose, self.graphdef, k=k, platform=platform), donate_argnums=(1,), **kw["propose"])
    self._move = jax.jit(move, donate_argnums=(0,), **kw["move"])

  def catch_up(self, slot: int, history: np.ndarray, held: int, upto: int) -> int:
    """Writes positions held..upto-1 of `history` into the row; returns upto."""
    chunk = self.prompt_buckets[-1]
    for lo in range(held, upto, chunk):
      n = min(chunk, upto - lo)
      tokens = np.zeros((1, bucket(n, self.prompt_buckets)), np.int32)
      tokens[0, :n] = history[lo:lo + n]
      self.cache = self._catch_up(self.params, self.cache, tokens, np.array([lo], np.int32), np.array([n], np.int32),
                                  np.array([slot], np.int32))
    return max(held, upto)

  def propose(self, active: np.ndarray, window: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Proposals [R, k] of the active rows (read back: the verify step needs them)."""
    self.cache, tokens = self._propose(self.params, self.cache, active, window, start)
    return np.asarray(tokens)

  def move(self, src: int, dst: int) -> None:
    self.cache = self._move(self.cache, np.int32(src), np.int32(dst))

  def warm(self, program: str, *shape) -> None:
    """Runs one of its programs (`EngineConfig.programs`: draft_catch_up, draft_propose,
    draft_move) once with throwaway inputs on row 0."""
    one = np.ones(1, np.int32)
    if program == "draft_catch_up":
      self.cache = self._catch_up(self.params, self.cache, np.zeros((1, shape[0]), np.int32), 0 * one, one, 0 * one)
    elif program == "draft_propose":
      rows = shape[0]
      self.propose(np.zeros(rows, np.bool_), np.zeros((rows, 2), np.int32), np.zeros(rows, np.int32))
    elif program == "draft_move":
      self.move(0, 0)
    else:
      raise ValueError(f"the draft model has no program {program!r}")
