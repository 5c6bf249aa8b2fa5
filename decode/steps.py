"""The compiled programs. Only these are jitted; the decode state is donated to each.

State = KV cache + sampler state (per-row parameters, next tokens, penalty counts). Both live on
device for the whole run; the host passes only small arrays (prompt chunk, slot ids, active mask)
and reads back only the sampled ids (and logprobs when asked).

- `prefill(params, state, tokens [P, T], counts [P], slots [P], row_params)`: writes P prompt
  chunks (padded to the bucket T) into their slots, sets the slots' sampling parameters and
  returns the logits of each chunk's last token. `fresh=True` (static) starts the slots empty;
  `fresh=False` continues them (chunked prefill), attending to what they already hold.
- `decode_step(params, state, active [R])`: feeds every active row among the lowest R slots (R a
  row bucket) its next token and returns their logits: a step costs what its rows cost, not what
  the slots do.
- `sample_rows(state, logits [R, V], rows [R], take [R], want_logprobs, mask [R, V/32],
  constrained [R])`: draws each row's next token (`decode.sampling`), a constrained row among the
  tokens its grammar allows; one program per row count for prefill and decode alike.
- `verify(params, state, active [R], proposals [R, k], counts [R], want_logprobs,
  mask [R * (k + 1), V/32], constrained [R])`: speculative
  decoding's step: each active row is fed its next token and its first counts[r] proposals in one
  pass (T = k + 1), samples every position as a decode step would, keeps the longest run of
  proposals equal to its own samples plus the sample after it, and rolls back by length.
- `fork(state, src, dst, ...)`: another sample of a prompt in slot dst, sharing src's prefill.
- `move(state, src, dst)`: slot src's whole row into slot dst (the engine keeps rows low).
- `logits(params, tokens [1, T])`: one uncached forward pass (`LLM.logits`).
- `save(state, store, slot, first, ids)` / `restore(state, store, slot, ids, length, tokens)`:
  blocks of a row into the prefix store, and a cached prefix into a row (`decode.prefix`).
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jaxgen.decode import prefix
from jaxgen.decode.cache import CacheSpec, KVCache, allocate, full_capacity
from jaxgen.decode.sampling import RowParams, SamplerState, idle_rows, sample
from jaxgen.model.batch import BatchMeta
from jaxgen.model.config import ModelConfig
from jaxgen.model.platform import Platform
from jaxgen.sharding import planner, rules


@flax.struct.dataclass
class DecodeState:
  cache: KVCache
  sampler: SamplerState


def init_state(cfg: ModelConfig, spec: CacheSpec) -> DecodeState:
  """An empty cache and an idle sampler state for `spec.slots` rows, on the default device."""
  return DecodeState(allocate(cfg, spec), idle_rows(spec.slots, cfg.vocab_size))


def state_axes(cfg: ModelConfig, spec: CacheSpec):
  """(shapes, logical axes) of the decode state: the cache's own axes; every sampler array leads
  with the slot axis (`cache_batch`)."""
  shapes = jax.eval_shape(lambda: init_state(cfg, spec))
  sampler_axes = jax.tree.map(lambda s: ("cache_batch",) + (None,) * (len(s.shape) - 1), shapes.sampler)
  return shapes, DecodeState(spec.axes(cfg), sampler_axes)


def state_shardings(cfg: ModelConfig, spec: CacheSpec, mesh) -> DecodeState:
  """A DecodeState tree of NamedShardings, from the rules table."""
  shapes, axes = state_axes(cfg, spec)
  return rules.tree_shardings(shapes, axes, mesh, "state.")


def memory_plan(cfg: ModelConfig, dtype, spec: CacheSpec, mesh, capacity: int | None = None,
                store: prefix.StoreSpec | None = None, draft=None) -> planner.Plan:
  """Bytes per device of the weights and this engine's state on `mesh` (nothing allocated);
  `store`: the prefix store, if any; `draft`: (draft config, dtype, whether its weights are the
  target's own arrays) of a speculative draft model, whose cache is laid out as the target's."""
  shapes, axes = state_axes(cfg, spec)
  if draft is not None:
    draft_cfg, draft_dtype, shared = draft
    draft = (None if shared else draft_cfg, draft_dtype, (spec.shapes(draft_cfg), spec.axes(draft_cfg)))
  return planner.plan(cfg, dtype, mesh, (shapes.cache, axes.cache), (shapes.sampler, axes.sampler),
                      slots=spec.slots, max_len=spec.max_len, capacity=capacity,
                      prefix_store=None if store is None else (store.shapes(cfg), store.axes(cfg)), draft=draft)


def _put_rows(tree, idx, rows):
  return jax.tree.map(lambda a, r: a.at[idx].set(r), tree, rows)


def prefill_logits(model, cache: KVCache, tokens, counts, slots, *, fresh: bool, platform: Platform):
  """Writes P prompt chunks into cache rows `slots`; returns (logits of each last real token [P, V], cache)."""
  p, t = tokens.shape
  start = jnp.zeros((p,), jnp.int32) if fresh else cache.lengths[slots]
  positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  rows = BatchMeta(start, counts, slots, fresh)
  hidden, layers = model(tokens, positions, platform, cache.layers, rows)
  last = jnp.take_along_axis(hidden, (counts - 1)[:, None, None], axis=1)[:, 0]  # [P, D]
  return model.logits(last, platform), KVCache(layers, cache.lengths.at[slots].set(start + counts))


def decode_logits(model, cache: KVCache, tokens, active, *, limit: int | None, platform: Platform):
  """Feeds tokens [R] to the active rows among the lowest R. Returns (logits [R, V], cache, count [R]
  of tokens written). limit: tokens a row can hold (None: no global layer, no limit)."""
  r = active.shape[0]
  lengths = cache.lengths[:r]
  count = active if limit is None else active & (lengths < limit)
  count = count.astype(jnp.int32)
  hidden, layers = model(tokens[:, None], lengths[:, None], platform, cache.layers, BatchMeta(lengths, count))
  new_lengths = jax.lax.dynamic_update_slice(cache.lengths, lengths + count, (0,))
  return model.logits(hidden[:, 0], platform), KVCache(layers, new_lengths), count


def prefill(graphdef, params, state: DecodeState, tokens, counts, slots, row_params: RowParams, *, fresh: bool,
            platform: Platform):
  """Writes the chunks and sets the slots' sampling rows; returns (state, logits [P, V]) of each
  chunk's last token, for `sample_rows` to draw from."""
  model = nnx.merge(graphdef, params)
  v = model.cfg.vocab_size
  p, t = tokens.shape
  logits, cache = prefill_logits(model, state.cache, tokens, counts, slots, fresh=fresh, platform=platform)
  s = state.sampler
  valid = jnp.arange(t)[None, :] < counts[:, None]
  seen = jnp.zeros((p, v), jnp.bool_) if fresh else s.seen_prompt[slots]
  seen = seen.at[jnp.arange(p)[:, None], jnp.where(valid, tokens, v)].set(True, mode="drop")
  sampler = s.replace(
      params=_put_rows(s.params, slots, row_params),
      seen_prompt=s.seen_prompt.at[slots].set(seen),
      out_counts=s.out_counts.at[slots].set(jnp.zeros((p, v), jnp.int32)))
  return DecodeState(cache, sampler), logits


def decode_step(graphdef, params, state: DecodeState, active, *, limit: int | None, platform: Platform):
  """Feeds each active row among the lowest R its next token; returns (state, logits [R, V], taken
  [R]: whether the row took it), for `sample_rows` to draw from."""
  model = nnx.merge(graphdef, params)
  s = state.sampler
  r = active.shape[0]
  tokens = s.tokens[:r]
  logits, cache, count = decode_logits(model, state.cache, tokens, active, limit=limit, platform=platform)
  out_counts = s.out_counts.at[jnp.arange(r), tokens].add(count)
  return DecodeState(cache, s.replace(out_counts=out_counts)), logits, count > 0


def sample_rows(state: DecodeState, logits, rows, take, want_logprobs, mask, constrained):
  """Draws the next token of slots `rows` [R] from their logits [R, V], at their current lengths
  (the position the drawn token will take); a row with take[r] keeps it as its next token, a row
  with constrained[r] draws among the tokens its mask [R, ceil(V/32)] allows.

  Its own program, one per row count, shared by every prefill bucket and the decode step of that
  many rows: the sampler is a large part of each program's compile time, and dispatching it apart
  costs the device nothing (the logits are written out either way).
  """
  s = state.sampler
  params = jax.tree.map(lambda a: a[rows], s.params)
  out = sample(logits, SamplerState(params, s.tokens[rows], s.seen_prompt, s.out_counts), state.cache.lengths[rows],
               want_logprobs, rows=rows, mask=mask, constrained=constrained)
  tokens = s.tokens.at[rows].set(jnp.where(take, out.tokens, s.tokens[rows]), unique_indices=True)
  return DecodeState(state.cache, s.replace(tokens=tokens)), out


def verify_step(graphdef, params, state: DecodeState, active, proposals, counts, want_logprobs, mask, constrained, *,
                limit: int | None, platform: Platform):
  """Feeds each active row among the lowest R its next token and counts[r] <= k proposals.

  Position j's token is drawn exactly as a decode step would draw it there (the row's sampling
  parameters, its key folded with the position), so accepting proposal j when it equals that draw
  and stopping at the first that does not (whose draw is then the step's last token) emits what
  plain decoding would: for a proposal that is one fixed token this is the rejection rule of
  Leviathan et al., exact by construction, independent of k and of the proposals. Rows must have
  no penalties nor unmet min_tokens when counts[r] > 0 (draws after the first see the counts as
  they were), and room for counts[r] + 1 tokens. A constrained row's proposals are ones its
  grammar allows, and mask [R * T, V/32] holds its grammar's mask at each position after the
  proposals before it. Returns (state, SampleOut over [R * (k + 1)] positions, accepted [R]).
  """
  model = nnx.merge(graphdef, params)
  s, cache = state.sampler, state.cache
  r, k = proposals.shape
  t = k + 1
  lengths = cache.lengths[:r]
  fed = jnp.concatenate([s.tokens[:r, None], proposals], axis=1)  # [R, T]
  n = jnp.where(active, counts + 1, 0).astype(jnp.int32)
  if limit is not None:
    n = jnp.minimum(n, jnp.maximum(limit - lengths, 0))
  positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  hidden, layers = model(fed, positions, platform, cache.layers, BatchMeta(lengths, n))
  logits = model.logits(hidden, platform).reshape(r * t, -1)  # [R * T, V]
  took = n > 0
  # The fed token counts as output before the first draw, as in a decode step.
  out_counts = s.out_counts.at[jnp.arange(r), fed[:, 0]].add(took.astype(jnp.int32))
  flat = jax.tree.map(lambda a: jnp.repeat(a[:r], t, axis=0), s.params)
  rows = jnp.repeat(jnp.arange(r), t)
  out = sample(logits, SamplerState(flat, fed.reshape(-1), s.seen_prompt, out_counts), (positions + 1).reshape(-1),
               want_logprobs, rows=rows, mask=mask, constrained=jnp.repeat(constrained, t))
  drawn = out.tokens.reshape(r, t)
  match = (drawn[:, :k] == proposals) & (jnp.arange(k)[None, :] < jnp.minimum(counts, n - 1)[:, None])
  accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)  # [R]
  written = jnp.where(took, accepted + 1, 0)  # fed tokens that stand: the next token and the accepted proposals
  new_lengths = jax.lax.dynamic_update_slice(cache.lengths, lengths + written, (0,))
  last = jnp.take_along_axis(drawn, accepted[:, None], axis=1)[:, 0]
  stands = (jnp.arange(1, t)[None, :] < written[:, None]).astype(jnp.int32)  # accepted proposals
  out_counts = out_counts.at[jnp.broadcast_to(jnp.arange(r)[:, None], (r, k)), fed[:, 1:]].add(stands)
  next_tokens = jax.lax.dynamic_update_slice(s.tokens, jnp.where(took, last, s.tokens[:r]), (0,))
  sampler = SamplerState(s.params, next_tokens, s.seen_prompt, out_counts)
  return DecodeState(KVCache(layers, new_lengths), sampler), out, accepted


