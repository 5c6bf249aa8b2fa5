"""The converted-weights cache (`checkpoints.cache`): a second load reads what the first wrote,
bit for bit, without touching the source; misses, damage and an unwritable cache never fail a load."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from jaxgen.checkpoints import cache, source
from jaxgen.model import platform
from jaxgen.model.params import flat_params
from tokenizers import Tokenizer as Backend

GGUF = pathlib.Path(__file__).parent / "data" / "gguf" / "gemma3.f32.gguf"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXGEN_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.delenv("JAXGEN_WEIGHT_CACHE", raising=False)
  return tmp_path / "cache"


def entries(cache_dir) -> list[str]:
  d = cache_dir / "weights"
  return sorted(p.name for p in d.iterdir() if not p.name.startswith(".tmp-")) if d.exists() else []


def load(path, dtype="float32", quantization=None):
  timings = {}
  cfg, model, tokenizer = source.load(str(path), dtype, quantization=quantization, timings=timings)
  cache.wait()  # a miss writes its entry on a thread
  return cfg, {k: np.asarray(v) for k, v in flat_params(model).items()}, tokenizer, timings


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("float32", "int8")])
def test_a_second_load_reads_the_cache_bit_for_bit_without_the_source(cache_dir, monkeypatch, dtype, quantization):
  cfg, first, tok, t1 = load(GGUF, dtype, quantization)
  assert t1["weight_cache"].startswith("miss (writing") and len(entries(cache_dir)) == 1

  def unread(*_, **__):
    raise AssertionError("the source was read despite a cache entry")

  monkeypatch.setattr(source, "read_arrays", unread)
  cfg2, second, tok2, t2 = load(GGUF, dtype, quantization)
  assert t2["weight_cache"] == "hit" and cfg2 == cfg
  assert sorted(first) == sorted(second)
  for k in first:
    assert first[k].dtype == second[k].dtype and np.array_equal(first[k], second[k]), k
  text = "Hello, world! <start_of_turn>"
  assert tok2.encode(text) == tok.encode(text) and tok2.stop_ids == tok.stop_ids
  assert tok2.chat_template == tok.chat_template
  # Merges are written in the spelling that parses faster ("left right").
  (entry,) = entries(cache_dir)
  merges = json.loads((cache_dir / "weights" / entry / "tokenizer.json").read_text())["model"]["merges"]
  assert merges and all(isinstance(m, str) and len(m.split(" ")) == 2 for m in merges)


def test_a_hit_parses_its_tokenizer_when_asked_and_a_damaged_one_is_read_from_the_source(cache_dir, monkeypatch,
                                                                                         caplog):
  """`source.load(defer_tokenizer=True)` returns the tokenizer as a function: on a hit the cached
  file is parsed when it is called (an `LLM` has the first decode program load meanwhile); a
  cached tokenizer that does not parse is read from the source instead, with a warning."""
  _, _, tok, _ = load(GGUF)
  parsed = []

  class Counting:
    @staticmethod
    def from_file(path):
      parsed.append(path)
      return Backend.from_file(path)

  monkeypatch.setattr(cache, "Backend", Counting)
  timings = {}
  _, _, deferred = source.load(str(GGUF), timings=timings, defer_tokenizer=True)
  assert timings["weight_cache"] == "hit" and parsed == []
  text = "Hello, world! <start_of_turn>"
  assert deferred().encode(text) == tok.encode(text) and len(parsed) == 1
  (entry,) = entries(cache_dir)
  (cache_dir / "weights" / entry / "tokenizer.json").write_text("{")
  with caplog.at_level(logging.WARNING):
    for defer in (True, False):
      _, _, again = source.load(str(GGUF), timings=timings, defer_tokenizer=defer)
      assert timings["weight_cache"] == "hit"
      assert (again() if defer else again).encode(text) == tok.encode(text)
  assert "unreadable tokenizer" in caplog.text


@pytest.mark.slow
def test_a_later_start_loads_the_first_decode_program_before_the_first_prefill_runs(cache_dir, tmp_path):
  """A start that hits the weight cache traces the first decode program in `LLM()` and loads it
  from the persistent compilation cache while the tokenizer is parsed; the first prefill runs
  after that load (a load then would sit on top of the resident weights), and nothing is built
  twice: the second start looks up as many programs as the first compiled, and all hit."""
  code = f"""
