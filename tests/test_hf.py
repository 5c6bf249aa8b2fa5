"""Hugging Face directories: tiny random Llama, Qwen2, Qwen3, Mistral, Gemma 3 and Gemma 2 models against transformers.

The fixtures under tests/data/hf/ were written by tools/make_hf_fixtures.py: each model directory
(config.json, safetensors, tokenizer files, chat template) with transformers' float32 logits for
three prompts, the prompt ids, and `apply_chat_template` renderings. No torch is needed here.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import shutil

import numpy as np
import pytest
from jaxgen import LLM, SamplingParams
from jaxgen.checkpoints.chat import chat_format
from jaxgen.checkpoints.convert import convert
from jaxgen.checkpoints.hf import config_from_hf, read_hf
from jaxgen.checkpoints.hf_tokenizer import tokenizer_from_hf_dir
from jaxgen.checkpoints.source import load
from jaxgen.model.params import flat_params
from safetensors.numpy import load_file, save_file

HF = pathlib.Path(__file__).parent / "data" / "hf"
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "gemma2"]
LOGITS_ATOL = 1e-4


def golden(name: str) -> tuple[dict, dict]:
  record = json.loads((HF / f"{name}.json").read_text(encoding="utf-8"))
  arrays = dict(np.load(HF / f"{name}.npz"))
  return record, arrays


@functools.cache
def llm_for(name: str) -> LLM:
  return LLM(str(HF / name), max_len=128, max_batch=1, seed=0)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
  name = request.param
  record, arrays = golden(name)
  return name, llm_for(name), record, arrays


def copy_model(name: str, tmp_path: pathlib.Path) -> pathlib.Path:
  dst = tmp_path / name
  shutil.copytree(HF / name, dst)
  return dst


# ------------------------------------------------------------------------------- numerics, ids
def test_logits_match_transformers(family):
  name, llm, record, arrays = family
  for i in range(len(record["prompts"])):
    ids = arrays[f"ids_{i}"]
    got = llm.logits(ids.tolist())
    np.testing.assert_allclose(got, arrays[f"logits_{i}"], atol=LOGITS_ATOL, rtol=0,
                               err_msg=f"{name} prompt {i}")


def test_tokenizer_matches_transformers(family):
  name, llm, record, _ = family
  for p in record["prompts"]:
    ids = llm.tokenizer.encode(p["text"])
    assert ids == p["ids"], name
    assert llm.tokenizer.decode(ids, skip_special_tokens=True) == p["decoded"]


def test_chat_template_renders_as_transformers(family):
  name, llm, record, _ = family
  fmt = chat_format(llm.tokenizer)
  assert not fmt.fallback
  for chat in record["chats"]:
    text = fmt.render(chat["messages"], add_generation_prompt=chat["add_generation_prompt"])
    assert text == chat["text"], name
    assert fmt.encode(llm.tokenizer, chat["messages"], chat["add_generation_prompt"]) == chat["ids"]


@pytest.mark.parametrize("name", ["llama", "mistral"])  # an end-of-turn token that is not EOS, and EOS
def test_chat_stops_on_the_end_of_turn_token(name):
  llm, (record, _) = llm_for(name), golden(name)
  conv = record["chats"][0]["messages"]
  fmt = chat_format(llm.tokenizer)
  end = {"llama": "<|eot_id|>", "qwen2": "<|im_end|>", "qwen3": "<|im_end|>", "mistral": "</s>",
         "gemma3": "<end_of_turn>", "gemma2": "<end_of_turn>"}[name]
  end_id = llm.tokenizer.token_to_id(end)
  assert end_id in fmt.stop_ids
  # Make the end-of-turn token the greedy choice after two tokens: the reply must stop there.
  forced = SamplingParams(temperature=0, max_tokens=10, min_tokens=2, logit_bias={end_id: 100.0})
  out = llm.chat(conv, forced, use_tqdm=False)[0]
  assert out.prompt_token_ids == record["chats"][0]["ids"]
  assert out.outputs[0].finish_reason == "stop"
  assert len(out.outputs[0].token_ids) <= 3


def test_generation_config_eos_ids_stop(family):
  name, llm, _, _ = family
  eos = json.loads((HF / name / "generation_config.json").read_text())["eos_token_id"]
  assert set(eos if isinstance(eos, list) else [eos]) <= llm.tokenizer.stop_ids


def test_sharded_safetensors_with_index_is_read():
  assert (HF / "llama" / "model.safetensors.index.json").is_file()
  assert len(list((HF / "llama").glob("model-*.safetensors"))) > 1
  cfg, arrays = read_hf(str(HF / "llama"))
  assert cfg.rope_llama3 == (8.0, 1.0, 4.0, 64) and not cfg.tie_embeddings
  assert "unembed" in arrays


def test_bfloat16_safetensors_keep_their_dtype():
  cfg, arrays = read_hf(str(HF / "qwen2"))
  assert cfg.qkv_bias
  assert arrays["layers.0.q_bias"].dtype.name == "bfloat16"


# ----------------------------------------------------------------------- config translations
def test_gemma3_multimodal_layout_reads_the_language_model(tmp_path):
  """model_type gemma3: config under text_config, tensors under model.language_model., vision tower ignored."""
  src, dst = HF / "gemma3", tmp_path / "gemma3mm"
  shutil.copytree(src, dst)
  tensors = load_file(str(src / "model.safetensors"))
  renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
  renamed["model.vision_tower.patch_embedding.weight"] = np.zeros((4, 4), np.float32)
  save_file(renamed, str(dst / "model.safetensors"))
  text = json.loads((src / "config.json").read_text())
  (dst / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
  _, arrays = golden("gemma3")
  llm = LLM(str(dst), max_len=64, max_batch=1, seed=0)
  assert llm.cfg == config_from_hf(text)
  np.testing.assert_allclose(llm.logits(arrays["ids_0"].tolist()), arrays["logits_0"], atol=LOGITS_ATOL, rtol=0)


def test_transformers4_config_layout_gives_the_same_config():
  """Hub configs written by transformers 4 use rope_theta/rope_scaling, sliding_window_pattern, ..."""
  llama = json.loads((HF / "llama" / "config.json").read_text())
  rope = dict(llama["rope_parameters"])
  v4 = {k: v for k, v in llama.items() if k != "rope_parameters"}
  v4.update(rope_theta=rope.pop("rope_theta"), rope_scaling=dict(rope, type=rope.pop("rope_type")))
  assert config_from_hf(v4) == config_from_hf(llama)

  gemma = json.loads((HF / "gemma3" / "config.json").read_text())
  gemma_v4 = {k: v for k, v in gemma.items() if k != "rope_parameters"}
  gemma_v4.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                  rope_scaling={"rope_type": "linear", "factor": 4.0})
  assert config_from_hf(gemma_v4) == config_from_hf(gemma)
  pattern = config_from_hf({k: v for k, v in gemma_v4.items() if k != "layer_types"} |
                           {"num_hidden_layers": 12, "sliding_window_pattern": 6})
  assert pattern.layer_kinds == ("local",) * 5 + ("global",) + ("local",) * 5 + ("global",)

  qwen = json.loads((HF / "qwen2" / "config.json").read_text())
  qwen_v4 = {k: v for k, v in qwen.items() if k != "layer_types"} | {"sliding_window": 32768, "use_sliding_window": False}
  assert config_from_hf(qwen_v4) == config_from_hf(qwen)
  windowed = config_from_hf(qwen_v4 | {"use_sliding_window": True, "max_window_layers": 1})
  assert windowed.layer_kinds == ("global", "local") and windowed.sliding_window == 32768


def test_mistral_window_applies_to_every_layer():
  cfg = config_from_hf(json.loads((HF / "mistral" / "config.json").read_text()))
  assert cfg.layer_kinds == ("local", "local") and cfg.sliding_window == 8
  assert cfg.rope_base_local == cfg.rope_base


# ------------------------------------------------------------------------------- conversion
def test_convert_hf_to_orbax_round_trip(tmp_path):
  dst = tmp_path / "qwen3.orbax"
  summary = convert(str(HF / "qwen3"), str(dst), dtype="bfloat16", show_progress=False)
  assert summary.kind == "hf" and summary.dtype == "bfloat16" and summary.num_bytes == 2 * summary.num_params
  assert "parameters" in str(summary)
  _, hf_model, hf_tok = load(str(HF / "qwen3"), dtype="bfloat16")
  cfg, model, tok = load(str(dst), dtype="bfloat16")
  assert cfg == hf_model.cfg
  a, b = flat_params(hf_model), flat_params(model)
  assert a.keys() == b.keys()
  for k in a:
    assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
  assert tok.chat_template == hf_tok.chat_template and tok.stop_ids == hf_tok.stop_ids
  assert tok.encode("Hello there, 3.14!") == hf_tok.encode("Hello there, 3.14!")


# ------------------------------------------------------------------------------- bad input
def assert_nothing_written(tmp_path: pathlib.Path, before: set[str], dst: pathlib.Path):
  assert not dst.exists()
  assert set(os.listdir(tmp_path)) == before, "a temporary directory was left behind"


def test_missing_directory_is_an_error_that_says_so(tmp_path):
  missing = tmp_path / "no-such-model"
  with pytest.raises(FileNotFoundError, match="no-such-model.*does not exist.*never downloads"):
    load(str(missing))
  with pytest.raises(FileNotFoundError, match="no-such-model"):
    convert(str(missing), str(tmp_path / "out"), show_progress=False)
  assert not (tmp_path / "out").exists()


def test_truncated_safetensors_names_the_file(tmp_path):
  src = copy_model("qwen3", tmp_path)
  file = src / "model.safetensors"
  data = file.read_bytes()
  file.write_bytes(data[: len(data) // 2])
  before = set(os.listdir(tmp_path))
  with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
    read_hf(str(src))
  dst = tmp_path / "out.orbax"
  with pytest.raises(ValueError, match="truncated"):
    convert(str(src), str(dst), show_progress=False)
  assert_nothing_written(tmp_path, before, dst)


def test_missing_tensor_is_named(tmp_path):
  src = copy_model("mistral", tmp_path)
  tensors = load_file(str(src / "model.safetensors"))
  del tensors["model.layers.1.mlp.down_proj.weight"]
  save_file(tensors, str(src / "model.safetensors"))
  with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.mlp\.down_proj\.weight"):
    load(str(src))


def test_missing_shard_is_named(tmp_path):
  src = copy_model("llama", tmp_path)
  (src / "model-00002-of-00005.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match=r"model-00002-of-00005\.safetensors.*missing"):
    load(str(src))


@pytest.mark.parametrize("tensor,shape", [("model.layers.0.self_attn.k_proj.weight", (32, 64)),
                                          ("model.layers.1.post_feedforward_layernorm.weight", (63,)),
                                          ("model.embed_tokens.weight", (10, 64))])
def test_tensor_of_the_wrong_shape_is_named(tmp_path, tensor, shape):
  src = copy_model("gemma3", tmp_path)
  tensors = load_file(str(src / "model.safetensors"))
  tensors[tensor] = np.zeros(shape, tensors[tensor].dtype)
  save_file(tensors, str(src / "model.safetensors"))
  before = set(os.listdir(tmp_path))
  with pytest.raises(ValueError, match=re.escape(f"tensor {tensor} (in model.safetensors) has shape {shape}")):
    load(str(src))
  dst = tmp_path / "out.orbax"
  with pytest.raises(ValueError, match="has shape"):
    convert(str(src), str(dst), show_progress=False)
  assert_nothing_written(tmp_path, before, dst)


def test_unsupported_model_type_is_named(tmp_path):
  src = copy_model("llama", tmp_path)
  cfg = json.loads((src / "config.json").read_text())
  (src / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt_neox")))
  with pytest.raises(ValueError, match=r"config\.json.*model_type='gpt_neox' is not supported; supported: "):
    load(str(src))


def test_unsupported_rope_type_is_named():
  cfg = json.loads((HF / "llama" / "config.json").read_text())
  cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
  with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
    config_from_hf(cfg)


def test_hf_tokenizer_requires_tokenizer_json(tmp_path):
  src = copy_model("qwen2", tmp_path)
  (src / "tokenizer.json").unlink()
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    tokenizer_from_hf_dir(str(src))


def test_cached_greedy_equals_uncached_when_every_layer_has_a_window():
  """Mistral: all layers are sliding-window rings; decoding goes on past the window."""
  _, arrays = golden("mistral")
  llm = llm_for("mistral")
  prompt = arrays["ids_0"][:12].tolist()
  out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
  assert len(out.token_ids) == 20
  # Teacher-forced uncached forward: every generated token is the argmax after its prefix.
  logits = llm.logits(prompt + out.token_ids[:-1])
  assert out.token_ids == np.argmax(logits[len(prompt) - 1:], axis=-1).tolist()


def test_cli_chat_streams_replies_and_keeps_the_conversation(monkeypatch, capsys):
  """Each turn's prompt is the whole conversation so far rendered by the template; /reset starts over."""
  from jaxgen.cli import main

  record, _ = golden("qwen3")
  system, user, _, _ = record["chats"][0]["messages"]
  prompts = []

  def fake_stream(self, prompt, params):
    prompts.append((list(prompt), params))
    yield "Par"
    yield "is."

  lines = iter([user["content"], "Again?", "/reset", user["content"], "/exit"])
  monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
  monkeypatch.setattr(LLM, "stream", fake_stream)
  assert main(["chat", "--model", str(HF / "qwen3"), "--max-len", "128", "--system", system["content"]]) == 0
  out, err = capsys.readouterr()
  assert out.count("Paris.\n") == 3 and "/reset starts over" in err
  fmt = chat_format(llm_for("qwen3").tokenizer)
  tok = llm_for("qwen3").tokenizer
  first = [system, user]
  second = first + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Again?"}]
  assert [p for p, _ in prompts] == [fmt.encode(tok, first), fmt.encode(tok, second), fmt.encode(tok, first)]
  assert tok.token_to_id("<|im_end|>") in prompts[0][1].stop_token_ids


def test_explicit_layer_types_are_followed():
  """A config's own layer_types list wins over the family's default pattern."""
  gemma = json.loads((HF / "gemma3" / "config.json").read_text())
  kinds = ["sliding_attention", "full_attention", "sliding_attention"]
  cfg = config_from_hf(gemma | {"num_hidden_layers": 3, "layer_types": kinds})
  assert cfg.layer_kinds == ("local", "global", "local")
