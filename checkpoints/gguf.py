"""GGUF reader: metadata -> ModelConfig, tensors -> jaxgen's parameter names, dequantized by `gguf`.

What llama.cpp's conversion changed, and is undone here:
- Gemma norm weights were stored as (1 + w); jaxgen keeps w and applies (1 + w) (`norm_offset`).
- Llama/Mistral q and k rows were permuted into the interleaved RoPE layout; jaxgen uses the
  rotate-half layout of the original checkpoints, so the permutation is inverted.
- GGUF lists dims fastest-first; `gguf` hands back numpy order, which is [out, in] like jaxgen.
- Llama 3.1+ RoPE scaling is stored as the tensor `rope_freqs.weight` (a divisor per frequency,
  the "llama3" formula precomputed): it becomes `ModelConfig.rope_factors`.
- Q8_0 tensors are blocks of 32 int8 weights along a row with a float16 scale each: jaxgen's int8
  layout (`model.quant`). When int8 weights are asked for (`keep_q8_0`), they are split into
  values and scales as stored, with no float round trip; every other type is dequantized.

What GGUF does not record comes from documented tables: the per-family constants of
`FAMILY_DEFAULTS`, and Gemma's query scale (`GEMMA_QUERY_PRE_ATTN_SCALAR`). A file whose config
cannot be determined (an unknown Gemma size, a RoPE scaling type jaxgen does not implement) is
refused rather than run with guessed numerics.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

import gguf
import numpy as np
from jaxgen.model import quant
from jaxgen.model.config import FAMILY_DEFAULTS, LOCAL, ModelConfig, layer_pattern

GGUF_MAGIC = b"GGUF"
ROPE_FREQS = "rope_freqs.weight"

# Gemma scales queries by query_pre_attn_scalar ** -0.5, which GGUF has no key for (a converter may
# write the resulting multiplier as `{arch}.attention.scale`, which is used when present).
# llama.cpp decides it by model size, as here: the 27B models use embedding_length / head_count,
# every other size head_dim. Keyed by (family, block_count, embedding_length); values from the
# models' published configs.
GEMMA_QUERY_PRE_ATTN_SCALAR = {
    ("gemma2", 26, 2304): 256,  # Gemma 2 2B
    ("gemma2", 42, 3584): 256,  # Gemma 2 9B
    ("gemma2", 46, 4608): 144,  # Gemma 2 27B
    ("gemma3", 18, 640): 256,  # Gemma 3 270M
    ("gemma3", 26, 1152): 256,  # Gemma 3 1B
    ("gemma3", 34, 2560): 256,  # Gemma 3 4B
    ("gemma3", 48, 3840): 256,  # Gemma 3 12B
    ("gemma3", 62, 5376): 168,  # Gemma 3 27B
}

# llama.cpp tensor name (after "blk.{i}.") -> jaxgen name (after "layers.{i}.").
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_output.weight": "o",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "mlp_norm",
    "post_ffw_norm.weight": "post_mlp_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
}
_TOP_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "unembed"}
_PERMUTED_QK = ("llama", "mistral")


class _Reader(gguf.GGUFReader):
  """gguf's reader over a plain ndarray view of its memory map. np.memmap's bookkeeping on every
  slice (it parses a field a few bytes at a time) made reading a 262k-token vocabulary's metadata
  take 10 s; the view reads the same bytes in a quarter of the time, and tensors stay mapped."""

  @property
  def data(self) -> np.ndarray:
    return self._data

  @data.setter
  def data(self, value) -> None:
    self._data = np.asarray(value)  # the base class, sharing the map's memory


def open_reader(path: str):
  """The file's reader (metadata parsed, tensors mapped, nothing read)."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"model file {path!r} does not exist")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != GGUF_MAGIC:
    raise ValueError(f"{path!r} is not a GGUF file: it starts with {magic!r}, expected {GGUF_MAGIC!r}")
  try:
    return _Reader(path)
  except Exception as e:  # the library raises bare ValueError/IndexError on corrupt files
    raise ValueError(f"{path!r}: GGUF file could not be read ({type(e).__name__}: {e})") from e