def fork(state: DecodeState, src, dst, row_params: RowParams, last_token) -> DecodeState:
  """Copies slot `src`'s cache and prompt state into `dst` for another sample of one prompt.

  The copy is set one token back (length - 1, next token = the last prompt token), so its first
  decode step recomputes the last prompt position and samples its own first token.
  """
  cache, s = state.cache, state.sampler
  layers = jax.tree.map(lambda a: a.at[dst].set(a[src]), cache.layers)
  lengths = cache.lengths.at[dst].set(cache.lengths[src] - 1)
  params = jax.tree.map(lambda a, r: a.at[dst].set(r[0]), s.params, row_params)
  sampler = SamplerState(params, s.tokens.at[dst].set(last_token), s.seen_prompt.at[dst].set(s.seen_prompt[src]),
                         s.out_counts.at[dst].set(0))
  return DecodeState(KVCache(layers, lengths), sampler)


def move(state: DecodeState, src, dst) -> DecodeState:
  """Slot `src`'s row of every state array copied into slot `dst` (src is then free)."""
  return jax.tree.map(lambda a: a.at[dst].set(a[src]), state)


def save_prefix(state: DecodeState, store, slot, first, ids):
  """Blocks of slot `slot` from position `first` into store blocks `ids` (`prefix.save`) -> store."""
  return prefix.save(state.cache, store, slot, first, ids)


