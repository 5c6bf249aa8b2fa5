"""GGUF reading: tiny models of every supported family, written as llama.cpp writes them, give
transformers' logits and the models' own token ids; what GGUF cannot state is refused; bad files
are refused with errors that name the file or tensor."""

import dataclasses
import functools
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx
from jaxgen import LLM
from jaxgen.checkpoints.gguf import (
  _jaxgen_name,
  config_from_gguf_metadata,
  metadata,
  open_reader,
)
from jaxgen.checkpoints.source import load
from jaxgen.checkpoints.tokenizer import tokenizer_from_gguf

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


# --------------------------------------------------------------- real models, against transformers
# tests/data/gguf/ holds the tiny HF fixtures (tests/data/hf/) written as llama.cpp's converter writes
# them (tools/make_hf_fixtures.py). An F32 file holds the same float32 weights, so jaxgen reading it
# must give transformers' logits on the safetensors; a Q8_0 file's reference is transformers reading
# that same GGUF (its own dequantization and un-permutation) with the true config.
DATA = pathlib.Path(__file__).parent / "data"
GGUF_FILES = sorted(p.name for p in (DATA / "gguf").glob("*.gguf"))
ATOL = 1e-4


@functools.cache
def gguf_llm(name: str) -> LLM:
  return LLM(str(DATA / "gguf" / name), max_len=128, max_batch=1, seed=0)


def reference(name: str) -> tuple[dict, dict]:
  family, qtype = name.split(".")[:2]
  record = json.loads((DATA / "hf" / f"{family}.json").read_text(encoding="utf-8"))
  npz = DATA / "hf" / f"{family}.npz" if qtype == "f32" else DATA / "gguf" / f"{family}.{qtype}.npz"
  return record, dict(np.load(npz))


def test_every_family_has_a_gguf_file():
  assert {n.split(".")[0] for n in GGUF_FILES} == {"llama", "qwen2", "qwen3", "mistral", "gemma3", "gemma2"}
  assert {n.split(".")[1] for n in GGUF_FILES} == {"f32", "q8_0"}


@pytest.mark.parametrize("name", GGUF_FILES)
def test_gguf_logits_match_transformers(name):
  llm = gguf_llm(name)
  record, arrays = reference(name)
  for i in range(len(record["prompts"])):
    ids = arrays[f"ids_{i}"].tolist()
    np.testing.assert_allclose(llm.logits(ids), arrays[f"logits_{i}"], atol=ATOL, rtol=0, err_msg=f"{name} prompt {i}")


@pytest.mark.parametrize("name", [n for n in GGUF_FILES if ".f32." in n])
def test_gguf_tokenizer_matches_the_models_own(name):
  """Byte-level (Llama 3's and Qwen's word splits) and SentencePiece vocabularies read from GGUF
  metadata give the ids of the model's tokenizer.json, and decode back."""
  tok = gguf_llm(name).tokenizer
  record, _ = reference(name)
  for p in record["prompts"]:
    assert tok.encode(p["text"]) == p["ids"], name
    assert tok.decode(p["ids"], skip_special_tokens=True) == p["decoded"]


def test_llama3_rope_freqs_tensor_is_applied():
  """Without the rope_freqs divisors the same file computes measurably different logits: the
  logits test above would catch a loader that dropped them."""
  llm = gguf_llm("llama.f32.gguf")
  assert llm.cfg.rope_factors is not None and max(llm.cfg.rope_factors) == 8.0
  _, arrays = reference("llama.f32.gguf")
  cfg, model, _ = load(str(DATA / "gguf" / "llama.f32.gguf"), "float32")
  unscaled = nnx.merge(nnx.graphdef(tiny_model(dataclasses.replace(cfg, rope_factors=None))), nnx.state(model))
  ids = arrays["ids_1"].tolist()
  np.testing.assert_allclose(logits(model, ids), arrays["logits_1"], atol=ATOL, rtol=0)
  assert np.abs(logits(unscaled, ids) - arrays["logits_1"]).max() > 10 * ATOL


def test_mistral_window_from_gguf_metadata_applies_to_every_layer():
  assert gguf_llm("mistral.f32.gguf").cfg.layer_kinds == ("local", "local")


def _gemma_meta(arch: str, layers: int, d: int, **extra) -> dict:
  return {"general.architecture": arch, f"{arch}.context_length": 256, f"{arch}.embedding_length": d,
          f"{arch}.block_count": layers, f"{arch}.feed_forward_length": 4 * d, f"{arch}.attention.head_count": 32,
          f"{arch}.attention.head_count_kv": 16, f"{arch}.attention.key_length": 128,
          f"{arch}.attention.sliding_window": 4096, "tokenizer.ggml.tokens": ["a"] * 8, **extra}


@pytest.mark.parametrize("arch,layers,d,scalar", [("gemma2", 46, 4608, 144), ("gemma3", 62, 5376, 168),
                                                  ("gemma3", 18, 640, 256)])
def test_gemma_query_scale_of_published_sizes(arch, layers, d, scalar):
  assert config_from_gguf_metadata(_gemma_meta(arch, layers, d)).query_scale == pytest.approx(scalar ** -0.5)


