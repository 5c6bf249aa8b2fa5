"""On-device sampling with per-row parameters as data: one compiled program serves any mix.

Order of operations (vLLM's): raw logits -> a grammar's token mask (`decode.structured`) ->
logit_bias, min_tokens (stop ids banned) ->
repetition / presence / frequency penalties -> greedy rows take argmax here ->
temperature -> min_p -> top_k -> top_p -> one draw by inverse CDF.

Nothing sorts or scans the whole vocabulary (XLA:CPU's argmax, sort and cumsum over 262k entries
cost 10-100x a max): argmax, top-k and the inverse-CDF draw work in two levels over blocks of
512. top_k / top_p / min_p are decided exactly on the top-64 candidates whenever the kept set lies
inside them (the common case), otherwise by an exact bisection for a probability threshold over
the full vocabulary. Logprobs are those of the raw model distribution.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxgen.model.layers import NEG_INF

MAX_LOGPROBS = 20  # top-N log-probabilities a request may ask for (vLLM's default limit)
MAX_LOGIT_BIAS = 128  # entries of logit_bias per request
MAX_STOP_IDS = 16  # stop token ids (incl. EOS) banned while min_tokens is not reached
CANDIDATES = 64  # top entries examined for top_k / top_p / min_p before falling back to all of V
BLOCK = 512  # vocabulary block of the two-level argmax / top-k / inverse-CDF


@flax.struct.dataclass
class RowParams:
  """Sampling parameters of each row: every field is [B] (or [B, X])."""

  temperature: jax.Array  # f32; 0 means greedy
  top_k: jax.Array  # i32; 0 means off
  top_p: jax.Array  # f32; 1 means off
  min_p: jax.Array  # f32; 0 means off
  repetition_penalty: jax.Array  # f32; 1 means off
  presence_penalty: jax.Array  # f32
  frequency_penalty: jax.Array  # f32
  bias_ids: jax.Array  # i32 [B, MAX_LOGIT_BIAS], -1 pads
  bias_values: jax.Array  # f32 [B, MAX_LOGIT_BIAS]
  ban_ids: jax.Array  # i32 [B, MAX_STOP_IDS], -1 pads: banned while generated < min_tokens
  min_tokens: jax.Array  # i32
  prompt_len: jax.Array  # i32
  key: jax.Array  # u32 [B, 2]: threefry key data from the request's seed


@flax.struct.dataclass
class SamplerState:
  """Per-row state the decode step keeps on device beside the KV cache."""

  params: RowParams
  tokens: jax.Array  # i32 [B]: the next token to feed each row
  seen_prompt: jax.Array  # bool [B, V]: token occurs in the prompt (repetition penalty)
  out_counts: jax.Array  # i32 [B, V]: occurrences in the output so far


def idle_rows(b: int, v: int) -> SamplerState:
  """Sampler state of `b` rows that hold no request (greedy, no penalties) over a vocabulary of v.

  Every leaf is its own buffer (the state is donated, and one buffer may not be donated twice).
  """
  i32 = lambda fill=0, *shape: jnp.full((b, *shape), fill, jnp.int32)  # noqa: E731
  f32 = lambda fill=0.0, *shape: jnp.full((b, *shape), fill, jnp.float32)  # noqa: E731
  params = RowParams(
      temperature=f32(), top_k=i32(), top_p=f32(1.0), min_p=f32(), repetition_penalty=f32(1.0),
      presence_penalty=f32(), frequency_penalty=f32(), bias_ids=i32(-1, MAX_LOGIT_BIAS),
      bias_values=f32(0.0, MAX_LOGIT_BIAS), ban_ids=i32(-1, MAX_STOP_IDS), min_tokens=i32(), prompt_len=i32(),
      key=jnp.zeros((b, 2), jnp.uint32))
  return SamplerState(params, i32(), jnp.zeros((b, v), jnp.bool_), i32(0, v))


@flax.struct.dataclass
class SampleOut:
  tokens: jax.Array  # i32 [B]
  logprob: jax.Array  # f32 [B]: raw log-probability of the chosen token (0 unless asked for)
  top_ids: jax.Array  # i32 [B, MAX_LOGPROBS]
  top_logprobs: jax.Array  # f32 [B, MAX_LOGPROBS]


def penalize(logits: jax.Array, p: RowParams, seen_prompt: jax.Array, out_counts: jax.Array) -> jax.Array:
  """Repetition (prompt + output), presence and frequency (output) penalties. logits [B, V]."""
  seen = seen_prompt | (out_counts > 0)
  rep = p.repetition_penalty[:, None]
  logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
  counts = out_counts.astype(jnp.float32)
  logits = logits - p.frequency_penalty[:, None] * counts
  return logits - p.presence_penalty[:, None] * (counts > 0)


def _bias_and_bans(logits, p: RowParams, generated: jax.Array):
  b = logits.shape[0]
  rows = jnp.arange(b)[:, None]
  v = logits.shape[1]
  bias_idx = jnp.where(p.bias_ids >= 0, p.bias_ids, v)
  logits = logits.at[rows, bias_idx].add(p.bias_values, mode="drop")
  banned = (generated < p.min_tokens)[:, None] & (p.ban_ids >= 0)
  ban_idx = jnp.where(banned, p.ban_ids, v)
  return logits.at[rows, ban_idx].set(NEG_INF, mode="drop")


def _blocks(x: jax.Array, fill: float) -> jax.Array:
  """[B, V] -> [B, V/BLOCK, BLOCK], padding V with `fill` to a multiple of BLOCK."""
  b, v = x.shape
  pad = (-v) % BLOCK
  if pad:
    x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
  return x.reshape(b, -1, BLOCK)


def argmax(x: jax.Array) -> jax.Array:
  """Row argmax in two levels (block maxima, then within the best block). [B, V] -> i32 [B].

  XLA:CPU's variadic argmax over 262k entries is ~10x slower than a max; this costs one max pass.
  """
  xb = _blocks(x, -jnp.inf)
  blk = jnp.argmax(jnp.max(xb, axis=-1), axis=-1)
  row = jnp.take_along_axis(xb, blk[:, None, None], axis=1)[:, 0]
  return (blk * BLOCK + jnp.argmax(row, axis=-1)).astype(jnp.int32)


def top_candidates(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Exact top-k (values descending, ids) per row, via the k blocks with the largest maxima.

  Any of the top k entries lies in one of those blocks (at most k-1 blocks can have a larger
  maximum), so a top-k over k * BLOCK gathered entries suffices.
  """
  xb = _blocks(x, -jnp.inf)
  nb = xb.shape[1]
  kb = min(k, nb)
  _, blks = jax.lax.top_k(jnp.max(xb, axis=-1), kb)  # [B, kb]
  cand = jnp.take_along_axis(xb, blks[:, :, None], axis=1).reshape(x.shape[0], -1)  # [B, kb*BLOCK]
  ids = (blks[:, :, None] * BLOCK + jnp.arange(BLOCK)[None, None, :]).reshape(x.shape[0], -1)
  vals, pos = jax.lax.top_k(cand, min(k, x.shape[1]))
  return vals, jnp.take_along_axis(ids, pos, axis=1).astype(jnp.int32)


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
  """Index drawn with probability proportional to weights [B, V] (>= 0), u ~ U[0, 1) [B].

  Two-level search (block sums, then within one block): exact, and no cumsum over all of V.
  """
  wb = _blocks(weights, 0.0)
  csum = jnp.cumsum(jnp.sum(wb, axis=-1), axis=-1)  # [B, nb]
  target = u * csum[:, -1]
  blk = jnp.minimum(jnp.sum(csum <= target[:, None], axis=-1), wb.shape[1] - 1)
  before = jnp.where(blk > 0, jnp.take_along_axis(csum, jnp.maximum(blk - 1, 0)[:, None], axis=1)[:, 0], 0.0)
  row = jnp.take_along_axis(wb, blk[:, None, None], axis=1)[:, 0]
  idx = jnp.minimum(jnp.sum(jnp.cumsum(row, axis=-1) <= (target - before)[:, None], axis=-1), BLOCK - 1)
  return (blk * BLOCK + idx).astype(jnp.int32)