def restore_prefix(state: DecodeState, store, slot, ids, length, tokens) -> DecodeState:
  """Slot `slot` set to hold a cached prefix of `length` tokens (`prefix.restore`); its prompt
  tokens so far (`tokens` [M]: the first `length` count) are marked seen for the penalties."""
  cache = prefix.restore(state.cache, store, slot, ids, length)
  v = state.sampler.seen_prompt.shape[1]
  t = jnp.where(jnp.arange(tokens.shape[0]) < length, tokens, v)
  seen = jnp.zeros((v,), jnp.bool_).at[t].set(True, mode="drop")
  s = state.sampler
  return DecodeState(cache, s.replace(seen_prompt=s.seen_prompt.at[slot].set(seen)))


def uncached_logits(graphdef, params, tokens, *, platform: Platform):
  """tokens [B, T] -> float32 logits [B, T, V], every position attending to those before it."""
  model = nnx.merge(graphdef, params)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  hidden, _ = model(tokens, positions, platform)
  return model.logits(hidden, platform)


class Programs:
  """The jitted programs for one model graph and platform, the state argument donated.

  `shardings` (optional): dict with 'params', 'state' (and with a prefix store, 'store') sharding
  trees; when given, every program
  declares them as in/out shardings so the compiled code keeps weights and cache where they are.
  The small host inputs and the sampled ids are declared replicated: every process of a
  multi-host run passes the same values and can read the whole result.
  """

  def __init__(self, graphdef, cfg: ModelConfig, spec: CacheSpec, platform: Platform,
               shardings: dict[str, Any] | None = None):
    self.graphdef, self.platform, self.shardings = graphdef, platform, shardings
    kw = self._shardings_kw
    self._prefill = {
        fresh: jax.jit(functools.partial(prefill, graphdef, fresh=fresh, platform=platform), donate_argnums=(1,),
                       **kw(4))
        for fresh in (True, False)
    }
    self.decode = jax.jit(functools.partial(decode_step, graphdef, limit=full_capacity(cfg, spec), platform=platform),
                          donate_argnums=(1,), **kw(1, outputs=2))
    self.sample = self._state_update(sample_rows, 6, outputs=1)
    self.verify = None
    if spec.slack:
      self.verify = jax.jit(functools.partial(verify_step, graphdef, limit=full_capacity(cfg, spec), platform=platform),
                            donate_argnums=(1,), **kw(6, outputs=2))
    self.fork = self._state_update(fork, 4)
    self.move = self._state_update(move, 2)
    logits_kw = {}
    if shardings is not None:
      logits_kw = dict(in_shardings=(shardings["params"], self._replicated()), out_shardings=self._replicated())
    self.logits = jax.jit(functools.partial(uncached_logits, graphdef, platform=platform), **logits_kw)
    if shardings is None:
      self.save = jax.jit(save_prefix, donate_argnums=(1,))
      self.restore = jax.jit(restore_prefix, donate_argnums=(0,))
    else:
      ss, st, rep = shardings["state"], shardings.get("store"), self._replicated()
      self.save = jax.jit(save_prefix, donate_argnums=(1,), in_shardings=(ss, st, rep, rep, rep), out_shardings=st)
      self.restore = jax.jit(restore_prefix, donate_argnums=(0,), in_shardings=(ss, st) + (rep,) * 4,
                             out_shardings=ss)

  def _replicated(self):
    mesh = jax.tree.leaves(self.shardings["state"])[0].mesh
    return rules.replicated(mesh)

  def _shardings_kw(self, num_host_args: int, outputs: int = 1) -> dict:
    """(params, state, *host args) -> (state, *outputs), the outputs replicated."""
    if self.shardings is None:
      return {}
    ps, ss, rep = self.shardings["params"], self.shardings["state"], self._replicated()
    return dict(in_shardings=(ps, ss) + (rep,) * num_host_args, out_shardings=(ss,) + (rep,) * outputs)

  def _state_update(self, fn, num_host_args: int, outputs: int = 0):
    """Jits `fn(state, *host_args) -> state` (or (state, *outputs)) with the state donated and,
    if sharded, kept in place."""
    if self.shardings is None:
      return jax.jit(fn, donate_argnums=(0,))
    ss, rep = self.shardings["state"], self._replicated()
    out = ss if outputs == 0 else (ss,) + (rep,) * outputs
    return jax.jit(fn, donate_argnums=(0,), in_shardings=(ss,) + (rep,) * num_host_args, out_shardings=out)

  def prefill(self, params, state, tokens, counts, slots, row_params, *, fresh: bool):
    return self._prefill[fresh](params, state, tokens, counts, slots, row_params)

  def prefill_program(self, fresh: bool):
    """The jitted prefill program (fresh or continued): `jaxgen plan` lowers it abstractly."""
    return self._prefill[fresh]

  def lower_prefill(self, params, state, tokens, counts, slots, row_params, *, fresh: bool):
    """The prefill program for these arguments traced and lowered (`jax.stages.Lowered`): its
    `compile()` compiles it or loads it from the persistent cache, and a call with these arguments
    then finds it built."""
    return self._prefill[fresh].lower(params, state, tokens, counts, slots, row_params)