import json
from jaxgen import LLM, SamplingParams
from jaxgen.decode import compiles, steps
llm = LLM({str(GGUF)!r}, max_len=64, max_batch=2, compilation_cache_dir={str(tmp_path / "xla")!r})
ahead = llm.engine.runner.ahead is not None
waited = []
prefill = steps.Programs.prefill

def watched(self, *args, **kwargs):
  waited.append(llm.engine.runner.ahead is None)
  return prefill(self, *args, **kwargs)

steps.Programs.prefill = watched
out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
print(json.dumps(dict(cache=llm.timings["weight_cache"], tokenizer_s="tokenizer_s" in llm.timings, ahead=ahead,
                      waited=waited, tokens=out.outputs[0].token_ids, phases=compiles.phases())))
"""
  env = dict(os.environ, JAXGEN_CACHE_DIR=str(cache_dir))
  first, second = (json.loads(subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300,
                                             capture_output=True, text=True).stdout.splitlines()[-1])
                   for _ in range(2))
  assert first["cache"].startswith("miss") and not first["ahead"]
  assert first["phases"]["cache_misses"] >= 3  # the state's allocation, prefill and decode at least
  assert second["cache"] == "hit" and second["ahead"] and second["tokenizer_s"]
  assert second["waited"] == [True]
  assert second["phases"]["cache_misses"] == 0
  assert second["phases"]["cache_hits"] == first["phases"]["cache_misses"] + first["phases"]["cache_hits"]
  assert second["tokens"] == first["tokens"]


def test_other_dtype_or_changed_file_is_a_miss(cache_dir, tmp_path):
  load(GGUF)
  load(GGUF, "bfloat16")
  assert len(entries(cache_dir)) == 2
  changed = tmp_path / "model.gguf"
  shutil.copy(GGUF, changed)
  with open(changed, "ab") as f:
    f.write(b"\0" * 64)  # same path, new content: another key
  assert cache.key(str(changed), "float32", None) != cache.key(str(GGUF), "float32", None)


def test_a_damaged_entry_is_ignored_and_rewritten(cache_dir):
  _, first, _, _ = load(GGUF)
  (entry,) = entries(cache_dir)
  weights = cache_dir / "weights" / entry / "arrays" / "layers.0.q.npy"
  with open(weights, "r+b") as f:
    f.truncate(os.path.getsize(weights) // 2)
  _, again, _, t = load(GGUF)
  assert t["weight_cache"].startswith("miss (writing")
  assert all(np.array_equal(first[k], again[k]) for k in first)
  assert load(GGUF)[3]["weight_cache"] == "hit"


def test_an_unwritable_or_disabled_cache_still_loads(tmp_path, monkeypatch):
  blocker = tmp_path / "a-file"
  blocker.write_text("not a directory")
  monkeypatch.setenv("JAXGEN_CACHE_DIR", str(blocker / "cache"))
  assert load(GGUF)[3]["weight_cache"] == "miss"
  monkeypatch.setenv("JAXGEN_CACHE_DIR", str(tmp_path / "off"))
  monkeypatch.setenv("JAXGEN_WEIGHT_CACHE", "0")
  assert load(GGUF)[3]["weight_cache"] == "off" and not (tmp_path / "off").exists()


def test_a_miss_serves_before_its_entry_is_written_and_the_entry_outlives_the_process(cache_dir, monkeypatch):
  """The entry is written on a thread: the load returns first; the interpreter waits for it."""
  release = threading.Event()
  fill = cache._fill
  monkeypatch.setattr(cache, "_fill", lambda *a: release.wait(60) and fill(*a))
  timings = {}
  source.load(str(GGUF), timings=timings)
  assert timings["weight_cache"].startswith("miss (writing") and entries(cache_dir) == []
  release.set()
  cache.wait()
  assert len(entries(cache_dir)) == 1
  # A process that exits as soon as its load returns still leaves a complete entry.
  other = cache_dir.parent / "other"
  code = f"from jaxgen.checkpoints import source; source.load({str(GGUF)!r}, 'bfloat16')"
  env = dict(os.environ, JAXGEN_CACHE_DIR=str(other))
  subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
  (entry,) = entries(other)
  assert cache.read(str(other / "weights" / entry)) is not None


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="zero-copy placement is a host-memory property")
def test_a_hit_places_the_mapped_files_without_copying_them(cache_dir, monkeypatch):
  """On the CPU a hit's device buffers are the cache files' pages themselves (`jax.device_put`
  aliases a read-only, aligned numpy map): a start pays no copy and holds no second set of weights."""
  load(GGUF, "bfloat16")
  mapped = {}
  read = cache.read

  def keep(directory, **kwargs):
    hit = read(directory, **kwargs)
    mapped.update(hit[1])
    return hit

  monkeypatch.setattr(cache, "read", keep)
  cfg, model, _ = source.load(str(GGUF), "bfloat16")
  placed = flat_params(model)
  assert mapped and sorted(mapped) == sorted(placed)
  for name, x in placed.items():
    assert isinstance(mapped[name], np.memmap), name
    assert x.unsafe_buffer_pointer() == mapped[name].ctypes.data, f"{name} was copied when placed"


def test_a_load_hands_the_freed_c_heap_back(cache_dir, monkeypatch):
  """What a load frees on the C heap (the tokenizer's JSON parse, the conversion) goes back to the
  OS: `source.load` calls `platform.return_freed_heap` once, after the source is read and converted
  (what the trim itself does: the next test)."""
  calls = []
  timings = {}
  monkeypatch.setattr(platform, "return_freed_heap", lambda: calls.append(dict(timings)))
  source.load(str(GGUF), timings=timings)  # a miss: the GGUF read and converted
  cache.wait()
  assert len(calls) == 1, calls
  assert "read_s" in calls[0]  # after the reading and converting, whose garbage it returns


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trimming_returns_freed_small_blocks_to_the_os():
  """`platform.return_freed_heap` hands back what glibc would keep: 100 MiB of small blocks freed
  below a live one (the heap's top cannot shrink on its own)."""
  libc = ctypes.CDLL("libc.so.6")
  libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
  libc.free.argtypes = [ctypes.c_void_p]

  def resident() -> int:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

  blocks = [libc.malloc(1024) for _ in range(100 * 1024)]
  for b in blocks:
    ctypes.memset(b, 1, 1024)  # touched, so resident
  keep = libc.malloc(1024)  # above them: the heap's top cannot shrink on its own
  for b in blocks:
    libc.free(b)
  held = resident()
  platform.return_freed_heap()
  assert held - resident() > 64 << 20
  libc.free(keep)


def test_a_start_from_gguf_never_imports_orbax(cache_dir):
  """orbax (~50 MB resident, ~0.1 s of import) is imported only for orbax checkpoints: a start
  from GGUF, missing or hitting the weight cache, goes without it."""
  code = ("import sys; from jaxgen import LLM; from jaxgen.checkpoints import cache, source\n"
          f"for _ in range(2): source.load({str(GGUF)!r}); cache.wait()\n"
          "assert 'orbax.checkpoint' not in sys.modules, 'orbax was imported'")
  subprocess.run([sys.executable, "-c", code], env=dict(os.environ, JAXGEN_CACHE_DIR=str(cache_dir)), check=True,
                 timeout=300)
  assert len(entries(cache_dir)) == 1