def metadata(reader) -> dict:
  """GGUF key/values as python values (token arrays included)."""
  out = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):
      continue
    out[key] = field.contents()
  return out


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverts llama.cpp's interleaving of q/k rows: per head, [pairs, 2] -> [2, pairs]."""
  rows = w.shape[0]
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _jaxgen_name(name: str) -> str | None:
  if name in _TOP_NAMES:
    return _TOP_NAMES[name]
  m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
  if m and m.group(2) in _LAYER_NAMES:
    return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
  return None


def fuse(cfg: ModelConfig, tensors: dict[str, np.ndarray], source: str,
         names: dict[str, str] | None = None) -> dict[str, np.ndarray]:
  """Separate q/k/v/o/gate/up/down matrices ([out, in]) -> jaxgen's fused, head-shaped layout.

  Takes names "layers.{i}.{q,k,v,o,gate,up,...}" and returns "layers.{i}.{q,kv,o,gate_up,...}".
  Shapes are checked here so a wrong tensor is named in the error (by its name in the source
  file when `names` maps jaxgen names to those).
  """
  names = names or {}
  tensors = _same_kind_in_pairs(tensors, cfg.num_layers)
  d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  want = {"q": (n * h, d), "k": (k * h, d), "v": (k * h, d), "o": (d, n * h), "gate": (f, d), "up": (f, d),
          "down": (d, f), "q_bias": (n * h,), "k_bias": (k * h,), "v_bias": (k * h,)}
  out = {}
  separate = ("q", "k", "v", "o", "gate", "up", "q_bias", "k_bias", "v_bias")
  for name, w in tensors.items():
    leaf = name.rsplit(".", 1)[-1]
    if leaf in want and tuple(w.shape) != want[leaf]:
      raise ValueError(f"{source}: tensor {names.get(name, name)} has shape {tuple(w.shape)}, expected {want[leaf]}")
    if leaf not in separate and leaf.removesuffix(quant.SCALE_SUFFIX) not in separate:
      out[name] = w
  suffix = quant.SCALE_SUFFIX
  for i in range(cfg.num_layers):
    p = f"layers.{i}."
    try:
      for leaf, sources in _FUSED.items():
        out[p + leaf] = _fused(leaf, [tensors[p + s] for s in sources], n, k, h)
        if all(p + s + suffix in tensors for s in sources):  # Q8_0 blocks: scales fuse as their weights
          out[p + leaf + suffix] = _fused(leaf, [tensors[p + s + suffix] for s in sources], n, k, h)
      if cfg.qkv_bias:
        out[p + "q_bias"] = tensors[p + "q_bias"].reshape(n, h)
        out[p + "kv_bias"] = np.stack([tensors[p + "k_bias"].reshape(k, h), tensors[p + "v_bias"].reshape(k, h)], axis=1)
    except KeyError as e:
      raise ValueError(f"{source}: missing tensor for {e.args[0]}") from None
  return out


# jaxgen's fused matrix -> the separate ones it is made of
_FUSED = {"q": ("q",), "kv": ("k", "v"), "o": ("o",), "gate_up": ("gate", "up")}


def _fused(leaf: str, parts: list[np.ndarray], n: int, k: int, h: int) -> np.ndarray:
  """Separate [out, in] arrays (weights, or their Q8_0 scales [out, in / 32]) -> fused `leaf`."""
  if leaf == "q":
    return parts[0].reshape(n, h, -1)
  if leaf == "kv":
    return np.stack([x.reshape(k, h, -1) for x in parts], axis=1)
  if leaf == "gate_up":
    return np.stack(parts, axis=1)
  return parts[0]


