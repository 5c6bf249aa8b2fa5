"""Hugging Face model directories: `config.json` -> ModelConfig, `*.safetensors` -> jaxgen's names.

A directory holds `config.json`, the weights as one `model.safetensors` or as shards listed in
`model.safetensors.index.json`, and the tokenizer files (read by `hf_tokenizer.py`). Supported
`model_type`s are the keys of `FAMILIES`. Nothing is downloaded: the directory must exist.

Per-family differences are data: which HF tensor becomes which jaxgen parameter (`FAMILIES`) and
which config keys give which field (`config_from_hf`). HF stores projections [out, in] in the
rotate-half RoPE layout with Gemma's norms as w (applied as 1 + w), all as jaxgen does, so tensors
are only renamed and fused (`gguf.fuse`), never permuted.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Callable, Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can return it)
import numpy as np
from jaxgen.checkpoints.gguf import fuse
from jaxgen.model.config import (
  FAMILY_DEFAULTS,
  GLOBAL,
  LOCAL,
  ModelConfig,
  layer_pattern,
)
from jaxgen.model.params import param_specs
from safetensors import SafetensorError, safe_open

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"

# HF tensor name inside "layers.{i}." -> jaxgen name before fusing (see `gguf.fuse`).
_ATTN_MLP = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
LLAMA_LAYER = {**_ATTN_MLP, "post_attention_layernorm.weight": "mlp_norm"}
GEMMA_LAYER = {**_ATTN_MLP, "post_attention_layernorm.weight": "post_attn_norm",
               "pre_feedforward_layernorm.weight": "mlp_norm",
               "post_feedforward_layernorm.weight": "post_mlp_norm"}
TOP = {"embed_tokens.weight": "embed", "norm.weight": "final_norm"}


@dataclasses.dataclass(frozen=True)
class Family:
  """How one HF `model_type` maps onto jaxgen."""

  name: str  # jaxgen family (a FAMILY_DEFAULTS key)
  layer: Mapping[str, str]  # tensor names inside a layer
  decoder: tuple[str, ...] = ("model.",)  # prefixes of the decoder's tensors (first match wins)
  lm_head: tuple[str, ...] = ("lm_head.weight",)
  skip: tuple[str, ...] = ()  # prefixes of tensors that are not the text decoder (vision tower)
  text_config: bool = False  # the decoder's config is nested under "text_config"
  tie_default: bool = False  # transformers' default for tie_word_embeddings


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", LLAMA_LAYER),
    "mistral": Family("mistral", LLAMA_LAYER),
    "qwen2": Family("qwen2", LLAMA_LAYER),
    "qwen3": Family("qwen3", LLAMA_LAYER),
    "gemma2": Family("gemma2", GEMMA_LAYER, tie_default=True),
    "gemma3_text": Family("gemma3", GEMMA_LAYER, tie_default=True),
    # Gemma 3 with its vision tower: only the language model is read.
    "gemma3": Family("gemma3", GEMMA_LAYER, decoder=("model.language_model.", "language_model.model."),
                     lm_head=("lm_head.weight", "language_model.lm_head.weight"),
                     skip=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                           "multi_modal_projector."),
                     text_config=True, tie_default=True),
}

FUSED = ("q", "k", "v", "o", "gate", "up", "down", "q_bias", "k_bias", "v_bias")  # reshaped by fuse()
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
ROPE_TYPES = ("default", "linear", "llama3")


def _family(raw: Mapping[str, Any], source: str) -> Family:
  model_type = raw.get("model_type")
  if model_type not in FAMILIES:
    raise ValueError(f"{source}: model_type={model_type!r} is not supported; supported: {sorted(FAMILIES)}")
  return FAMILIES[model_type]


def _rope_dict(c: Mapping[str, Any], layer_type: str, gemma: bool) -> dict:
  """The RoPE parameters of one layer type, from transformers 5's `rope_parameters` or v4 keys."""
  rp = c.get("rope_parameters")
  if isinstance(rp, Mapping):
    if isinstance(rp.get(layer_type), Mapping):
      return dict(rp[layer_type])
    if "rope_type" in rp or "rope_theta" in rp:
      return dict(rp)
  if gemma and layer_type == "sliding_attention":  # v4: local layers have their own base, no scaling
    return {"rope_type": "default", "rope_theta": c.get("rope_local_base_freq", 10_000.0)}
  out = dict(c.get("rope_scaling") or {})
  out["rope_type"] = out.pop("rope_type", out.pop("type", "default"))
  out["rope_theta"] = c.get("rope_theta", 10_000.0)
  return out


