"""The model's parameters by name: their declared specs, and a live `Transformer` from named arrays.

Names are dotted paths of the module tree ("embed", "layers.3.q", ...). Every reader (GGUF,
safetensors, orbax) produces `{name: array}` in jaxgen's layout; `build_model` checks each against
the declaration (presence, shape), casts it and places it; `assemble` sets the values of an
abstract model. Specs, shardings and restore targets all come from `param_specs`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxgen.model import quant
from jaxgen.model.config import ModelConfig
from jaxgen.model.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  shape: tuple[int, ...]
  dtype: jnp.dtype
  axes: tuple[str | None, ...]  # logical axis per dimension


def path_str(path) -> str:
  return ".".join(str(p) for p in path)


def abstract_model(cfg: ModelConfig, dtype) -> Transformer:
  """The model with ShapeDtypeStructs instead of arrays: no memory, no FLOPs."""
  return nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype))


def param_specs(cfg: ModelConfig, dtype) -> dict[str, ParamSpec]:
  """{name: ParamSpec} for every parameter, derived from the module code."""
  return dict(_param_specs(cfg, jnp.dtype(dtype)))


@functools.lru_cache(maxsize=16)
def _template(cfg: ModelConfig, dtype):
  """(graphdef, [(path, abstract Variable)]) of the model. Tracing the model's construction costs a
  few hundred ms, and loads, plans, assembly and weight swaps all ask: it is traced once. The
  Variables are never handed out, only copies of them."""
  graphdef, state = nnx.split(abstract_model(cfg, dtype))
  return graphdef, tuple(nnx.to_flat_state(state))


@functools.lru_cache(maxsize=16)
def _param_specs(cfg: ModelConfig, dtype) -> dict[str, ParamSpec]:
  out = {}
  for path, var in _template(cfg, dtype)[1]:
    value = var.get_value()
    out[path_str(path)] = ParamSpec(tuple(value.shape), value.dtype, tuple(var.get_metadata()["axes"]))
  return out


def assemble(cfg: ModelConfig, dtype, values: Mapping[str, jax.Array | np.ndarray]) -> Transformer:
  """A Transformer whose parameter `name` is `values[name]` (arrays already cast and placed)."""
  graphdef, flat = _template(cfg, jnp.dtype(dtype))
  return nnx.merge(graphdef, nnx.from_flat_state([(path, var.replace(values[path_str(path)])) for path, var in flat]))


def flat_params(model: Transformer) -> dict[str, jax.Array]:
  """{name: array}: the model's parameters by name."""
  return {path_str(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def build_model(cfg: ModelConfig, arrays: Mapping[str, np.ndarray], dtype, source: str,
                place: Callable[[str, np.ndarray], jax.Array] | None = None) -> Transformer:
  """Assembles a Transformer from named host arrays (`host_values`, then each placed).

  `place(name, host_array)` puts one (already cast) array on devices; the default is
  `jax.device_put` on the default device. Sharded loading passes a function that places shards.
  """
  place = place or (lambda name, x: jax.device_put(x))
  return assemble(cfg, dtype, {name: place(name, x) for name, x in host_values(cfg, arrays, dtype, source).items()})


def host_values(cfg: ModelConfig, arrays: Mapping[str, np.ndarray], dtype, source: str) -> dict[str, np.ndarray]:
  """Named host arrays checked against the declaration and cast as they will be placed. Raises
  naming the source and tensor on mismatch. Under `cfg.weight_quant == "int8"` float weights are
  quantized here, on the host (int8 arrays given with their `_scale` are taken as they are).
  """
  specs = param_specs(cfg, dtype)
  scales = {n for n in specs if n.endswith(quant.SCALE_SUFFIX)}
  missing = sorted(set(specs) - scales - set(arrays))
  if missing:
    raise ValueError(f"{source}: missing tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
  unexpected = sorted(set(arrays) - set(specs))
  if unexpected:
    raise ValueError(f"{source}: tensors the {cfg.family} model does not use: {unexpected[:5]}")
  values = {}
  for name, spec in specs.items():
    if name in scales:
      continue
    got = tuple(arrays[name].shape)
    if got != spec.shape:
      raise ValueError(f"{source}: tensor {name} has shape {got}, expected {spec.shape}")
    x = np.asarray(arrays[name])
    if name + quant.SCALE_SUFFIX in specs:  # quantized on the host, block by block
      scale_name = name + quant.SCALE_SUFFIX
      if x.dtype == np.int8:  # already quantized: it must come with its scales
        if scale_name not in arrays:
          raise ValueError(f"{source}: tensor {name} is int8 but {scale_name} is missing")
        scale = np.asarray(arrays[scale_name], np.float32)
      else:
        x, scale = quant.quantize_np(x)
      values[scale_name] = scale
    values[name] = x.astype(spec.dtype, copy=False)
  return values


def check_tree(cfg: ModelConfig, dtype, tree: Mapping[str, jax.Array | np.ndarray],
               source: str = "tree") -> dict[str, jax.Array | np.ndarray]:
  """A {name: array} tree checked against the declared parameters: every name, shape and dtype
  (ValueError naming the first that differs). Under int8 quantization a weight given in float
  (without its `_scale`) is quantized here where it lives: a jax.Array on its devices, keeping its
  sharding (`quant.quantize`); a host (numpy) array on the host (`quant.quantize_np`), to be placed
  shard by shard like any host array, never whole on one device."""
  specs = param_specs(cfg, dtype)
  scales = {n for n in specs if n.endswith(quant.SCALE_SUFFIX)}
  if not isinstance(tree, Mapping):
    raise ValueError(f"{source} is a {type(tree).__name__}: give a mapping {{parameter name: array}} (as LLM.weights())")
  for name in specs:
    if name not in tree and name not in scales:
      raise ValueError(f"{source} lacks parameter {name!r} (shape {specs[name].shape}, dtype {specs[name].dtype})")
  for name in tree:
    if name not in specs:
      raise ValueError(f"{source} has {name!r}, which the {cfg.family} model does not have")
  out = {}
  for name, spec in specs.items():
    if name in scales:
      continue
    x = tree[name]
    if tuple(x.shape) != spec.shape:
      raise ValueError(f"{source}[{name!r}] has shape {tuple(x.shape)}, expected {spec.shape}")
    scale_name = name + quant.SCALE_SUFFIX
    if scale_name in specs and np.dtype(x.dtype) != np.int8:  # a float weight of an int8 model
      if scale_name in tree:
        raise ValueError(f"{source}[{scale_name!r}] is given with a float {name!r}: give int8 values with "
                         "their scales, or the float weight alone (it is quantized where it lives)")
      out[name], out[scale_name] = _quantize(x) if isinstance(x, jax.Array) else quant.quantize_np(x)
      continue
    if np.dtype(x.dtype) != np.dtype(spec.dtype):
      raise ValueError(f"{source}[{name!r}] has dtype {np.dtype(x.dtype)}, expected {np.dtype(spec.dtype)}")
    out[name] = x
    if scale_name in specs:
      if scale_name not in tree:
        raise ValueError(f"{source}[{name!r}] is int8 but {scale_name!r} is missing")
      scale, want = tree[scale_name], specs[scale_name]
      if tuple(scale.shape) != want.shape or np.dtype(scale.dtype) != np.dtype(want.dtype):
        raise ValueError(f"{source}[{scale_name!r}] is {np.dtype(scale.dtype)}{tuple(scale.shape)}, expected "
                         f"{np.dtype(want.dtype)}{want.shape}")
      out[scale_name] = scale
  return out


_quantize = jax.jit(quant.quantize)


def logits_fn(cfg: ModelConfig, dtype) -> Callable:
  """A pure function (tree {name: array}, tokens [B, T]) -> float32 logits [B, T, V]: one uncached
  forward pass on the plain XLA path, differentiable, for training and scoring in user code
  (the tree is what `LLM.weights()` returns and `LLM.update_weights` takes)."""

  def forward(tree, tokens):
    model = assemble(cfg, dtype, tree)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden, _ = model(tokens, positions)
    return model.logits(hidden)

  return forward