def _same_kind_in_pairs(tensors: dict[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
  """k and v, gate and up are fused into one array: where only one of a pair came as int8 blocks
  (a file mixing Q8_0 with other types), that one is dequantized like its partner."""
  out = dict(tensors)
  suffix = quant.SCALE_SUFFIX
  for i in range(num_layers):
    for pair in (("k", "v"), ("gate", "up")):
      names = [f"layers.{i}.{leaf}" for leaf in pair]
      has = [name + suffix in out for name in names]
      if any(has) and not all(has):
        for name in names:
          if name + suffix in out:
            out[name] = np.asarray(quant.dequantize(out[name], out.pop(name + suffix), np.float32))
  return out


def _query_scale(arch: str, meta: Mapping[str, Any], n_layers: int, d: int, source: str) -> float:
  """Gemma's query multiplier (see GEMMA_QUERY_PRE_ATTN_SCALAR); 0.0 (1/sqrt(H)) for the others."""
  if arch not in ("gemma2", "gemma3"):
    return 0.0
  scale = meta.get(f"{arch}.attention.scale")
  if scale:
    return float(scale)
  scalar = GEMMA_QUERY_PRE_ATTN_SCALAR.get((arch, n_layers, d))
  if scalar is None:
    known = ", ".join(f"{L} layers x {D}" for a, L, D in GEMMA_QUERY_PRE_ATTN_SCALAR if a == arch)
    raise ValueError(f"{source}: the query scale of a {arch} model with {n_layers} layers of {d} cannot be "
                     f"determined: GGUF does not record query_pre_attn_scalar and this is not a published size "
                     f"({known}); add {arch}.attention.scale to the metadata, or load the Hugging Face directory")
  return float(scalar) ** -0.5


def _rope_scaling(arch: str, meta: Mapping[str, Any], source: str) -> dict:
  """ModelConfig RoPE fields from the metadata's scaling keys (the rope_freqs tensor is read apart)."""
  kind = meta.get(f"{arch}.rope.scaling.type", "none")
  if kind == "none":
    return {}
  if kind == "linear":
    return dict(rope_scale=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)))
  if kind == "llama3":
    try:
      return dict(rope_llama3=(float(meta[f"{arch}.rope.scaling.factor"]),
                               float(meta[f"{arch}.rope.scaling.low_freq_factor"]),
                               float(meta[f"{arch}.rope.scaling.high_freq_factor"]),
                               int(meta[f"{arch}.rope.scaling.original_context_length"])))
    except KeyError as e:
      raise ValueError(f"{source}: rope.scaling.type='llama3' without {e.args[0]}") from None
  raise ValueError(f"{source}: {arch}.rope.scaling.type={kind!r} is not implemented by jaxgen "
                   "(supported: 'none', 'linear', 'llama3' and the rope_freqs tensor)")


def _layer_kinds(n_layers: int, global_every: int | None, window: int | None) -> tuple[str, ...]:
  """Which layers slide: Gemma's fixed patterns; for a family without one (Mistral), a window in the
  metadata means every layer slides, as the same key means in its HF config."""
  if window and not global_every:
    return (LOCAL,) * n_layers
  return layer_pattern(n_layers, global_every, window)


def _optional_float(x) -> float | None:
  return None if x is None else float(x)