def _rope(d: Mapping[str, Any], source: str) -> tuple[float, float, tuple | None]:
  """(base, linear scale, llama3 parameters) of a RoPE parameter dict."""
  kind = d.get("rope_type", "default")
  base = float(d.get("rope_theta", 10_000.0))
  if kind == "default":
    return base, 1.0, None
  if kind == "linear":
    return base, float(d["factor"]), None
  if kind == "llama3":
    return base, 1.0, (float(d["factor"]), float(d["low_freq_factor"]), float(d["high_freq_factor"]),
                       int(d["original_max_position_embeddings"]))
  raise ValueError(f"{source}: rope_type={kind!r} is not supported; supported: {list(ROPE_TYPES)}")


def _layer_kinds(c: Mapping[str, Any], model_type: str, n: int, source: str) -> tuple[str, ...]:
  types = c.get("layer_types")
  if types is not None:
    kinds = {"full_attention": GLOBAL, "sliding_attention": LOCAL}
    bad = sorted({t for t in types if t not in kinds})
    if bad or len(types) != n:
      raise ValueError(f"{source}: layer_types={list(types)} must list {n} of {sorted(kinds)}")
    return tuple(kinds[t] for t in types)
  window = c.get("sliding_window")
  if model_type.startswith("gemma3"):
    every = c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6))
    return layer_pattern(n, every, window)
  if model_type == "gemma2":
    return layer_pattern(n, 2, window)
  if model_type in ("qwen2", "qwen3"):
    if not c.get("use_sliding_window") or not window:
      return (GLOBAL,) * n
    first = c.get("max_window_layers", n)
    return tuple(LOCAL if i >= first else GLOBAL for i in range(n))
  return (LOCAL if window else GLOBAL,) * n  # llama, mistral: a window applies to every layer


