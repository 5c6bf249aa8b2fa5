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
from jaxgen.checkpoints import hf, orbax_io
from jaxgen.checkpoints.source import load, source_kind
from jaxgen.model.params import flat_params
from tqdm.auto import tqdm


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


def convert(src: str, dst: str, dtype: str = "float32", show_progress: bool = True,
            quantization: str | None = None) -> Summary:
  """Converts `src` to an orbax checkpoint at `dst` (which must not exist); returns a Summary.

  quantization="int8" writes int8 weights with their scales; the checkpoint restores quantized.
  """
  t0 = time.perf_counter()
  src, dst = os.fspath(src), os.path.abspath(os.fspath(dst))
  if os.path.exists(dst):
    raise FileExistsError(f"destination {dst!r} already exists; remove it or choose another path")
  parent = os.path.dirname(dst)
  if not os.path.isdir(parent):
    raise FileNotFoundError(f"the directory {parent!r} for destination {dst!r} does not exist")
  kind = source_kind(src)
  total = hf.count_tensors(src) if kind == "hf" else None
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.partial-", dir=parent)
  bar = tqdm(total=total, desc="reading tensors", unit="tensor", disable=not show_progress, leave=False)
  try:
    _, model, tok = load(src, dtype, place=lambda name, x: x, progress=bar.update,  # stays on the host
                         quantization=quantization)
    bar.set_description("writing orbax checkpoint")
    staged = os.path.join(tmp, "checkpoint")
    orbax_io.save(staged, model, tok, source=os.path.basename(os.path.abspath(src)))
    os.rename(staged, dst)
  finally:
    bar.close()
    shutil.rmtree(tmp, ignore_errors=True)
  leaves = list(flat_params(model).values())
  return Summary(src, kind, dst, num_params=int(sum(np.prod(x.shape) for x in leaves)),
                 num_bytes=int(sum(x.nbytes for x in leaves)),
                 dtype=str(np.dtype(dtype)) + (f", {quantization} weights" if quantization else ""),
                 seconds=time.perf_counter() - t0)
