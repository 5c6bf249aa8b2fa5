"""orbax checkpoints: GGUF -> orbax -> LLM for the embedded model, and restores straight onto a mesh.

One conversion of the embedded Gemma 3 270M is shared by the module (reading the GGUF costs ~20 s).
The mesh checks run in a subprocess with 8 simulated CPU devices (this file is the worker): the
checkpoint written from one device is restored shard by shard onto a 2x4 mesh, and a tiny model
saved from one mesh is restored onto another.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

HF = pathlib.Path(__file__).parent / "data" / "hf"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY_TOKENS = 12


def greedy(engine_or_llm, prompt, tokens=GREEDY_TOKENS) -> list[int]:
  from jaxgen import SamplingParams

  params = SamplingParams(temperature=0, max_tokens=tokens)
  return engine_or_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


# ------------------------------------------------------------------------------ single device
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  from jaxgen.checkpoints.convert import convert
  from jaxgen.checkpoints.source import default_model_path

  dst = tmp_path_factory.mktemp("orbax") / "gemma3-270m"
  return dst, convert(default_model_path(), str(dst), show_progress=False)


@pytest.fixture(scope="module")
def restored(converted):
  from jaxgen import LLM

  return LLM(str(converted[0]), max_len=64, max_batch=1, seed=0)


@pytest.mark.slow
def test_parameters_are_bit_identical_to_the_gguf_load(converted, restored, llm):
  from jaxgen.model.params import flat_params

  dst, summary = converted
  want, got = flat_params(llm.model), flat_params(restored.model)
  assert want.keys() == got.keys()
  for name in want:
    assert got[name].dtype == want[name].dtype, name
    assert np.array_equal(np.asarray(got[name]), np.asarray(want[name])), name
  assert restored.cfg == llm.cfg
  assert summary.kind == "gguf" and summary.dtype == "float32"
  assert summary.num_params == sum(int(np.prod(x.shape)) for x in want.values())
  assert summary.num_bytes == 4 * summary.num_params


@pytest.mark.slow
def test_tokenizer_survives_the_round_trip(restored, llm):
  a, b = llm.tokenizer, restored.tokenizer
  for attr in ("vocab_size", "bos_id", "eos_id", "pad_id", "unk_id", "add_bos", "add_eos", "stop_ids",
               "chat_template"):
    assert getattr(a, attr) == getattr(b, attr), attr
  for text in ["Hello, world!", "  two  spaces\tand a tab\n", "<start_of_turn>user\nhé 🙂<end_of_turn>", "12345"]:
    assert a.encode(text) == b.encode(text)
    assert a.decode(a.encode(text)) == b.decode(b.encode(text))


@pytest.mark.slow
def test_greedy_tokens_are_identical(restored, llm):
  for prompt in PROMPTS:
    assert greedy(restored, prompt) == greedy(llm, prompt)


@pytest.mark.slow
def test_chat_on_the_embedded_base_model_uses_gemma_turns(restored):
  from jaxgen import SamplingParams

  messages = [{"role": "user", "content": "Name a colour."}]
  with pytest.warns(UserWarning, match="no chat template; using Gemma's turn format"):
    out = restored.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
  want = restored.tokenizer.encode("<bos><start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n",
                                   add_special_tokens=False)
  assert out.prompt_token_ids == want
  assert want[0] == restored.tokenizer.bos_id and want.count(restored.tokenizer.bos_id) == 1


# ------------------------------------------------------------------------------- bad input
def tiny_checkpoint(path: pathlib.Path):
  """A tiny random model saved as an orbax checkpoint (for tests that edit the files)."""
  from jaxgen.checkpoints.orbax_io import save
  from jaxgen.checkpoints.source import load

  _, model, tok = load(str(HF / "qwen3"), "float32", place=lambda name, x: x)
  save(str(path), model, tok)
  return model


def edit_metadata(path: pathlib.Path, **changes):
  file = path / "jaxgen" / "metadata"
  meta = json.loads(file.read_text())
  for key, value in changes.items():
    if key.startswith("config."):
      meta["config"][key[7:]] = value
    else:
      meta[key] = value
  file.write_text(json.dumps(meta))


def test_newer_format_version_is_refused(tmp_path):
  from jaxgen.checkpoints.orbax_io import FORMAT_VERSION
  from jaxgen.checkpoints.source import load

  ckpt = tmp_path / "ckpt"
  tiny_checkpoint(ckpt)
  load(str(ckpt))  # readable as written
  edit_metadata(ckpt, format_version=FORMAT_VERSION + 1)
  with pytest.raises(ValueError, match=rf"ckpt.*format version {FORMAT_VERSION + 1}.*up to {FORMAT_VERSION}; upgrade"):
    load(str(ckpt))


def test_checkpoint_that_lacks_a_tensor_names_it(tmp_path):
  from jaxgen.checkpoints.source import load

  ckpt = tmp_path / "ckpt"
  tiny_checkpoint(ckpt)
  edit_metadata(ckpt, **{"config.num_layers": 3, "config.layer_kinds": ["global"] * 3})
  with pytest.raises(ValueError, match=r"no tensor layers\.2\."):
    load(str(ckpt))
  edit_metadata(ckpt, **{"config.num_layers": 2, "config.layer_kinds": ["global"] * 2, "config.mlp_dim": 96})
  with pytest.raises(ValueError, match=r"tensor layers\.0\.down has shape \(64, 128\), expected \(64, 96\)"):
    load(str(ckpt))


def test_convert_never_overwrites_and_leaves_nothing_on_failure(tmp_path):
  from jaxgen.checkpoints.convert import convert

  dst = tmp_path / "out"
  dst.mkdir()
  with pytest.raises(FileExistsError, match="already exists"):
    convert(str(HF / "qwen3"), str(dst), show_progress=False)
  assert os.listdir(dst) == []
  broken = tmp_path / "broken"
  shutil.copytree(HF / "qwen3", broken)
  (broken / "config.json").write_text(json.dumps(dict(json.loads((broken / "config.json").read_text()),
                                                      model_type="falcon")))
  with pytest.raises(ValueError, match="model_type='falcon'"):
    convert(str(broken), str(tmp_path / "out2"), show_progress=False)
  assert sorted(os.listdir(tmp_path)) == ["broken", "out"]


@pytest.mark.parametrize("where", ["save", "rename"])
def test_a_failure_while_writing_leaves_nothing_half_written(tmp_path, monkeypatch, where):
  """A crash in the middle of orbax's save (after some files are written) or in the final rename
  leaves neither DST nor the temporary directory behind."""
  from jaxgen.checkpoints import convert as convert_mod
  from jaxgen.checkpoints import orbax_io

  real_save = orbax_io.save

  def save_then_fail(path, *args, **kw):
    real_save(path, *args, **kw)
    assert os.listdir(path), "the injected failure should come after files were written"
    raise OSError("disk full (injected)")

  real_rename = os.rename

  def rename_fails(src, dst):
    if os.path.abspath(dst) == str(tmp_path / "out"):  # only convert's final rename, not orbax's own
      raise OSError("rename failed (injected)")
    return real_rename(src, dst)

  if where == "save":
    monkeypatch.setattr(orbax_io, "save", save_then_fail)
  else:
    monkeypatch.setattr(convert_mod.os, "rename", rename_fails)
  with pytest.raises(OSError, match="injected"):
    convert_mod.convert(str(HF / "qwen3"), str(tmp_path / "out"), show_progress=False)
  assert os.listdir(tmp_path) == []


def test_cli_convert_prints_a_summary(tmp_path, capsys):
  from jaxgen.cli import main

  assert main(["convert", str(HF / "qwen2"), str(tmp_path / "q"), "--dtype", "bfloat16", "--quiet"]) == 0
  out = capsys.readouterr().out
  assert "parameters" in out and "bfloat16" in out and " s" in out
  assert main(["convert", str(HF / "qwen2"), str(tmp_path / "q"), "--quiet"]) == 2
  assert "already exists" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- the mesh
def run_worker(*args: str, timeout: int) -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=timeout)
  if proc.returncode != 0:
    raise AssertionError(f"worker failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_restore_onto_an_8_device_mesh(converted, llm, tmp_path):
  from jaxgen.model.params import flat_params

  got = run_worker(str(converted[0]), str(tmp_path), timeout=400)
  assert got["devices"] == 8
  assert got["layout_mismatches"] == [] and got["checked"] == len(flat_params(llm.model))
  assert got["sharded_over_model"] > 0  # not everything replicated
  # The layouts the rules (sharding/rules.py, docs/sharding.md) give Gemma 3 270M (N=4 heads,
  # K=1 kv head) on data=2 x model=4, written out by hand: heads, mlp and vocab split over
  # `model`; a single kv head, `embed` and `head_dim` replicated.
  m = "model"
  assert got["specs"] == {
      "embed": [m, None],  # [V, D]: split by vocabulary
      "layers.0.q": [m, None, None],  # [N, H, D]: column-parallel, whole heads
      "layers.0.kv": [None, None, None, None],  # [K, 2, H, D]: K=1 does not divide 4, replicated
      "layers.0.o": [None, m],  # [D, N*H]: row-parallel
      "layers.0.gate_up": [m, None, None],  # [F, 2, D]: column-parallel
      "layers.0.down": [None, m],  # [D, F]: row-parallel
      "layers.0.attn_norm": [None],
      "layers.0.k_norm": [None],  # [H]
      "final_norm": [None],
  }
  assert got["digests"] == digests(flat_params(llm.model))  # bit-identical to the GGUF load
  assert got["greedy"] == greedy(llm, PROMPTS[0])
  # a tiny model saved from a 2x4 mesh, restored onto 4x2 and 8x1
  for mesh in ("4x2", "8x1"):
    assert got["resave"][mesh]["layout_mismatches"] == []
    assert got["resave"][mesh]["value_mismatches"] == []
    assert got["resave"][mesh]["logits_max_abs_diff"] <= 1e-4


def digests(params) -> dict[str, str]:
  """A SHA-256 of every parameter's bytes (gathered to the host)."""
  return {name: hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest() for name, x in params.items()}


