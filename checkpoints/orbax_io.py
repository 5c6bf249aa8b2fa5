"""jaxgen's orbax checkpoint: one directory holding the parameters and everything to rebuild the model.

Layout (an orbax composite checkpoint, plus the tokenizer beside its items):

    DST/params/                  the parameter tree {"embed": ..., "layers": {"0": {"q": ...}}} (orbax PyTree)
    DST/jaxgen/metadata          JSON: format, format_version, dtype, model config, tokenizer ids and
                                 flags, chat template, source
    DST/tokenizer/tokenizer.json the `tokenizers` backend (for GGUF sources: the one built from the metadata)
    DST/_CHECKPOINT_METADATA     orbax's own

`restore` derives the abstract target from the model's own parameter declarations (`param_specs`)
with one sharding per parameter, so each device reads only its shards straight from the files
(no full host copy) and any mesh works, whatever mesh the checkpoint was saved from. A checkpoint
written by a newer format version is refused; older ones stay readable.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxgen.checkpoints.tokenizer import Tokenizer
from jaxgen.model.config import ModelConfig
from jaxgen.model.params import assemble, flat_params, param_specs
from tokenizers import Tokenizer as Backend

FORMAT = "jaxgen-orbax"
FORMAT_VERSION = 1
METADATA = os.path.join("jaxgen", "metadata")
TOKENIZER = os.path.join("tokenizer", "tokenizer.json")

Shardings = Mapping[str, jax.sharding.Sharding]


def is_orbax_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, METADATA))


@functools.cache
def _orbax():
  """(orbax.checkpoint, etils.epath), imported on first use rather than with the module: they cost
  ~50 MB of memory and ~0.1 s of import that a start from GGUF or HF weights (and from the weight
  cache, which shares this module's metadata format) never needs."""
  import orbax.checkpoint as ocp
  from etils import epath
  return ocp, epath


def _checkpointer():
  ocp, _ = _orbax()
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _nest(flat: Mapping[str, object]) -> dict:
  """{"layers.0.q": x} -> {"layers": {"0": {"q": x}}}."""
  tree: dict = {}
  for name, value in flat.items():
    *parents, leaf = name.split(".")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def tokenizer_meta(tokenizer) -> dict:
  """The special ids, flags and chat template a `Tokenizer` is rebuilt with (beside its tokenizer.json)."""
  return dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, unk_id=tokenizer.unk_id,
              add_bos=tokenizer.add_bos, add_eos=tokenizer.add_eos, extra_stop_ids=sorted(tokenizer.stop_ids),
              chat_template=getattr(tokenizer, "chat_template", None))


def save(path: str, model, tokenizer, source: str = "") -> None:
  """Writes `model` (a Transformer, host numpy or device arrays, any sharding) and `tokenizer` to `path`.

  `path` must not exist. Use `convert.convert` for an all-or-nothing write beside the destination.
  """
  path = os.path.abspath(path)
  if os.path.exists(path):
    raise FileExistsError(f"{path!r} already exists; orbax checkpoints are written to a new directory")
  params = flat_params(model)
  dtype = np.dtype(model.dtype)
  declared = param_specs(model.cfg, dtype)  # one dtype, except int8 weights and their float32 scales
  odd = sorted(n for n, v in params.items() if np.dtype(v.dtype) != np.dtype(declared[n].dtype))
  if odd:
    raise ValueError(f"parameters {odd[:3]} are not in the model's dtype {dtype}; a checkpoint holds one dtype")
  meta = dict(format=FORMAT, format_version=FORMAT_VERSION, dtype=str(dtype),
              config=dataclasses.asdict(model.cfg), tokenizer=tokenizer_meta(tokenizer), source=source,
              num_params=int(sum(np.prod(v.shape) for v in params.values())))
  ocp, _ = _orbax()
  _checkpointer().save(path, args=ocp.args.Composite(params=ocp.args.StandardSave(_nest(params)),
                                                     jaxgen=ocp.args.JsonSave(meta)))
  os.makedirs(os.path.dirname(os.path.join(path, TOKENIZER)))
  tokenizer.backend.save(os.path.join(path, TOKENIZER))


