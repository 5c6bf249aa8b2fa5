"""GGUF reader: metadata -> ModelConfig, tensors -> jaxgen's parameter names, dequantized by `gguf`.

What llama.cpp's conversion changed, and is undone here:
- Gemma norm weights were stored as (1 + w); jaxgen keeps w and applies (1 + w) (`norm_offset`).
- Llama/Mistral q and k rows were permuted into the interleaved RoPE layout; jaxgen uses the
  rotate-half layout of the original checkpoints, so the permutation is inverted.
- GGUF lists dims fastest-first; `gguf` hands back numpy order, which is [out, in] like jaxgen.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from jaxgen.model.config import ModelConfig, config_from_gguf_metadata

GGUF_MAGIC = b"GGUF"

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


def _open(path: str):
  import gguf

  if not os.path.exists(path):
    raise FileNotFoundError(f"model file {path!r} does not exist")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != GGUF_MAGIC:
    raise ValueError(f"{path!r} is not a GGUF file: it starts with {magic!r}, expected {GGUF_MAGIC!r}")
  try:
    return gguf.GGUFReader(path)
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
  d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  want = {"q": (n * h, d), "k": (k * h, d), "v": (k * h, d), "o": (d, n * h), "gate": (f, d), "up": (f, d),
          "down": (d, f), "q_bias": (n * h,), "k_bias": (k * h,), "v_bias": (k * h,)}
  out = {}
  for name, w in tensors.items():
    leaf = name.rsplit(".", 1)[-1]
    if leaf in want and tuple(w.shape) != want[leaf]:
      raise ValueError(f"{source}: tensor {names.get(name, name)} has shape {tuple(w.shape)}, expected {want[leaf]}")
    if leaf not in ("q", "k", "v", "o", "gate", "up", "q_bias", "k_bias", "v_bias"):
      out[name] = w
  for i in range(cfg.num_layers):
    p = f"layers.{i}."
    try:
      out[p + "q"] = tensors[p + "q"].reshape(n, h, d)
      out[p + "kv"] = np.stack([tensors[p + "k"].reshape(k, h, d), tensors[p + "v"].reshape(k, h, d)], axis=1)
      out[p + "o"] = tensors[p + "o"]
      out[p + "gate_up"] = np.stack([tensors[p + "gate"], tensors[p + "up"]], axis=1)
      if cfg.qkv_bias:
        out[p + "q_bias"] = tensors[p + "q_bias"].reshape(n, h)
        out[p + "kv_bias"] = np.stack([tensors[p + "k_bias"].reshape(k, h), tensors[p + "v_bias"].reshape(k, h)], axis=1)
    except KeyError as e:
      raise ValueError(f"{source}: missing tensor for {e.args[0]}") from None
  return out


def read_gguf(path: str, progress=None) -> tuple[ModelConfig, dict[str, np.ndarray], object]:
  """Returns (config, {jaxgen name: float32 ndarray}, reader). Tensors are dequantized on the host.

  `progress(n)`, when given, is called after each tensor (for a progress bar over `reader.tensors`).
  """
  import gguf

  reader = _open(path)
  meta = metadata(reader)
  cfg = config_from_gguf_metadata(meta, source=repr(path))
  names = {t.name for t in reader.tensors}
  if "output.weight" in names:
    cfg = dataclasses.replace(cfg, tie_embeddings=False)
  arrays: dict[str, np.ndarray] = {}
  source_names: dict[str, str] = {}
  for t in reader.tensors:
    name = _jaxgen_name(t.name)
    if name is None:
      if t.name.startswith("rope_freqs"):
        continue  # llama 3.1 long-context factors, recomputed from the config
      raise ValueError(f"{path!r}: tensor {t.name!r} has no place in the {cfg.family} model")
    try:
      w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    except NotImplementedError as e:
      raise ValueError(f"{path!r}: tensor {t.name!r} uses {t.tensor_type.name}, which gguf cannot dequantize") from e
    w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # numpy order: [out, in]
    if cfg.norm_offset and name.endswith("norm"):
      w = w - np.float32(cfg.norm_offset)
    heads = cfg.num_heads if name.endswith(".q") else cfg.num_kv_heads
    if cfg.family in _PERMUTED_QK and name.endswith((".q", ".k")) and w.shape[0] == heads * cfg.head_dim:
      w = _unpermute_rope(w, heads)  # (a wrong shape is reported by fuse, by the file's tensor name)
    arrays[name] = w
    source_names[name] = t.name
    if progress is not None:
      progress(1)
  return cfg, fuse(cfg, arrays, repr(path), source_names), reader
