"""The plain-XLA formulation of attention: the reference every other implementation is tested
against, and what TPU and GPU run. Every block read whole; one masked softmax over the joined scores."""

from __future__ import annotations

import jax.numpy as jnp
from jaxgen.model.kernels.attention.block import capped, group, read_whole, ungroup, visibility
from jaxgen.model.layers import NEG_INF


def attention_xla(q, blocks, q_pos, window, softcap, platform=None):
  """Every block read whole; one masked softmax over the joined scores (float32)."""
  b, t, n, h = q.shape
  kh = blocks[0].k.shape[1]
  g = n // kh
  qg = group(q, kh)
  scores, values = [], []
  for blk in blocks:
    k, v = read_whole(blk, b, q.dtype)
    s = jnp.einsum("bkrh,bksh->bkrs", qg, k, preferred_element_type=jnp.float32)
    visible = visibility(q_pos, blk.pos, window, g)
    if blk.limit is not None:
      visible &= jnp.arange(k.shape[2]) < blk.limit
    scores.append(jnp.where(visible, capped(s, softcap), NEG_INF))
    values.append(v)
  s = jnp.concatenate(scores, axis=-1)  # [B, K, T*G, sum S_i]
  p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  v = jnp.concatenate(values, axis=2)  # [B, K, sum S_i, H]
  out = jnp.einsum("bkrs,bksh->bkrh", p.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)
  return ungroup(out, q)