def test_gemma_of_unknown_size_without_scale_is_refused():
  with pytest.raises(ValueError, match=r"query scale of a gemma3 model with 20 layers of 1000 cannot be determined"):
    config_from_gguf_metadata(_gemma_meta("gemma3", 20, 1000))
  meta = _gemma_meta("gemma3", 20, 1000, **{"gemma3.attention.scale": 0.1})
  assert config_from_gguf_metadata(meta).query_scale == pytest.approx(0.1)


def test_rope_scaling_jaxgen_does_not_implement_is_refused():
  meta = _gemma_meta("gemma3", 18, 640, **{"gemma3.rope.scaling.type": "yarn", "gemma3.rope.scaling.factor": 4.0})
  with pytest.raises(ValueError, match=r"rope.scaling.type='yarn' is not implemented"):
    config_from_gguf_metadata(meta)


def test_unknown_byte_level_pre_tokenizer_is_refused(tmp_path):
  import gguf

  src = gguf.GGUFReader(str(DATA / "gguf" / "qwen3.f32.gguf"))
  fields = {k: f.contents() for k, f in src.fields.items() if not k.startswith("GGUF.")}
  fields["tokenizer.ggml.pre"] = "some-new-model"
  with pytest.raises(ValueError, match=r"tokenizer.ggml.pre = 'some-new-model'"):
    tokenizer_from_gguf(_FakeReader(fields))


class _FakeReader:
  """Just enough of GGUFReader for tokenizer_from_gguf: fields with .contents()."""

  class _Field:
    def __init__(self, value):
      self.value = value

    def contents(self):
      return self.value

  def __init__(self, fields):
    self.fields = {k: self._Field(v) for k, v in fields.items()}


def logits(model, ids):
  return np.asarray(model.logits(model(jnp.asarray([ids]), jnp.arange(len(ids))[None])[0]))[0]


# --------------------------------------------------------------- malformed files are refused by name
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


@pytest.mark.parametrize("name", [n for n in GGUF_FILES if ".q8_0." in n])
def test_q8_0_weights_load_as_stored_into_int8_blocks(name):
  """quantization="int8" takes a Q8_0 file's blocks as they are: every int8 weight times its
  scale equals gguf's own dequantization of the tensor exactly, so the logits of the plain
  formulation are transformers' on the same file. The CPU kernel rounds activations to two int8
  parts per group (test_cpu_kernels.py bounds that per dot); through a whole model it stays
  within 2e-3 of them."""
  import gguf

  llm = LLM(str(DATA / "gguf" / name), max_len=128, max_batch=1, seed=0, quantization="int8", matmul_impl="xla")
  fast = LLM(str(DATA / "gguf" / name), max_len=128, max_batch=1, seed=0, quantization="int8")
  reader = gguf.GGUFReader(str(DATA / "gguf" / name))
  t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
  want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
  layer = llm.model.layers[1]
  assert layer.down[...].dtype == jnp.int8
  got = np.asarray(layer.down[...], np.float32).reshape(*want.shape[:-1], -1, 32) * np.asarray(layer.down_scale[...])[..., None]
  np.testing.assert_array_equal(got.reshape(want.shape), want)
  record, arrays = reference(name)
  for i in range(len(record["prompts"])):
    ids = arrays[f"ids_{i}"].tolist()
    np.testing.assert_allclose(llm.logits(ids), arrays[f"logits_{i}"], atol=ATOL, rtol=0, err_msg=f"{name} prompt {i}")
    np.testing.assert_allclose(fast.logits(ids), arrays[f"logits_{i}"], atol=2e-3, rtol=0, err_msg=f"{name} prompt {i}")


def test_a_pair_fused_from_mixed_types_is_dequantized_together():
  """k as Q8_0 blocks beside v in another type (llama.cpp mixes types): k is dequantized so the
  fused kv is one float array."""
  from jaxgen.checkpoints.gguf import _same_kind_in_pairs
  from jaxgen.model import quant

  k = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
  values, scale = quant.quantize_np(k)
  out = _same_kind_in_pairs({"layers.0.k": values, "layers.0.k_scale": scale, "layers.0.v": k}, 1)
  assert "layers.0.k_scale" not in out and out["layers.0.k"].dtype == np.float32
  np.testing.assert_array_equal(out["layers.0.k"], np.asarray(quant.dequantize(values, scale, np.float32)))


@pytest.mark.parametrize("name", ["gemma3.f32.gguf", "qwen3.q8_0.gguf"])
def test_the_fast_reader_reads_what_ggufs_own_reader_reads(name):
  """`open_reader` reads through a plain view of the memory map (np.memmap's per-slice cost made the
  embedded model's 262k-token metadata take 10 s); fields and tensors must be gguf's own."""
  import gguf

  path = str(DATA / "gguf" / name)
  fast, ref = open_reader(path), gguf.GGUFReader(path)
  assert type(fast.data) is np.ndarray and type(ref.data) is np.memmap
  assert list(fast.fields) == list(ref.fields) and len(fast.fields) > 10
  for key in ref.fields:
    assert repr(fast.fields[key].contents()) == repr(ref.fields[key].contents()), key
  assert [(t.name, t.tensor_type, t.shape.tolist()) for t in fast.tensors] == \
         [(t.name, t.tensor_type, t.shape.tolist()) for t in ref.tensors]
  assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, ref.tensors))
