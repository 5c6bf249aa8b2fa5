"""From named host arrays to a live `Transformer`, checked against the model's own declarations.

Every reader (GGUF, safetensors, orbax) produces `{"layers.3.q": ndarray, ...}` in jaxgen's names and
[out, in] layout; this module validates each against the abstract model (shape, presence), casts
to the requested dtype and places it on devices (optionally with a sharding per parameter).
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgen.model.config import ModelConfig
from jaxgen.model.transformer import Transformer


def path_str(path) -> str:
  return ".".join(str(p) for p in path)


def abstract_model(cfg: ModelConfig, dtype) -> Transformer:
  """The model with ShapeDtypeStructs instead of arrays: no memory, no FLOPs."""
  return nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def param_specs(cfg: ModelConfig, dtype) -> dict[str, tuple[tuple[int, ...], object, tuple[str, ...]]]:
  """{name: (shape, dtype, logical axes)} for every parameter, derived from the module code."""
  _, state = nnx.split(abstract_model(cfg, dtype))
  out = {}
  for path, var in nnx.to_flat_state(state):
    value = var.get_value()
    out[path_str(path)] = (tuple(value.shape), value.dtype, tuple(var.get_metadata()["axes"]))
  return out


def build_model(cfg: ModelConfig, arrays: Mapping[str, np.ndarray], dtype, source: str,
                place: Callable[[str, np.ndarray], jax.Array] | None = None) -> Transformer:
  """Assembles a Transformer from named arrays. Raises naming the source and tensor on mismatch.

  `place(name, host_array)` puts one (already cast) array on devices; the default is
  `jnp.asarray` on the default device. Sharded loading passes a function that places shards.
  """
  graphdef, state = nnx.split(abstract_model(cfg, dtype))
  flat = nnx.to_flat_state(state)
  expected = {path_str(p) for p, _ in flat}
  missing = sorted(expected - set(arrays))
  if missing:
    raise ValueError(f"{source}: missing tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
  unexpected = sorted(set(arrays) - expected)
  if unexpected:
    raise ValueError(f"{source}: tensors the {cfg.family} model does not use: {unexpected[:5]}")
  place = place or (lambda name, x: jnp.asarray(x))
  np_dtype = jnp.dtype(dtype)
  for path, var in flat:
    name = path_str(path)
    want = tuple(var.get_value().shape)
    got = tuple(arrays[name].shape)
    if got != want:
      raise ValueError(f"{source}: tensor {name} has shape {got}, expected {want}")
    var.set_value(place(name, np.asarray(arrays[name]).astype(np_dtype, copy=False)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))