def _worker(ckpt: str, tmp: str) -> dict:
  import jax
  from jaxgen import SamplingParams
  from jaxgen.checkpoints.orbax_io import restore, save
  from jaxgen.checkpoints.source import load
  from jaxgen.decode.engine import Engine
  from jaxgen.model.params import flat_params
  from jaxgen.sharding.mesh import MeshConfig, as_mesh
  from jaxgen.sharding.rules import param_shardings

  def layout(model, mesh):
    want = param_shardings(model.cfg, "float32", mesh)
    bad, over_model = [], 0
    for name, x in flat_params(model).items():
      shard = want[name].shard_shape(x.shape)
      if not x.sharding.is_equivalent_to(want[name], x.ndim) or any(s.data.shape != shard for s in x.addressable_shards):
        bad.append(f"{name}: {x.sharding} vs {want[name]}")
      over_model += "model" in jax.tree.leaves(tuple(want[name].spec))
    return bad, over_model, len(want)

  def mismatches(a, b):
    return [k for k in a if not np.array_equal(np.asarray(a[k]), np.asarray(b[k]))]

  out = {"devices": jax.device_count()}
  mesh = as_mesh(MeshConfig(data=2, model=4))
  cfg, model, tok = restore(ckpt, shardings=functools.partial(param_shardings, mesh=mesh))
  out["layout_mismatches"], out["sharded_over_model"], out["checked"] = layout(model, mesh)
  named = ("embed", "layers.0.q", "layers.0.kv", "layers.0.o", "layers.0.gate_up", "layers.0.down",
           "layers.0.attn_norm", "layers.0.k_norm", "final_norm")
  params = flat_params(model)
  out["specs"] = {name: [*params[name].sharding.spec] + [None] * (params[name].ndim - len(params[name].sharding.spec))
                  for name in named}
  out["digests"] = digests(flat_params(model))
  engine = Engine(model, tok, max_batch=2, max_len=64, mesh=mesh)  # laid out by the rules table
  rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS))
  while engine.has_unfinished():
    for o in engine.step():
      if o.request_id == rid and o.finished:
        out["greedy"] = o.outputs[0].token_ids
  del model, engine

  # A tiny model: HF -> sharded on 2x4 -> orbax -> `load` onto 4x2 and 8x1.
  golden = np.load(HF / "qwen3.npz")
  _, tiny, tiny_tok = load(str(HF / "qwen3"), mesh=mesh)
  save(os.path.join(tmp, "tiny"), tiny, tiny_tok)
  out["resave"] = {}
  for data, model_axis in ((4, 2), (8, 1)):
    other = as_mesh(MeshConfig(data=data, model=model_axis))
    _, back, _ = load(os.path.join(tmp, "tiny"), mesh=other)
    ids = golden["ids_0"][None]
    positions = np.arange(ids.shape[1])[None]
    logits = np.asarray(back.logits(back(ids, positions)[0]))[0]
    out["resave"][f"{data}x{model_axis}"] = dict(
        layout_mismatches=layout(back, other)[0], value_mismatches=mismatches(flat_params(back), flat_params(tiny)),
        logits_max_abs_diff=float(np.abs(logits - golden["logits_0"]).max()))
  return out


if __name__ == "__main__":
  print(json.dumps(_worker(*sys.argv[1:])))
