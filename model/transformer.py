"""The decoder-only transformer in Flax NNX: one implementation, family differences in `ModelConfig`.

Each parameter is declared once, with its shape and logical axis names (`axes=`); initialisation,
sharding (`jaxgen.sharding`) and checkpoint restore targets are all derived from these
declarations (`nnx.eval_shape(lambda: Transformer(cfg, ...))` gives the abstract tree).

Projection weights are stored [out, in] (as in PyTorch and GGUF). The model knows nothing about
requests or cache slots: each layer hands its new keys/values to a caller-supplied hook, which
stores them wherever it likes and returns what the layer should attend to.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgen.model import layers as L
from jaxgen.model.config import LOCAL, ModelConfig


def _param(rngs: nnx.Rngs, shape, axes, dtype, std: float = 0.02) -> nnx.Param:
  """A randomly initialised parameter (normal with `std`) carrying its logical axis names."""
  value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, axes=axes)


class Block(nnx.Module):
  """One decoder layer: (sandwich-normed) attention then gated MLP, both residual."""

  def __init__(self, cfg: ModelConfig, index: int, *, dtype, rngs: nnx.Rngs):
    d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    self.cfg, self.kind = cfg, cfg.layer_kinds[index]
    self.attn_norm = self._norm(cfg, (d,), ("embed",), dtype, rngs)
    # Fused where the fusion keeps shardability: k and v side by side per kv head, gate and up
    # side by side per MLP unit. Fewer, larger matmuls are markedly faster on XLA:CPU at batch 1.
    self.q = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), dtype)
    self.kv = _param(rngs, (k, 2, h, d), ("kv_heads", None, "head_dim", "embed"), dtype)
    # o is [D, N*H] (heads and head_dim flattened, head-major), not [D, N, H]: XLA:CPU's fused
    # matvec runs 5x slower when the contracted dimension is a merge of two stored ones. Split
    # over `heads` it still splits whole heads (the rules check N on q).
    self.o = _param(rngs, (d, n * h), ("embed", "heads"), dtype)
    if cfg.qkv_bias:
      self.q_bias = _param(rngs, (n, h), ("heads", "head_dim"), dtype, std=0.0)
      self.kv_bias = _param(rngs, (k, 2, h), ("kv_heads", None, "head_dim"), dtype, std=0.0)
    if cfg.qk_norm:
      self.q_norm = self._norm(cfg, (h,), ("head_dim",), dtype, rngs)
      self.k_norm = self._norm(cfg, (h,), ("head_dim",), dtype, rngs)
    if cfg.sandwich_norm:
      self.post_attn_norm = self._norm(cfg, (d,), ("embed",), dtype, rngs)
      self.post_mlp_norm = self._norm(cfg, (d,), ("embed",), dtype, rngs)
    self.mlp_norm = self._norm(cfg, (d,), ("embed",), dtype, rngs)
    self.gate_up = _param(rngs, (f, 2, d), ("mlp", None, "embed"), dtype)
    self.down = _param(rngs, (d, f), ("embed", "mlp"), dtype)

  @staticmethod
  def _norm(cfg: ModelConfig, shape, axes, dtype, rngs) -> nnx.Param:
    # Under the (offset + w) convention a fresh norm is the identity when offset + w == 1.
    return nnx.Param(jnp.full(shape, 1.0 - cfg.norm_offset, dtype), axes=axes)

  def _norm_apply(self, x, w):
    return L.rms_norm(x, w[...], self.cfg.norm_eps, self.cfg.norm_offset)

  def qkv(self, x: jax.Array, positions: jax.Array):
    """x: [B, T, D] -> q [B, T, N, H] (scaled, rotated), k, v [B, T, K, H]."""
    cfg = self.cfg
    b, t, _ = x.shape
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = L.linear(x, self.q[...].reshape(n * h, -1)).reshape(b, t, n, h)
    kv = L.linear(x, self.kv[...].reshape(k * 2 * h, -1)).reshape(b, t, k, 2, h)
    if cfg.qkv_bias:
      q = q + self.q_bias[...].astype(x.dtype)
      kv = kv + self.kv_bias[...].astype(x.dtype)
    k, v = kv[:, :, :, 0], kv[:, :, :, 1]
    if cfg.qk_norm:
      q, k = self._norm_apply(q, self.q_norm), self._norm_apply(k, self.k_norm)
    local = self.kind == LOCAL
    base = cfg.rope_base_local if local else cfg.rope_base
    scale = 1.0 if local else cfg.rope_scale
    llama3 = None if local else cfg.rope_llama3
    q = L.rope(q, positions, base, scale, llama3) * jnp.asarray(cfg.q_scale, x.dtype)
    k = L.rope(k, positions, base, scale, llama3)
    return q, k, v

  def __call__(self, x: jax.Array, positions: jax.Array, kv_hook=None):
    """x: [B, T, D]; positions: [B, T]. Returns x [B, T, D].

    kv_hook(k, v) -> (blocks, store) decides what this layer attends to and keeps the new keys/
    values: blocks = [(keys [B,K,S,H], values, key positions [B,S]), ...] (e.g. a cache and these
    tokens); store(after) is called with the attention output once the blocks have been read, so
    a cache can be updated in place after its last read. None: only these T tokens.
    """
    cfg = self.cfg
    window = cfg.sliding_window if self.kind == LOCAL else None
    h = self._norm_apply(x, self.attn_norm)
    q, k, v = self.qkv(h, positions)
    mine = [(k.swapaxes(1, 2), v.swapaxes(1, 2), positions)]
    blocks, store = (mine, None) if kv_hook is None else kv_hook(k, v)
    a = L.attend(q, blocks, L.CausalMask(positions, window), cfg.attn_softcap)  # [B, T, N, H]
    if store is not None:
      store(a)
    a = L.linear(a.reshape(*a.shape[:2], -1), self.o[...])
    if cfg.sandwich_norm:
      a = self._norm_apply(a, self.post_attn_norm)
    x = x + a
    h = self._norm_apply(x, self.mlp_norm)
    gu = L.linear(h, self.gate_up[...].reshape(2 * cfg.mlp_dim, -1)).reshape(*h.shape[:2], cfg.mlp_dim, 2)
    m = L.ACTIVATIONS[cfg.activation](gu[..., 0]) * gu[..., 1]
    m = L.linear(m, self.down[...])
    if cfg.sandwich_norm:
      m = self._norm_apply(m, self.post_mlp_norm)
    return x + m


class Transformer(nnx.Module):
  """Token ids -> hidden states -> logits. Layers are unrolled (no scan over stacked weights)."""

  def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    rngs = rngs or nnx.Rngs(0)
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"), dtype)
    self.layers = nnx.List([Block(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
    self.final_norm = Block._norm(cfg, (cfg.embed_dim,), ("embed",), dtype, rngs)
    if not cfg.tie_embeddings:
      self.unembed = _param(rngs, (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"), dtype)

  def embed_tokens(self, tokens: jax.Array, compute_dtype) -> jax.Array:
    x = jnp.take(self.embed[...], tokens, axis=0).astype(compute_dtype)  # [B, T, D]
    if self.cfg.embed_scale:
      x = x * jnp.asarray(math.sqrt(self.cfg.embed_dim), compute_dtype)
    return x

  def __call__(self, tokens: jax.Array, positions: jax.Array, kv_hook=None, compute_dtype=jnp.float32):
    """tokens, positions: [B, T] -> hidden [B, T, D] after the final norm.

    kv_hook(layer_index, k, v) -> (blocks, store): how layer i sees past tokens and keeps its
    own (see `Block.__call__`); the caller owns any cache. None: plain causal self-attention.
    """
    x = self.embed_tokens(tokens, compute_dtype)
    for i, block in enumerate(self.layers):
      hook = None if kv_hook is None else functools.partial(kv_hook, i)
      x = block(x, positions, hook)
    return L.rms_norm(x, self.final_norm[...], self.cfg.norm_eps, self.cfg.norm_offset)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] (tied or separate unembedding, optional soft-cap)."""
    w = self.embed[...] if self.cfg.tie_embeddings else self.unembed[...]
    out = L.linear(hidden, w).astype(jnp.float32)
    if self.cfg.final_softcap is not None:
      out = jnp.tanh(out / self.cfg.final_softcap) * self.cfg.final_softcap
    return out