def config_from_hf(raw: Mapping[str, Any], source: str = "<config.json>") -> ModelConfig:
  """Builds the config from a parsed HF `config.json` (transformers 4 or 5 layout)."""
  fam = _family(raw, source)
  c = (raw.get("text_config") or {}) if fam.text_config else raw
  model_type = raw["model_type"]
  gemma = fam.name in ("gemma2", "gemma3")  # queries scaled by query_pre_attn_scalar ** -0.5
  local_base = fam.name == "gemma3"  # sliding-window layers have a RoPE base of their own
  defaults = FAMILY_DEFAULTS[fam.name]

  def need(key):
    if c.get(key) is None:
      raise ValueError(f"{source}: config key {key!r} is missing")
    return c[key]

  for key, what in (("attention_bias", "a bias on o_proj"), ("mlp_bias", "biases in the MLP"),
                    ("use_bidirectional_attention", "bidirectional attention")):
    if c.get(key) and not (key == "attention_bias" and fam.name == "qwen2"):
      raise ValueError(f"{source}: {key}=true ({what}) is not supported for model_type={model_type!r}")
  act_name = c.get("hidden_activation") or c.get("hidden_act") or "silu"
  if act_name not in ACTIVATIONS:
    raise ValueError(f"{source}: activation {act_name!r} is not supported; supported: {sorted(ACTIVATIONS)}")

  n_layers, n_heads, d = int(need("num_hidden_layers")), int(need("num_attention_heads")), int(need("hidden_size"))
  head_dim = int(c.get("head_dim") or d // n_heads)
  kinds = _layer_kinds(c, model_type, n_layers, source)
  window = int(c["sliding_window"]) if LOCAL in kinds else None
  base, scale, llama3 = _rope(_rope_dict(c, "full_attention", local_base), source)
  base_local, scale_local, llama3_local = _rope(_rope_dict(c, "sliding_attention", local_base), source)
  if LOCAL in kinds and (scale_local != 1.0 or llama3_local is not None):
    raise ValueError(f"{source}: RoPE scaling on sliding-window layers is not supported")
  if not local_base:
    base_local = base  # one RoPE for every layer; a window does not change it
  return ModelConfig(
      family=fam.name,
      vocab_size=int(need("vocab_size")),
      embed_dim=d,
      num_layers=n_layers,
      num_heads=n_heads,
      num_kv_heads=int(c.get("num_key_value_heads") or n_heads),
      head_dim=head_dim,
      mlp_dim=int(need("intermediate_size")),
      max_context=int(need("max_position_embeddings")),
      norm_eps=float(c.get("rms_norm_eps", 1e-6)),
      norm_offset=defaults.get("norm_offset", 0.0),
      rope_base=base,
      rope_base_local=base_local,
      rope_scale=scale,
      rope_llama3=llama3,
      sliding_window=window,
      layer_kinds=kinds,
      query_scale=float(c.get("query_pre_attn_scalar", head_dim)) ** -0.5 if gemma else 0.0,
      embed_scale=defaults.get("embed_scale", False),
      activation=ACTIVATIONS[act_name],
      qk_norm=defaults.get("qk_norm", False),
      sandwich_norm=defaults.get("sandwich_norm", False),
      qkv_bias=defaults.get("qkv_bias", False),
      tie_embeddings=bool(c.get("tie_word_embeddings", raw.get("tie_word_embeddings", fam.tie_default))),
      final_softcap=c.get("final_logit_softcapping"),
      attn_softcap=c.get("attn_logit_softcapping"),
  )


def read_config(path: str) -> tuple[dict, ModelConfig]:
  """(raw config.json, ModelConfig) of an HF directory."""
  check_dir(path)
  file = os.path.join(path, CONFIG)
  try:
    with open(file) as f:
      raw = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{file!r} is not valid JSON: {e}") from None
  return raw, config_from_hf(raw, source=repr(file))


def check_dir(path: str) -> None:
  if not os.path.isdir(path):
    raise FileNotFoundError(f"Hugging Face model directory {path!r} does not exist (jaxgen never downloads models)")
  if not os.path.isfile(os.path.join(path, CONFIG)):
    raise FileNotFoundError(f"{path!r} has no {CONFIG}: not a Hugging Face model directory")


def is_hf_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, CONFIG))


def safetensors_files(path: str) -> dict[str, list[str]]:
  """{file: [tensor names]} of the directory's weights (from the index when there is one)."""
  index = os.path.join(path, INDEX)
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index!r} has no weight_map")
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
      files.setdefault(os.path.join(path, file), []).append(name)
    for file in files:
      if not os.path.isfile(file):
        raise FileNotFoundError(f"{index!r} lists {os.path.basename(file)!r}, which is missing from {path!r}")
    return files
  found = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
  if not found:
    raise FileNotFoundError(f"{path!r} has no *.safetensors weights (only safetensors are read, never .bin/.pt)")
  return {file: [] for file in found}


def _read_file(file: str, names: list[str], keep: Callable[[str], bool]):
  """Yields (name, ndarray) from one safetensors file; `names` empty means every tensor."""
  try:
    with safe_open(file, framework="numpy") as f:
      keys = list(f.keys())
      missing = sorted(set(names) - set(keys))
      if missing:
        raise ValueError(f"{file!r}: the index places {missing[:3]} here, but the file lacks them")
      for name in names or keys:
        if keep(name):
          yield name, f.get_tensor(name)
  except SafetensorError as e:
    raise ValueError(f"{file!r} could not be read as safetensors; is it truncated or corrupt? ({e})") from None


def _jaxgen_names(fam: Family, cfg: ModelConfig, keys) -> tuple[dict[str, str], list[str]]:
  """({HF name: jaxgen name before fusing}, [HF names the model needs but the files lack])."""
  keys = set(keys)
  prefix = next((p for p in fam.decoder if any(k.startswith(p) for k in keys)), fam.decoder[0])
  optional = {"q_bias": cfg.qkv_bias, "k_bias": cfg.qkv_bias, "v_bias": cfg.qkv_bias,
              "q_norm": cfg.qk_norm, "k_norm": cfg.qk_norm}
  want = {prefix + hf: jg for hf, jg in TOP.items()}
  for i in range(cfg.num_layers):
    for hf, jg in fam.layer.items():
      if optional.get(jg, True):
        want[f"{prefix}layers.{i}.{hf}"] = f"layers.{i}.{jg}"
  if not cfg.tie_embeddings:
    want[next((h for h in fam.lm_head if h in keys), fam.lm_head[0])] = "unembed"
  return want, sorted(set(want) - keys)


