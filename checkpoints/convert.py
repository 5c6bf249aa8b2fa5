"""`convert`: a GGUF file, HF directory or orbax checkpoint -> a jaxgen orbax checkpoint, all or nothing.

Everything is written into a fresh temporary directory beside DST (same filesystem) and renamed to
DST only once complete, so a failure at any point leaves nothing at DST (and removes the temporary).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class Summary:
  source: str
  kind: str  # "gguf", "hf" or "orbax"
  dst: str
  num_params: int
  num_bytes: int
  dtype: str
  seconds: float

  def __str__(self) -> str:
    size = next(f"{self.num_bytes / 10**p:.2f} {unit}" for p, unit in ((9, "GB"), (6, "MB"), (3, "KB"), (0, "B"))
                if self.num_bytes >= 10**p or p == 0)
    return (f"converted {self.kind} {self.source} -> {self.dst}: {self.num_params:,} parameters, "
            f"{size} {self.dtype}, {self.seconds:.1f} s")


def source_kind(src: str) -> str:
  from jaxgen.checkpoints.hf import is_hf_dir
  from jaxgen.checkpoints.orbax_io import is_orbax_dir

  if not os.path.exists(src):
    raise FileNotFoundError(f"model path {src!r} does not exist (jaxgen never downloads models)")
  if os.path.isfile(src):
    return "gguf"
  if is_orbax_dir(src):
    return "orbax"
  if is_hf_dir(src):
    return "hf"
  raise ValueError(f"{src!r} is a directory, but neither a jaxgen orbax checkpoint (jaxgen/metadata) nor a "
                   "Hugging Face model (config.json)")


def read_host_model(src: str, dtype, progress=None):
  """(kind, Transformer with host numpy arrays in `dtype`, Tokenizer) of any source."""
  from jaxgen.checkpoints.params import build_model

  kind = source_kind(src)
  if kind == "orbax":
    from jaxgen.checkpoints.orbax_io import restore

    _, model, tok = restore(src, dtype)
    return kind, model, tok
  if kind == "gguf":
    from jaxgen.checkpoints.gguf import read_gguf
    from jaxgen.checkpoints.tokenizer import tokenizer_from_gguf

    cfg, arrays, reader = read_gguf(src, progress=progress)
    tok = tokenizer_from_gguf(reader)
  else:
    from jaxgen.checkpoints.hf import read_hf
    from jaxgen.checkpoints.hf_tokenizer import tokenizer_from_hf_dir

    tok = tokenizer_from_hf_dir(src)
    cfg, arrays = read_hf(src, progress=progress)
  model = build_model(cfg, arrays, dtype, source=repr(src), place=lambda name, x: x)  # stays on the host
  return kind, model, tok


def convert(src: str, dst: str, dtype: str = "float32", show_progress: bool = True) -> Summary:
  """Converts `src` to an orbax checkpoint at `dst` (which must not exist); returns a Summary."""
  from tqdm.auto import tqdm

  from jaxgen.checkpoints.orbax_io import save

  t0 = time.perf_counter()
  src, dst = os.fspath(src), os.path.abspath(os.fspath(dst))
  if os.path.exists(dst):
    raise FileExistsError(f"destination {dst!r} already exists; remove it or choose another path")
  parent = os.path.dirname(dst)
  if not os.path.isdir(parent):
    raise FileNotFoundError(f"the directory {parent!r} for destination {dst!r} does not exist")
  total = None
  if source_kind(src) == "hf":
    from jaxgen.checkpoints.hf import count_tensors

    total = count_tensors(src)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.partial-", dir=parent)
  bar = tqdm(total=total, desc="reading tensors", unit="tensor", disable=not show_progress, leave=False)
  try:
    kind, model, tok = read_host_model(src, dtype, progress=bar.update)
    bar.set_description("writing orbax checkpoint")
    staged = os.path.join(tmp, "checkpoint")
    save(staged, model, tok, source=os.path.basename(os.path.abspath(src)))
    os.rename(staged, dst)
  finally:
    bar.close()
    shutil.rmtree(tmp, ignore_errors=True)
  from flax import nnx

  leaves = [v.get_value() for _, v in nnx.to_flat_state(nnx.split(model)[1])]
  return Summary(src, kind, dst, num_params=int(sum(np.prod(x.shape) for x in leaves)),
                 num_bytes=int(sum(x.nbytes for x in leaves)), dtype=str(np.dtype(leaves[0].dtype)),
                 seconds=time.perf_counter() - t0)