def _threshold(probs: jax.Array, enough) -> jax.Array:
  """Largest tau with enough(probs >= tau) per row; exact bisection on float32 bit patterns.

  `enough(mask) -> bool [B]` must hold at tau = 0 and be monotone. Used only when the
  candidate set cannot decide (top_k beyond the candidates, or a top_p mass beyond them).
  """
  bits = lambda f: jax.lax.bitcast_convert_type(f, jnp.int32)  # noqa: E731  (positive floats order like ints)
  lo = jnp.zeros(probs.shape[:1], jnp.int32)
  hi = bits(jnp.max(probs, axis=-1)) + 1

  def body(_, carry):
    lo, hi = carry
    mid = lo + (hi - lo) // 2
    ok = enough(probs >= jax.lax.bitcast_convert_type(mid, jnp.float32)[:, None])
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
  return jax.lax.bitcast_convert_type(lo, jnp.float32)


def _draw(scaled: jax.Array, p: RowParams, u: jax.Array) -> jax.Array:
  """One draw per row from softmax(scaled) after min_p, top_k and top_p. scaled [B, V] f32."""
  b, v = scaled.shape
  kc = min(CANDIDATES, v)
  lse = jax.nn.logsumexp(scaled, axis=-1)
  cand_logit, cand_ids = top_candidates(scaled, kc)
  cp = jnp.exp(cand_logit - lse[:, None])  # true probabilities of the candidates, descending
  floor = p.min_p * cp[:, 0]  # min_p threshold
  rank = jnp.arange(kc)[None, :]
  small_k = (p.top_k >= 1) & (p.top_k <= kc)
  keep = (cp >= floor[:, None]) & (~small_k[:, None] | (rank < p.top_k[:, None]))
  kept = jnp.where(keep, cp, 0.0)
  # Mass the top_p fraction refers to: what survives min_p and top_k, over the whole vocabulary.
  probs_full = jnp.exp(scaled - lse[:, None])
  total = jnp.where(small_k, jnp.sum(kept, axis=-1),
                    jnp.sum(jnp.where(probs_full >= floor[:, None], probs_full, 0.0), axis=-1))
  before = jnp.cumsum(kept, axis=-1) - kept
  keep &= before < (p.top_p * total)[:, None]
  kept = jnp.where(keep, kept, 0.0)
  # The kept set lies inside the candidates when top_k is small, when min_p already excludes every
  # non-candidate, or when the top_p mass is reached among them (top_k above the candidates
  # would change that mass, so those rows take the full path).
  big_k = p.top_k > kc
  covered = small_k | (cp[:, -1] < floor) | (
      ~big_k & (p.top_p < 1.0) & (jnp.sum(kept, axis=-1) >= p.top_p * total))
  from_cand = jnp.take_along_axis(cand_ids, inverse_cdf(kept, u)[:, None], axis=1)[:, 0]

  def full(_):
    probs = jnp.where(probs_full >= floor[:, None], probs_full, 0.0)
    k_limit = jnp.where(big_k, p.top_k, v)
    tau_k = jax.lax.cond(jnp.any(big_k), lambda: _threshold(probs, lambda m: jnp.sum(m, axis=-1) >= k_limit),
                         lambda: jnp.zeros((b,), jnp.float32))
    probs = jnp.where(probs >= tau_k[:, None], probs, 0.0)
    target = p.top_p * jnp.sum(probs, axis=-1)
    tau_p = jax.lax.cond(jnp.any(~covered & (p.top_p < 1.0)),
                         lambda: _threshold(probs, lambda m: jnp.sum(jnp.where(m, probs, 0.0), axis=-1) >= target),
                         lambda: jnp.zeros((b,), jnp.float32))
    return inverse_cdf(jnp.where(probs >= tau_p[:, None], probs, 0.0), u)

  from_full = jax.lax.cond(jnp.any(~covered), full, lambda _: jnp.zeros((b,), jnp.int32), None)
  return jnp.where(covered, from_cand, from_full)