def read_metadata(path: str) -> dict:
  """The checkpoint's JSON metadata, after checking that this jaxgen can read it."""
  file = os.path.join(path, METADATA)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path!r} is not a jaxgen orbax checkpoint (no {METADATA})")
  with open(file) as f:
    meta = json.load(f)
  if meta.get("format") != FORMAT:
    raise ValueError(f"{file!r}: format={meta.get('format')!r}, expected {FORMAT!r}")
  version = meta.get("format_version")
  if not isinstance(version, int) or version > FORMAT_VERSION:
    raise ValueError(f"{path!r} was written in jaxgen orbax format version {version}, but this jaxgen reads "
                     f"versions up to {FORMAT_VERSION}; upgrade jaxgen to load it")
  return meta


def config_from_metadata(meta: Mapping) -> ModelConfig:
  """ModelConfig from its JSON form (lists back to tuples)."""
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  raw = meta["config"]
  unknown = sorted(set(raw) - fields)
  if unknown:
    raise ValueError(f"checkpoint config has fields this jaxgen does not know: {unknown}")
  return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def tokenizer_from_checkpoint(path: str, meta: Mapping):
  file = os.path.join(path, TOKENIZER)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path!r}: the checkpoint's tokenizer {TOKENIZER} is missing")
  return Tokenizer(Backend.from_file(file), **meta["tokenizer"])


def restore(path: str, dtype=None,
            shardings: Shardings | Callable[[ModelConfig, object], Shardings] | None = None,
            place: Callable[[str, np.ndarray], jax.Array] | None = None):
  """Returns (ModelConfig, Transformer, Tokenizer).

  dtype: the parameters' dtype (default: the saved one; others are cast while reading). A
  quantized checkpoint (`cfg.weight_quant`) keeps its int8 weights and float32 scales as saved.
  shardings: {parameter name: Sharding}, or a function (cfg, dtype) -> that mapping (e.g.
  `functools.partial(jaxgen.sharding.rules.param_shardings, mesh=mesh)`): each device reads its
  shards. place: instead, read each array to the host and hand it to `place(name, array)` (as
  `build_model` does). Neither: every array on the default device.
  """
  path = os.path.abspath(path)
  meta = read_metadata(path)
  cfg = config_from_metadata(meta)
  dtype = jnp.dtype(dtype or meta["dtype"])
  # Each array in its declared dtype: `dtype`, or int8 values and float32 scales when quantized.
  declared = param_specs(cfg, dtype)
  specs = {name: s.shape for name, s in declared.items()}
  _check_saved(path, specs)
  ocp, _ = _orbax()
  if place is not None:
    args = ocp.args.PyTreeRestore(restore_args=_nest({n: ocp.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype)
                                                      for n, s in declared.items()}))
  else:
    if callable(shardings):
      shardings = shardings(cfg, dtype)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    args = ocp.args.StandardRestore(_nest({n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[n] if shardings
                                                                   else default) for n, s in declared.items()}))
  values = dict(_leaves(_checkpointer().restore(path, args=ocp.args.Composite(params=args))["params"], join=True))
  if place is not None:
    values = {name: place(name, x) for name, x in values.items()}
  return cfg, assemble(cfg, dtype, values), tokenizer_from_checkpoint(path, meta)


def _check_saved(path: str, specs: Mapping[str, tuple[int, ...]]) -> None:
  """Every parameter the model declares is in the checkpoint, with its shape (names the tensor if not)."""
  ocp, epath = _orbax()
  saved = dict(_leaves(ocp.PyTreeCheckpointHandler().metadata(epath.Path(path) / "params").tree, join=True))
  for name, shape in specs.items():
    if name not in saved:
      raise ValueError(f"{path!r}: the checkpoint has no tensor {name}")
    if tuple(saved[name].shape) != shape:
      raise ValueError(f"{path!r}: tensor {name} has shape {tuple(saved[name].shape)}, expected {shape}")


def _leaves(tree: Mapping, prefix=(), join=False):
  """(path, leaf) pairs of a nested dict; paths as tuples, or dotted names with join=True."""
  for key, value in tree.items():
    p = prefix + (str(key),)
    if isinstance(value, Mapping):
      yield from _leaves(value, p, join)
    else:
      yield (".".join(p) if join else p), value