def read_hf(path: str, progress: Callable[[int], None] | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """Returns (config, {jaxgen name: ndarray in the file's dtype}), fused into jaxgen's layout.

  `progress(n)` is called after each tensor read (for a progress bar).
  """
  raw, cfg = read_config(path)
  fam = _family(raw, repr(path))
  files = safetensors_files(path)
  keys = [k for names in files.values() for k in names] or _all_keys(files)
  names, missing = _jaxgen_names(fam, cfg, keys)
  if missing:
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    raise ValueError(f"{path!r}: missing tensor {', '.join(missing[:3])}{more} (the {fam.name} model needs it)")
  unknown = sorted(k for k in keys if k not in names and not k.startswith(fam.skip)
                   and not (cfg.tie_embeddings and k in fam.lm_head))
  if unknown:
    raise ValueError(f"{path!r}: tensor {unknown[0]!r} has no place in the {fam.name} model "
                     f"({len(unknown)} such tensors)")
  arrays: dict[str, np.ndarray] = {}
  origin: dict[str, str] = {}
  for file, file_names in files.items():
    for hf_name, w in _read_file(file, file_names, names.__contains__):
      arrays[names[hf_name]] = w
      origin[names[hf_name]] = f"{hf_name} (in {os.path.basename(file)})"
      if progress:
        progress(1)
  specs = param_specs(cfg, "float32")
  for name, w in arrays.items():  # fuse() checks the projections; the rest keep their shape
    if name.rsplit(".", 1)[-1] not in FUSED and tuple(w.shape) != specs[name].shape:
      raise ValueError(f"{path!r}: tensor {origin[name]} has shape {tuple(w.shape)}, expected {specs[name].shape}")
  return cfg, fuse(cfg, arrays, repr(path), names=origin)


def tree_from_hf(config: Mapping[str, Any], tensors: Mapping[str, Any],
                 source: str = "<tensors>") -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """An HF model in memory -> (config, jaxgen's {name: array} tree), as `read_hf` reads one from disk.

  config: the config.json dict (e.g. `model.config.to_dict()`); tensors: {HF tensor name: array}
  (e.g. a transformers state dict as numpy). Tensors outside the text decoder (a vision tower) are
  skipped; a missing or unknown one is a ValueError naming it.
  """
  cfg = config_from_hf(config, source)
  fam = _family(config, source)
  names, missing = _jaxgen_names(fam, cfg, tensors)
  if missing:
    raise ValueError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing; the {fam.name} model needs them)")
  unknown = sorted(k for k in tensors if k not in names and not k.startswith(fam.skip)
                   and not (cfg.tie_embeddings and k in fam.lm_head))
  if unknown:
    raise ValueError(f"{source}: tensor {unknown[0]!r} has no place in the {fam.name} model ({len(unknown)} such tensors)")
  arrays = {names[k]: np.asarray(v) for k, v in tensors.items() if k in names}
  return cfg, fuse(cfg, arrays, source, names={names[k]: k for k in tensors if k in names})


def _all_keys(files: Mapping[str, list[str]]) -> list[str]:
  keys = []
  for file in files:
    try:
      with safe_open(file, framework="numpy") as f:
        keys += list(f.keys())
    except SafetensorError as e:
      raise ValueError(f"{file!r} could not be read as safetensors; is it truncated or corrupt? ({e})") from None
  return keys


def count_tensors(path: str) -> int:
  """How many tensors `read_hf` will read (the progress bar's total)."""
  raw, cfg = read_config(path)
  files = safetensors_files(path)
  keys = [k for names in files.values() for k in names] or _all_keys(files)
  return len(_jaxgen_names(_family(raw, repr(path)), cfg, keys)[0])