def config_from_gguf_metadata(meta: Mapping[str, Any], source: str = "<gguf>") -> ModelConfig:
  """Builds the config from GGUF key/values (`{arch}.embedding_length`, ...)."""
  arch = meta.get("general.architecture")
  if arch not in FAMILY_DEFAULTS:
    raise ValueError(f"{source}: general.architecture={arch!r} is not supported; "
                     f"supported: {sorted(FAMILY_DEFAULTS)}")
  fam = dict(FAMILY_DEFAULTS[arch])

  def get(key, default=None):
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
      raise ValueError(f"{source}: metadata key {arch}.{key} is missing")
    return value

  n_heads = int(get("attention.head_count"))
  d = int(get("embedding_length"))
  head_dim = int(get("attention.key_length", d // n_heads))
  window = meta.get(f"{arch}.attention.sliding_window")
  n_layers = int(get("block_count"))
  vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
  base = float(get("rope.freq_base", 10_000.0))
  return ModelConfig(
      family=arch,
      vocab_size=int(vocab),
      embed_dim=d,
      num_layers=n_layers,
      num_heads=n_heads,
      num_kv_heads=int(get("attention.head_count_kv", n_heads)),
      head_dim=head_dim,
      mlp_dim=int(get("feed_forward_length")),
      max_context=int(get("context_length")),
      norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
      norm_offset=fam.get("norm_offset", 0.0),
      rope_base=base,
      rope_base_local=float(meta.get(f"{arch}.rope.freq_base_swa", fam.get("rope_base_local", base))),
      sliding_window=int(window) if window else None,
      layer_kinds=_layer_kinds(n_layers, fam.get("global_every"), int(window) if window else None),
      query_scale=_query_scale(arch, meta, n_layers, d, source),
      embed_scale=fam.get("embed_scale", False),
      activation=fam["activation"],
      qk_norm=fam.get("qk_norm", False),
      sandwich_norm=fam.get("sandwich_norm", False),
      qkv_bias=fam.get("qkv_bias", False),
      tie_embeddings=fam.get("tie_embeddings", True),
      final_softcap=_optional_float(meta.get(f"{arch}.final_logit_softcapping", fam.get("final_softcap"))),
      attn_softcap=_optional_float(meta.get(f"{arch}.attn_logit_softcapping", fam.get("attn_softcap"))),
      **_rope_scaling(arch, meta, source),
  )


def _q8_0_blocks(t) -> tuple[np.ndarray, np.ndarray]:
  """A Q8_0 tensor's int8 values [out, in] and float32 scales [out, in / 32], as stored."""
  rows = int(np.prod([int(d) for d in t.shape[1:]]))
  blocks = np.asarray(t.data).reshape(rows, -1, 34)  # per block: float16 scale, then 32 int8
  scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
  values = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
  return values, scale


def read_gguf(path: str, progress=None, keep_q8_0: bool = False
              ) -> tuple[ModelConfig, dict[str, np.ndarray], object]:
  """Returns (config, {jaxgen name: ndarray}, reader). Tensors are dequantized to float32 on the
  host, except Q8_0 ones with `keep_q8_0`: those come as int8 values with `{name}_scale`.

  `progress(n)`, when given, is called after each tensor (for a progress bar over `reader.tensors`).
  """
  reader = open_reader(path)
  meta = metadata(reader)
  cfg = config_from_gguf_metadata(meta, source=repr(path))
  names = {t.name for t in reader.tensors}
  if "output.weight" in names:
    cfg = dataclasses.replace(cfg, tie_embeddings=False)
  arrays: dict[str, np.ndarray] = {}
  source_names: dict[str, str] = {}
  for t in reader.tensors:
    name = _jaxgen_name(t.name)
    scale = None
    if keep_q8_0 and t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and name and quant.is_quantized_name(name):
      w, scale = _q8_0_blocks(t)
    else:
      try:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
      except NotImplementedError as e:
        raise ValueError(f"{path!r}: tensor {t.name!r} uses {t.tensor_type.name}, which gguf cannot dequantize") from e
    w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # numpy order: [out, in]
    if t.name == ROPE_FREQS:
      if w.shape != (cfg.head_dim // 2,):
        raise ValueError(f"{path!r}: tensor {ROPE_FREQS} has shape {w.shape}, expected ({cfg.head_dim // 2},)")
      if cfg.rope_llama3 is not None or cfg.rope_scale != 1.0:
        raise ValueError(f"{path!r}: both {ROPE_FREQS} and rope.scaling metadata are set; refusing to guess")
      cfg = dataclasses.replace(cfg, rope_factors=tuple(float(x) for x in w))
      continue
    if name is None:
      raise ValueError(f"{path!r}: tensor {t.name!r} has no place in the {cfg.family} model")
    if cfg.norm_offset and name.endswith("norm"):
      w = w - np.float32(cfg.norm_offset)
    heads = cfg.num_heads if name.endswith(".q") else cfg.num_kv_heads
    if cfg.family in _PERMUTED_QK and name.endswith((".q", ".k")) and w.shape[0] == heads * cfg.head_dim:
      w = _unpermute_rope(w, heads)  # (a wrong shape is reported by fuse, by the file's tensor name)
      scale = None if scale is None else _unpermute_rope(scale, heads)
    arrays[name] = w
    source_names[name] = t.name
    if scale is not None:
      arrays[name + quant.SCALE_SUFFIX] = scale
    if progress is not None:
      progress(1)
  return cfg, fuse(cfg, arrays, repr(path), source_names), reader
