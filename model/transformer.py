"""The decoder-only transformer in Flax NNX: one implementation, family differences in `ModelConfig`.

Each parameter is declared once, with its shape and logical axis names (`axes=`); initialisation,
sharding (`jaxgen.sharding`) and checkpoint restore targets are all derived from these
declarations (`params.abstract_model` gives the abstract tree).

Projection weights are stored [out, in] (as in PyTorch and GGUF). Functions return what they
change: a block takes its layer cache and returns `(x, new layer cache)`, the model
`(hidden, new caches)`. The `Platform` says which implementation serves each kernel op. The model
knows nothing of requests, slots or meshes: which cache rows a call covers is a `BatchMeta`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxgen.model import kv, quant
from jaxgen.model import layers as L
from jaxgen.model.kernels.attention import KVBlock, attention
from jaxgen.model.batch import BatchMeta
from jaxgen.model.config import LOCAL, ModelConfig
from jaxgen.model.kernels.matmul import project
from jaxgen.model.platform import REFERENCE, Platform


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, std: float = 0.02) -> nnx.Param:
  """A randomly initialised parameter (normal with `std`) carrying its logical axis names; zeros
  without `rngs`."""
  if rngs is None:
    return nnx.Param(jnp.zeros(shape, dtype), axes=axes)
  value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, axes=axes)


def _weight(module: nnx.Module, name: str, cfg: ModelConfig, rngs: nnx.Rngs | None, shape, axes, dtype) -> None:
  """Declares projection or embedding weight `name` [..., in]: in `dtype`, or under int8
  quantization as int8 values plus a float32 `{name}_scale` [..., in / G] (see `model.quant`)."""
  param = _param(rngs, shape, axes, dtype)
  if cfg.weight_quant == "int8":
    values, scale = quant.quantize(param[...])
    setattr(module, name + quant.SCALE_SUFFIX, nnx.Param(scale, axes=quant.scale_axes(axes)))
    param = nnx.Param(values, axes=axes)
  setattr(module, name, param)


def _weight_of(module: nnx.Module, name: str) -> tuple[jax.Array, jax.Array | None]:
  """(weight, its block scales or None)."""
  scale = getattr(module, name + quant.SCALE_SUFFIX, None)
  return getattr(module, name)[...], None if scale is None else scale[...]


def _norm(cfg: ModelConfig, shape, axes, dtype) -> nnx.Param:
  # Under the (offset + w) convention a fresh norm is the identity when offset + w == 1.
  return nnx.Param(jnp.full(shape, 1.0 - cfg.norm_offset, dtype), axes=axes)


class Block(nnx.Module):
  """One decoder layer: (sandwich-normed) attention then gated MLP, both residual."""

  def __init__(self, cfg: ModelConfig, index: int, *, dtype, rngs: nnx.Rngs | None):
    d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    self.cfg, self.kind = cfg, cfg.layer_kinds[index]
    self.attn_norm = _norm(cfg, (d,), ("embed",), dtype)
    # Fused where the fusion keeps shardability: k and v side by side per kv head, gate and up
    # side by side per MLP unit (fewer, larger matmuls).
    _weight(self, "q", cfg, rngs, (n, h, d), ("heads", "head_dim", "embed"), dtype)
    _weight(self, "kv", cfg, rngs, (k, 2, h, d), ("kv_heads", None, "head_dim", "embed"), dtype)
    # o is [D, N*H] (heads and head_dim flattened, head-major): the contracted dimension is one
    # stored dimension (XLA:CPU's fused matvec runs 5x slower when it is a merge of two). Split
    # over `heads` it still splits whole heads (the rules check N on q).
    _weight(self, "o", cfg, rngs, (d, n * h), ("embed", "heads"), dtype)
    if cfg.qkv_bias:
      self.q_bias = _param(rngs, (n, h), ("heads", "head_dim"), dtype, std=0.0)
      self.kv_bias = _param(rngs, (k, 2, h), ("kv_heads", None, "head_dim"), dtype, std=0.0)
    if cfg.qk_norm:
      self.q_norm = _norm(cfg, (h,), ("head_dim",), dtype)
      self.k_norm = _norm(cfg, (h,), ("head_dim",), dtype)
    if cfg.sandwich_norm:
      self.post_attn_norm = _norm(cfg, (d,), ("embed",), dtype)
      self.post_mlp_norm = _norm(cfg, (d,), ("embed",), dtype)
    self.mlp_norm = _norm(cfg, (d,), ("embed",), dtype)
    _weight(self, "gate_up", cfg, rngs, (f, 2, d), ("mlp", None, "embed"), dtype)
    _weight(self, "down", cfg, rngs, (d, f), ("embed", "mlp"), dtype)

  def _norm(self, x, w):
    return L.rms_norm(x, w[...], self.cfg.norm_eps, self.cfg.norm_offset)

  def _project(self, x, name: str, platform: Platform, out: int):
    """x [..., in] through weight `name` viewed as [out, in] (its scale as [out, in / G])."""
    w, scale = _weight_of(self, name)
    return project(x, w.reshape(out, -1), None if scale is None else scale.reshape(out, -1), platform)

  def qkv(self, x: jax.Array, positions: jax.Array, platform: Platform):
    """x: [B, T, D] -> q [B, T, N, H] (scaled, rotated), k, v [B, T, K, H]."""
    cfg = self.cfg
    b, t, _ = x.shape
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = self._project(x, "q", platform, n * h).reshape(b, t, n, h)
    pair = self._project(x, "kv", platform, k * 2 * h).reshape(b, t, k, 2, h)
    if cfg.qkv_bias:
      q = q + self.q_bias[...].astype(x.dtype)
      pair = pair + self.kv_bias[...].astype(x.dtype)
    k, v = pair[:, :, :, 0], pair[:, :, :, 1]
    if cfg.qk_norm:
      q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
    if self.kind == LOCAL:
      rope = dict(base=cfg.rope_base_local)
    else:
      rope = dict(base=cfg.rope_base, scale=cfg.rope_scale, llama3=cfg.rope_llama3, factors=cfg.rope_factors)
    q = L.rope(q, positions, **rope) * jnp.asarray(cfg.q_scale, x.dtype)
    return q, L.rope(k, positions, **rope), v

  def __call__(self, x: jax.Array, positions: jax.Array, platform: Platform = REFERENCE,
               cache: kv.LayerCache | None = None, rows: BatchMeta | None = None):
    """x: [B, T, D]; positions: [B, T]. Returns (x [B, T, D], the new layer cache or None).

    Without a cache the T tokens attend among themselves (causal). With one, they also attend to
    what the rows held (unless `rows.fresh`), and are written into it after being read.
    """
    cfg = self.cfg
    ring = self.kind == LOCAL
    h = self._norm(x, self.attn_norm)
    q, k, v = self.qkv(h, positions, platform)
    blocks = [KVBlock(k.swapaxes(1, 2), v.swapaxes(1, 2), positions)]  # [B, K, T, H]
    if cache is not None and not rows.fresh:
      blocks.insert(0, kv.held(cache, rows, ring))
    a = attention(q, blocks, positions, cfg.sliding_window if ring else None, cfg.attn_softcap, platform)
    new_cache = None if cache is None else kv.write(cache, k, v, rows, after=a)
    a = self._project(a.reshape(*a.shape[:2], -1), "o", platform, cfg.embed_dim)
    if cfg.sandwich_norm:
      a = self._norm(a, self.post_attn_norm)
    x = x + a
    h = self._norm(x, self.mlp_norm)
    gu = self._project(h, "gate_up", platform, 2 * cfg.mlp_dim).reshape(*h.shape[:2], cfg.mlp_dim, 2)
    m = self._project(L.ACTIVATIONS[cfg.activation](gu[..., 0]) * gu[..., 1], "down", platform, cfg.embed_dim)
    if cfg.sandwich_norm:
      m = self._norm(m, self.post_mlp_norm)
    return x + m, new_cache


class Transformer(nnx.Module):
  """Token ids -> hidden states -> logits. Layers are unrolled (no scan over stacked weights)."""

  def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    """rngs: random initialisation. Without it the weights are zeros: for building the structure
    only (under `nnx.eval_shape`), where tracing 200 random initialisers would cost a start ~0.1 s."""
    self.cfg = cfg
    _weight(self, "embed", cfg, rngs, (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"), dtype)
    self.layers = nnx.List([Block(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
    self.final_norm = _norm(cfg, (cfg.embed_dim,), ("embed",), dtype)
    if not cfg.tie_embeddings:
      _weight(self, "unembed", cfg, rngs, (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"), dtype)

  @property
  def dtype(self) -> jnp.dtype:
    """The model's dtype: its norms', and its weights' unless they are quantized."""
    return self.final_norm[...].dtype

  def embed_tokens(self, tokens: jax.Array, dtype) -> jax.Array:
    table, scale = _weight_of(self, "embed")
    x = jnp.take(table, tokens, axis=0)  # [B, T, D]
    x = x.astype(dtype) if scale is None else quant.dequantize(x, jnp.take(scale, tokens, axis=0), dtype)
    if self.cfg.embed_scale:
      x = x * jnp.asarray(math.sqrt(self.cfg.embed_dim), dtype)
    return x

  def __call__(self, tokens: jax.Array, positions: jax.Array, platform: Platform = REFERENCE,
               cache: tuple[kv.LayerCache, ...] | None = None, rows: BatchMeta | None = None):
    """tokens, positions: [B, T] -> (hidden [B, T, D] after the final norm, new layer caches or None)."""
    x = self.embed_tokens(tokens, platform.compute_dtype(self.dtype))
    new = []
    fresh = rows is not None and rows.fresh
    rows = None if rows is None else rows._replace(fresh=False)
    for i, block in enumerate(self.layers):
      graphdef, state = nnx.split(block)
      x, layer = _block(x, positions, state, None if cache is None else cache[i], rows, graphdef=graphdef,
                        platform=platform, fresh=fresh)
      new.append(layer)
    hidden = L.rms_norm(x, self.final_norm[...], self.cfg.norm_eps, self.cfg.norm_offset)
    return hidden, None if cache is None else tuple(new)

  def logits(self, hidden: jax.Array, platform: Platform = REFERENCE) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] (tied or separate unembedding, optional soft-cap)."""
    w, scale = _weight_of(self, "embed" if self.cfg.tie_embeddings else "unembed")
    out = project(hidden, w, scale, platform).astype(jnp.float32)
    if self.cfg.final_softcap is not None:
      out = jnp.tanh(out / self.cfg.final_softcap) * self.cfg.final_softcap
    return out


@functools.partial(jax.jit, static_argnames=("graphdef", "platform", "fresh"))
def _block(x, positions, state, cache, rows, *, graphdef, platform, fresh):
  """One layer as a function of its arrays. Layers of one kind share its trace, so a model of L
  layers is traced once per kind rather than L times (what start-up waits for, even when the
  compiled program comes from the cache); XLA inlines the call, so it runs as written inline."""
  block = nnx.merge(graphdef, state)
  return block(x, positions, platform, cache, None if rows is None else rows._replace(fresh=fresh))


def first_layers(model: Transformer, n: int) -> Transformer:
  """The model cut after its first n layers (keeping its final norm and head): a draft for
  speculative decoding that shares the model's arrays, no copy."""
  if not 1 <= n <= model.cfg.num_layers:
    raise ValueError(f"draft_layers={n} must be between 1 and the model's {model.cfg.num_layers} layers")
  cfg = dataclasses.replace(model.cfg, num_layers=n, layer_kinds=model.cfg.layer_kinds[:n])
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, dtype=model.dtype)))
  state = nnx.state(model)
  flat = {path: v for path, v in nnx.to_flat_state(state) if path[0] != "layers" or int(path[1]) < n}
  return nnx.merge(graphdef, nnx.from_flat_state(flat))