_SHARED: collections.OrderedDict = collections.OrderedDict()
_SHARED_MAX = 8


def programs_for(graphdef, cfg: ModelConfig, spec: CacheSpec, platform: Platform,
                 shardings: dict[str, Any] | None = None) -> Programs:
  """`Programs(...)`, shared by every engine of the same graph, config, cache, platform and layout
  (the weights are arguments, not part of a program): an engine built again (a notebook's rerun
  cell, an RL loop's, a test's) finds its programs traced and compiled in memory, where a new set
  would trace and lower each again before the persistent cache could answer. The latest few are
  kept."""
  layout = None
  if shardings is not None:
    leaves, treedef = jax.tree.flatten(shardings)
    layout = (treedef, tuple(leaves))
  key = (graphdef, cfg, spec, platform, layout)
  if key not in _SHARED:
    _SHARED[key] = Programs(graphdef, cfg, spec, platform, shardings)
    while len(_SHARED) > _SHARED_MAX:
      _SHARED.popitem(last=False)
  _SHARED.move_to_end(key)
  return _SHARED[key]


def store_shardings(cfg: ModelConfig, spec: prefix.StoreSpec, mesh):
  """The prefix store's NamedShardings, from the rules table."""
  return rules.tree_shardings(spec.shapes(cfg), spec.axes(cfg), mesh, "store.")


def place_store(cfg: ModelConfig, spec: prefix.StoreSpec, shardings=None):
  """An empty prefix store (sharded as the cache's kv heads are, when shardings are given)."""
  return _made_by_one_program(functools.partial(prefix.allocate, cfg, spec), shardings)


def place_state(cfg: ModelConfig, spec: CacheSpec, shardings: DecodeState | None = None) -> DecodeState:
  """The initial state; with shardings, created by a program whose outputs carry them, so each
  device allocates only its own shard (also across hosts)."""
  return _made_by_one_program(functools.partial(init_state, cfg, spec), shardings)


def _made_by_one_program(make, shardings):
  """`make()` run as one program: eagerly, each zero-filled array would be a program of its own,
  each a compilation-cache lookup on every start."""
  return jax.jit(make, **({} if shardings is None else {"out_shardings": shardings}))()