def unpack_mask(mask: jax.Array, v: int) -> jax.Array:
  """Packed token masks int32 [B, ceil(V/32)] (bit j of word w: token 32 w + j) -> bool [B, V]."""
  bits = jnp.right_shift(mask[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1
  return bits.reshape(mask.shape[0], -1)[:, :v] != 0


def constrain(logits: jax.Array, mask: jax.Array, constrained: jax.Array) -> jax.Array:
  """logits [B, V] with the tokens a constrained row's mask [B, V/32] disallows at NEG_INF. A batch
  without a constrained row skips the unpacking (one program either way)."""
  def apply(x):
    return jnp.where(constrained[:, None] & ~unpack_mask(mask, x.shape[1]), NEG_INF, x)

  return jax.lax.cond(jnp.any(constrained), apply, lambda x: x, logits)


def sample(logits: jax.Array, state: SamplerState, positions: jax.Array, want_logprobs: jax.Array,
           rows: jax.Array | None = None, mask: jax.Array | None = None,
           constrained: jax.Array | None = None) -> SampleOut:
  """Draws one token per row. logits [B, V] float32; positions [B]: position of the new token.

  state: the rows' parameters and tokens [B]; its seen_prompt and out_counts may hold more rows
  (a decode step over the lowest B slots passes the whole arrays): the first B are used, and only
  when a row asks for a penalty, so no [B, V] slice is copied otherwise.
  want_logprobs: bool scalar, whether any row asked for logprobs (skips the top-N otherwise).
  rows: [B] the row of seen_prompt / out_counts each sampled row reads (a verify step samples
  several positions of one row); default the first B.
  mask, constrained: packed allowed tokens int32 [B, ceil(V/32)] of the rows with constrained [B]
  (a grammar's next tokens); other rows' masks are not read.
  """
  p = state.params
  b = logits.shape[0]
  generated = positions - p.prompt_len
  x = logits if mask is None else constrain(logits, mask, constrained)
  x = _bias_and_bans(x, p, generated)
  needs_pen = jnp.any((p.repetition_penalty != 1.0) | (p.presence_penalty != 0.0) | (p.frequency_penalty != 0.0))
  def pen(x):
    if rows is None:
      return penalize(x, p, state.seen_prompt[:b], state.out_counts[:b])
    return penalize(x, p, state.seen_prompt[rows], state.out_counts[rows])

  x = jax.lax.cond(needs_pen, pen, lambda x: x, x)
  greedy_tok = argmax(x)

  keys = jax.vmap(lambda kd, pos: jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), pos))(
      p.key, positions)
  u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
  temp = jnp.where(p.temperature > 0, p.temperature, 1.0)
  sampling = p.temperature > 0
  drawn = jax.lax.cond(jnp.any(sampling), lambda: _draw(x / temp[:, None], p, u), lambda: greedy_tok)
  tokens = jnp.where(sampling, drawn, greedy_tok)

  # Log-probabilities only when a row asked for them: the logsumexp over V is a full pass over
  # the logits, a cost every step would otherwise pay.
  def top():
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    vals, ids = top_candidates(logits, MAX_LOGPROBS)
    return chosen, ids, vals - lse[:, None]

  def no_top():  # as wide as top()'s (a vocabulary smaller than MAX_LOGPROBS has fewer)
    width = min(MAX_LOGPROBS, logits.shape[-1])
    return jnp.zeros((b,), jnp.float32), jnp.zeros((b, width), jnp.int32), jnp.zeros((b, width), jnp.float32)

  chosen, top_ids, top_lp = jax.lax.cond(want_logprobs, top, no_top)
  return SampleOut(tokens, chosen, top_ids, top_lp)
