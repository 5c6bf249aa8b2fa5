"""GGUF reading on small files written here with the `gguf` package: llama.cpp's conventions
(Gemma's stored 1 + w norms, llama's interleaved q/k rows) are undone, and bad files are refused
with errors that name the file or tensor."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx
from jaxgen.checkpoints.gguf import _jaxgen_name, config_from_gguf_metadata, metadata
from jaxgen.checkpoints.source import load

TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + [
    "▁", "a", "b", "c", "▁a", "▁b", "ab", "▁ab"] + [f"t{i}" for i in range(32)]
TYPES = [3, 3, 3, 2] + [6] * 256 + [1] * 40


def write_gguf(path, arch="gemma3", layers=6, bad_shape=None, extra_tensor=None):
  """A tiny random model of `arch` as GGUF (F32). Returns the jaxgen model it should load as."""
  import gguf

  w = gguf.GGUFWriter(str(path), arch)
  w.add_context_length(256)
  w.add_embedding_length(32)
  w.add_block_count(layers)
  w.add_feed_forward_length(64)
  w.add_head_count(4)
  w.add_head_count_kv(2)
  w.add_key_length(16)
  w.add_value_length(16)
  w.add_layer_norm_rms_eps(1e-6)
  w.add_rope_freq_base(1e6)
  if arch == "gemma3":
    w.add_sliding_window(8)
    w.add_attention_scale(0.125)  # query_pre_attn_scalar 64, not head_dim: only the metadata can say
  w.add_tokenizer_model("llama")
  w.add_token_list(TOKENS)
  w.add_token_scores([0.0] * len(TOKENS))
  w.add_token_types(TYPES)
  w.add_bos_token_id(2)
  w.add_eos_token_id(1)
  w.add_unk_token_id(3)
  w.add_pad_token_id(0)
  meta = {"general.architecture": arch, f"{arch}.context_length": 256, f"{arch}.embedding_length": 32,
          f"{arch}.block_count": layers, f"{arch}.feed_forward_length": 64, f"{arch}.attention.head_count": 4,
          f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.key_length": 16,
          f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.rope.freq_base": 1e6,
          "tokenizer.ggml.tokens": TOKENS}
  if arch == "gemma3":
    meta[f"{arch}.attention.sliding_window"] = 8
    meta[f"{arch}.attention.scale"] = 0.125
  model = tiny_model(config_from_gguf_metadata(meta)) if arch in ("gemma3", "llama") else None
  if model is not None:
    for name, value in gguf_tensors(model, arch).items():
      if name == bad_shape:
        value = value[:-1]
      w.add_tensor(name, value)
  if extra_tensor:
    w.add_tensor(extra_tensor, np.zeros(4, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return model


def gguf_tensors(model, arch):
  """The model's parameters in llama.cpp's names and conventions."""
  cfg = model.cfg
  n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.embed_dim
  out = {}
  inverse = {v: key for key, v in _LAYERS.items()}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name = ".".join(map(str, path))
    x = np.asarray(var.get_value(), np.float32)
    if name.endswith("norm") and cfg.norm_offset:
      x = x + 1.0
    if name.startswith("layers."):
      i, leaf = name.split(".")[1:]
      if leaf == "q":
        parts = {"q": x.reshape(n * h, d)}
      elif leaf == "kv":
        parts = {"k": x[:, 0].reshape(k * h, d), "v": x[:, 1].reshape(k * h, d)}
      elif leaf == "o":
        parts = {"o": x}
      elif leaf == "gate_up":
        parts = {"gate": x[:, 0], "up": x[:, 1]}
      else:
        parts = {leaf: x}
      for leaf2, y in parts.items():
        if arch == "llama" and leaf2 in ("q", "k"):
          heads = n if leaf2 == "q" else k
          y = y.reshape(heads, 2, y.shape[0] // heads // 2, d).swapaxes(1, 2).reshape(y.shape)  # llama.cpp's permute
        out[f"blk.{i}.{inverse[leaf2]}"] = np.ascontiguousarray(y)
    else:
      out[{"embed": "token_embd.weight", "final_norm": "output_norm.weight", "unembed": "output.weight"}[name]] = x
  return out


_LAYERS = {k: _jaxgen_name(f"blk.0.{k}").split(".")[-1] for k in (
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight",
    "attn_k_norm.weight", "post_attention_norm.weight", "ffn_norm.weight", "post_ffw_norm.weight",
    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")}


def logits(model, ids):
  return np.asarray(model.logits(model(jnp.asarray([ids]), jnp.arange(len(ids))[None])[0]))[0]


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_gguf_round_trip_undoes_llama_cpp_conventions(tmp_path, arch):
  path = tmp_path / f"{arch}.gguf"
  model = write_gguf(path, arch)
  cfg, loaded, tok = load(str(path), "float32")
  assert dataclasses.replace(cfg, norm_eps=1e-6) == model.cfg  # GGUF stores eps as float32
  if arch == "gemma3":
    assert cfg.layer_kinds == ("local",) * 5 + ("global",) and cfg.sliding_window == 8 and cfg.norm_offset == 1.0
  ids = [2, 5, 9, 270, 281, 299, 3, 40, 100, 12, 13]
  np.testing.assert_allclose(logits(loaded, ids), logits(model, ids), atol=1e-5, rtol=1e-5)
  assert tok.encode("ab a", add_special_tokens=True)[0] == 2


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.gguf"):
    load(str(tmp_path / "nope.gguf"))


def test_not_a_gguf_file(tmp_path):
  p = tmp_path / "model.gguf"
  p.write_bytes(b"PK\x03\x04 this is a zip")
  with pytest.raises(ValueError, match=r"model.gguf' is not a GGUF file: it starts with b'PK"):
    load(str(p))


def test_unsupported_architecture(tmp_path):
  p = tmp_path / "mamba.gguf"
  write_gguf(p, arch="mamba")
  with pytest.raises(ValueError, match=r"mamba.gguf'.*general.architecture='mamba' is not supported"):
    load(str(p))


def test_tensor_with_wrong_shape_is_named(tmp_path):
  p = tmp_path / "bad.gguf"
  write_gguf(p, bad_shape="blk.2.ffn_down.weight")
  with pytest.raises(ValueError, match=r"bad.gguf'.*blk.2.ffn_down.weight.*shape \(31, 64\), expected \(32, 64\)"):
    load(str(p))


def test_unknown_tensor_is_named(tmp_path):
  p = tmp_path / "extra.gguf"
  write_gguf(p, extra_tensor="blk.0.mystery.weight")
  with pytest.raises(ValueError, match=r"blk.0.mystery.weight"):
    load(str(p))


def test_metadata_reads_every_field(tmp_path):
  import gguf

  p = tmp_path / "m.gguf"
  write_gguf(p)
  meta = metadata(gguf.GGUFReader(str(p)))
  assert meta["gemma3.attention.sliding_window"] == 8 and meta["tokenizer.ggml.tokens"] == TOKENS
