"""The compiled programs: `prefill` and `decode_step`, the only jitted functions, state donated.

State = KV cache + sampler state (per-row parameters, next tokens, penalty counts). Both live on
device for the whole run; the host passes only small arrays (prompt chunk, slot ids, active mask)
and reads back only the sampled ids (and logprobs when asked).

- `prefill(params, state, tokens [P, T], counts [P], slots [P], row_params, want_logprobs)`:
  writes P prompt chunks (padded to the bucket T) into their slots, sets the slots' sampling
  parameters and samples each row's next token. `fresh=True` (static) starts the slots empty and
  attends only within the chunk; `fresh=False` continues a slot (chunked prefill) and attends to
  what it already holds.
- `decode_step(params, state, active [B], want_logprobs)`: one token for every active row.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxgen.decode import cache as kvc
from jaxgen.decode.sampling import MAX_LOGIT_BIAS, MAX_STOP_IDS, RowParams, SamplerState, sample
from jaxgen.model.config import LOCAL, ModelConfig


@flax.struct.dataclass
class DecodeState:
  cache: kvc.KVCache
  sampler: SamplerState


def init_state(cfg: ModelConfig, spec: kvc.CacheSpec, shardings: DecodeState | None = None) -> DecodeState:
  """Allocates the cache and an idle sampler state for `spec.slots` rows.

  With `shardings` (a DecodeState of NamedShardings) the zeros are created by a program whose
  outputs carry those shardings: each device allocates only its own shard (also across hosts).
  """
  if shardings is not None:
    return jax.jit(functools.partial(init_state, cfg, spec), out_shardings=shardings)()
  b, v = spec.slots, cfg.vocab_size
  zeros_i = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
  zeros_f = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
  params = RowParams(
      temperature=zeros_f(b), top_k=zeros_i(b), top_p=jnp.ones((b,), jnp.float32), min_p=zeros_f(b),
      repetition_penalty=jnp.ones((b,), jnp.float32), presence_penalty=zeros_f(b),
      frequency_penalty=zeros_f(b), bias_ids=-jnp.ones((b, MAX_LOGIT_BIAS), jnp.int32),
      bias_values=zeros_f(b, MAX_LOGIT_BIAS), ban_ids=-jnp.ones((b, MAX_STOP_IDS), jnp.int32), min_tokens=zeros_i(b),
      prompt_len=zeros_i(b), key=jnp.zeros((b, 2), jnp.uint32))
  sampler = SamplerState(params, zeros_i(b), jnp.zeros((b, v), jnp.bool_), zeros_i(b, v))
  return DecodeState(kvc.allocate(cfg, spec), sampler)


class _CacheHook:
  """The kv_hook that says what each layer attends to and then stores its new keys/values.

  fresh=True: the rows start empty; attend only within the chunk (causal).
  fresh=False (a continued prompt chunk, or a decode step with T = 1): attend to what the rows
  held before plus the new tokens, as two blocks of keys. The cache is read where it lies (never
  concatenated), and a ring entry a chunk overwrites is still seen by the chunk's early queries.
  The write comes after the reads (see `store`), so the cache is updated in place.
  """

  def __init__(self, cfg: ModelConfig, rows: kvc.KVCache, start, counts, positions, fresh: bool):
    self.cfg, self.rows, self.start, self.counts, self.positions, self.fresh = cfg, rows, start, counts, positions, fresh
    self.layers: list[kvc.LayerCache] = []

  def __call__(self, i, k, v):
    layer = self.rows.layers[i]
    ring = self.cfg.layer_kinds[i] == LOCAL
    mine = (k.swapaxes(1, 2), v.swapaxes(1, 2), self.positions)  # [B, K, T, H]
    # Only the filled part of the cache is read: no entry at or past the longest length of a row
    # that takes tokens now (or the ring's size) is visible. Rows that take none (finished or
    # idle slots keep their old lengths) have their output discarded and do not count.
    limit = jnp.minimum(jnp.max(jnp.where(self.counts > 0, self.start, 0)), kvc.capacity(layer))
    blocks = [mine] if self.fresh else [(layer.k, layer.v, kvc.layer_positions(layer, self.start, ring), limit), mine]

    def store(after):
      # An exact zero per row computed from the attention output: it orders the in-place write
      # after every read of the old entries. Without this data dependence XLA cannot prove the
      # order and copies the whole layer (XLA:CPU: 2-4 copies of every cache array per step).
      # Per row, so a row whose output is not finite spoils no other row's cache.
      zero = (0 * jnp.sum(after, axis=(1, 2, 3))).astype(k.dtype)[:, None, None, None]
      self.layers.append(kvc.write(layer, k + zero, v + zero, self.start, self.counts))

    return blocks, store


def _take_rows(tree, idx):
  return jax.tree.map(lambda a: a[idx], tree)


def _put_rows(tree, idx, rows):
  return jax.tree.map(lambda a, r: a.at[idx].set(r), tree, rows)


def prefill_logits(model, cache: kvc.KVCache, tokens, counts, slots, *, fresh: bool, compute_dtype=jnp.float32):
  """Writes P prompt chunks into cache rows `slots`; returns (logits of each last real token [P, V], cache)."""
  p, t = tokens.shape
  rows = kvc.KVCache(_take_rows(cache.layers, slots), cache.lengths[slots])
  start = jnp.zeros((p,), jnp.int32) if fresh else rows.lengths
  positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  hook = _CacheHook(model.cfg, rows, start, counts, positions, fresh)
  hidden = model(tokens, positions, hook, compute_dtype=compute_dtype)
  cache = kvc.KVCache(_put_rows(cache.layers, slots, tuple(hook.layers)), cache.lengths.at[slots].set(start + counts))
  last = jnp.take_along_axis(hidden, (counts - 1)[:, None, None], axis=1)[:, 0]  # [P, D]
  return model.logits(last), cache


def decode_logits(model, cache: kvc.KVCache, tokens, active, *, compute_dtype=jnp.float32):
  """Feeds tokens [B] to the active rows; returns (logits [B, V], cache, count [B] of tokens written)."""
  # Only full-context layers can run out of room; rings never do (a model whose every layer has a
  # sliding window, e.g. Mistral, is bounded by the engine's max_len alone).
  full = [kvc.capacity(layer) for layer, kind in zip(cache.layers, model.cfg.layer_kinds) if kind != LOCAL]
  lengths = cache.lengths
  count = (active & (lengths < min(full))) if full else active
  count = count.astype(jnp.int32)
  hook = _CacheHook(model.cfg, cache, lengths, count, lengths[:, None], fresh=False)
  hidden = model(tokens[:, None], lengths[:, None], hook, compute_dtype=compute_dtype)
  return model.logits(hidden[:, 0]), kvc.KVCache(tuple(hook.layers), lengths + count), count


def prefill(graphdef, params, state: DecodeState, tokens, counts, slots, row_params: RowParams,
            want_logprobs, *, fresh: bool, compute_dtype=jnp.float32):
  model = nnx.merge(graphdef, params)
  v = model.cfg.vocab_size
  p, t = tokens.shape
  logits, cache = prefill_logits(model, state.cache, tokens, counts, slots, fresh=fresh, compute_dtype=compute_dtype)
  s = state.sampler
  valid = jnp.arange(t)[None, :] < counts[:, None]
  seen = jnp.zeros((p, v), jnp.bool_) if fresh else s.seen_prompt[slots]
  seen = seen.at[jnp.arange(p)[:, None], jnp.where(valid, tokens, v)].set(True, mode="drop")
  out_counts = jnp.zeros((p, v), jnp.int32)
  out = sample(logits, SamplerState(row_params, s.tokens[slots], seen, out_counts), cache.lengths[slots], want_logprobs)
  sampler = SamplerState(
      params=_put_rows(s.params, slots, row_params),
      tokens=s.tokens.at[slots].set(out.tokens),
      seen_prompt=s.seen_prompt.at[slots].set(seen),
      out_counts=s.out_counts.at[slots].set(out_counts))
  return DecodeState(cache, sampler), out


def decode_step(graphdef, params, state: DecodeState, active, want_logprobs, *, compute_dtype=jnp.float32):
  model = nnx.merge(graphdef, params)
  s = state.sampler
  b = s.tokens.shape[0]
  lengths = state.cache.lengths
  logits, cache, count = decode_logits(model, state.cache, s.tokens, active, compute_dtype=compute_dtype)
  out_counts = s.out_counts.at[jnp.arange(b), s.tokens].add(count)
  out = sample(logits, SamplerState(s.params, s.tokens, s.seen_prompt, out_counts), lengths + 1, want_logprobs)
  next_tokens = jnp.where(count > 0, out.tokens, s.tokens)
  return DecodeState(cache, SamplerState(s.params, next_tokens, s.seen_prompt, out_counts)), out


class Programs:
  """The jitted prefill/decode for one model graph, with the state argument donated.

  `shardings` (optional): dict with 'params' and 'state' sharding trees; when given, every program
  declares them as in/out shardings so the compiled code keeps weights and cache where they are.
  The small host inputs and the sampled ids are declared replicated: every process of a
  multi-host run passes the same values and can read the whole result.
  """

  def __init__(self, graphdef, compute_dtype=jnp.float32, shardings: dict[str, Any] | None = None):
    self.graphdef = graphdef
    self.shardings = shardings
    kw_prefill, kw_decode = {}, {}
    if shardings is not None:
      ps, ss, rep = shardings["params"], shardings["state"], self._replicated()
      kw_prefill = dict(in_shardings=(ps, ss) + (rep,) * 5, out_shardings=(ss, rep))
      kw_decode = dict(in_shardings=(ps, ss, rep, rep), out_shardings=(ss, rep))
    self._prefill = {
        fresh: jax.jit(functools.partial(prefill, graphdef, fresh=fresh, compute_dtype=compute_dtype),
                       donate_argnums=(1,), **kw_prefill)
        for fresh in (True, False)
    }
    self.decode = jax.jit(functools.partial(decode_step, graphdef, compute_dtype=compute_dtype),
                          donate_argnums=(1,), **kw_decode)

  def _replicated(self):
    mesh = jax.tree.leaves(self.shardings["state"])[0].mesh
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def state_update(self, fn, num_host_args: int):
    """Jits `fn(state, *host_args) -> state` with the state donated and, if sharded, kept in place."""
    if self.shardings is None:
      return jax.jit(fn, donate_argnums=(0,))
    ss, rep = self.shardings["state"], self._replicated()
    return jax.jit(fn, donate_argnums=(0,), in_shardings=(ss,) + (rep,) * num_host_args, out_shardings=ss)

  def prefill(self, params, state, tokens, counts, slots, row_params, want_logprobs, *, fresh: bool):
    return self._prefill[fresh](params, state, tokens, counts, slots, row_params, want_logprobs)
