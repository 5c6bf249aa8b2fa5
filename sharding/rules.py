"""The one table from logical axes to mesh axes, and the shardings derived from it.

Every parameter and state array names its dimensions with logical axes (`model.params.param_specs`,
the decode state's axes); `RULES` says which mesh axis each logical axis is split over:

  heads, mlp       -> model  Megatron tensor parallel: q, kv and gate_up split by output
                             (column-parallel), o and down by input (row-parallel): one
                             all-reduce per attention block and per MLP block
  vocab            -> model  embedding table and logits split by vocabulary: no device holds [V, D]
  kv_heads         -> model  only when K divides the model axis; otherwise the kv weights and the
                             KV cache are replicated over `model` (multi-query: Gemma 3 270M, K=1)
  *_groups         -> as the axis they group: int8 block scales (`model.quant`) sit with their
                             blocks, or are replicated where the blocks do not divide evenly
  batch,
  cache_batch      -> data   slots (rows) split across `data`; a multi-query cache is thus split
                             by batch only (Pope et al., "Efficiently Scaling Transformer Inference")
  embed, head_dim,
  seq, cache_seq,
  prefix_blocks    -> -      replicated (so is a dimension with no logical name); the prefix
                             store is split like the cache's kv heads, its blocks kept whole

Divisibility is decided when shardings are built: a dimension that its mesh axis does not divide
is a ValueError naming the array, the logical axis, the sizes and the sizes that would work.
`kv_heads` is the one exception, listed in `REPLICATED_IF_INDIVISIBLE`.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxgen.model.params import param_specs
from jaxgen.sharding.mesh import MeshConfig, as_mesh

RULES: dict[str, str | None] = {
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "vocab": "model",
    "batch": "data",
    "cache_batch": "data",
    "embed": None,
    "head_dim": None,
    "seq": None,
    "cache_seq": None,
    "prefix_blocks": None,  # the prefix store's blocks: any slot may restore any block
    # int8 block scales (`model.quant`): the input axis of a weight in blocks of 32
    "heads_groups": "model",
    "mlp_groups": "model",
    "embed_groups": None,
}
# Replicated rather than refused when the mesh axis does not divide them: kv heads (multi-query),
# and int8 block scales whose blocks do not split evenly over the shards of their weight.
REPLICATED_IF_INDIVISIBLE = frozenset({"kv_heads", "heads_groups", "mlp_groups"})

_FIXES = {
    "cache_batch": "make max_batch (the number of slots) a multiple of {size}, or use a data axis from {ok}",
    "batch": "make the batch a multiple of {size}, or use a data axis from {ok}",
}


def partition_spec(name: str, shape: tuple[int, ...], axes: tuple[str | None, ...], mesh: Mesh) -> P:
  """The PartitionSpec the rules give an array `name` of `shape` with logical `axes`."""
  if len(axes) != len(shape):
    raise ValueError(f"{name}: {len(axes)} logical axes {axes} for a {len(shape)}-d shape {shape}")
  out, used = [], {}
  for dim, logical in zip(shape, axes):
    if logical is None:
      out.append(None)
      continue
    if logical not in RULES:
      raise ValueError(f"{name}: logical axis {logical!r} has no rule; known: {sorted(RULES)}")
    target = RULES[logical]
    if target is None:
      out.append(None)
      continue
    size = mesh.shape[target]
    if dim % size:
      if logical in REPLICATED_IF_INDIVISIBLE:
        out.append(None)
        continue
      ok = [s for s in range(1, mesh.size + 1) if dim % s == 0 and mesh.size % s == 0]
      fix = _FIXES.get(logical, "use a {axis} axis from {ok}").format(size=size, ok=ok, axis=target)
      raise ValueError(f"{name}: logical axis {logical!r} has size {dim}, which the mesh axis {target!r} of size "
                       f"{size} does not divide; {fix}")
    if target in used:
      raise ValueError(f"{name}: logical axes {used[target]!r} and {logical!r} both map to mesh axis {target!r}")
    used[target] = logical
    out.append(target)
  return P(*out)


def named_sharding(name: str, shape, axes, mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, partition_spec(name, tuple(shape), tuple(axes), mesh))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


# ---------------------------------------------------------------------------------- parameters
def param_shardings(cfg, dtype, mesh: Mesh | MeshConfig) -> dict[str, NamedSharding]:
  """{parameter name: NamedSharding}, keyed like `model.params.param_specs`."""
  mesh = as_mesh(mesh)
  return {name: named_sharding(name, s.shape, s.axes, mesh) for name, s in param_specs(cfg, dtype).items()}


def param_tree(params: nnx.State, shardings: Mapping[str, NamedSharding]) -> nnx.State:
  """The model's parameter State with each array replaced by its sharding (for jit in/out_shardings)."""

  def pick(path, _):
    name = ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
    return shardings[name]

  return jax.tree_util.tree_map_with_path(pick, params)


def placer(shardings: Mapping[str, NamedSharding]):
  """`place(name, host_array)` for `build_model`: every device receives only its own shard."""

  def place(name: str, host):
    sharding = shardings[name]
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  return place


def place_tree(values: Mapping, shardings: Mapping[str, jax.sharding.Sharding]) -> dict[str, jax.Array]:
  """Each value committed to its sharding. A jax.Array already laid out so is kept where it is (no
  copy, no host round trip); one laid out otherwise moves device to device; a host array sends
  each device only its shard."""
  return {name: jax.device_put(x, shardings[name]) for name, x in values.items()}


# -------------------------------------------------------------------------------- other trees
def tree_shardings(shapes, axes, mesh: Mesh | MeshConfig, prefix: str = ""):
  """NamedShardings for a tree of ShapeDtypeStructs, given the same tree of logical-axis tuples.

  `axes` is a tree whose leaves are tuples (one logical name or None per dimension), in the
  structure of `shapes`; names in errors are `prefix` + the leaf's path.
  """
  mesh = as_mesh(mesh)
  paths = jax.tree_util.tree_flatten_with_path(shapes)[0]
  names = iter(prefix + jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in paths)
  return jax.tree.map(lambda s, a: named_sharding(next(names), s.shape, a, mesh), shapes, axes,
                      is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def shard_shape(sharding: NamedSharding, shape) -> tuple[int, ...]:
  """Shape of one device's shard."""
  return tuple(sharding.shard_shape(tuple(shape)))


def shard_bytes(sharding: NamedSharding, shape, dtype) -> int:
  n = 1
  for d in shard_shape(sharding, shape):
    n *= d
  return n * jnp.dtype(dtype).itemsize

