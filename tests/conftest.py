"""Shared fixtures: tiny random models (fast structure tests) and the embedded model (loaded once).

Layers of tests: tiny configs check structure and invariants in seconds; component numerics are
checked against numpy; the real embedded model is checked against golden data produced by an
independent implementation (HF transformers, `tools/make_reference.py`).
"""

from __future__ import annotations

import os

# The suite runs on the CPU, also where libtpu is installed (the test extra brings it for
# `jaxgen plan`'s TPU compiles): no process tries to open a TPU, and every worker and subprocess
# may load libtpu (it otherwise takes a lock that one process holds).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import hashlib  # noqa: E402
import pathlib
import shutil
import time

import jax
import jax.numpy as jnp
import jaxgen
import jaxlib
import numpy as np
import pytest
from flax import nnx
from jaxgen.model.kernels import cpu_kernels
from jaxgen.model import platform as platforms
from jaxgen.model.config import ModelConfig, layer_pattern
from jaxgen.model.transformer import Transformer

DATA = pathlib.Path(__file__).parent / "data"
_SOURCES = ("model", "decode", "sharding", "checkpoints", "serve")  # with the root's modules: the package
_PRUNE_AFTER_S = 24 * 3600


def _cache_root() -> pathlib.Path:
  """Where the suite keeps compiled programs and converted weights between runs.

  Many tests build engines over the same tiny models (identical programs), and every run loads the
  embedded model: compiling and converting each once per run is most of the suite's time, and once
  per source is enough. The key holds the jax and jaxlib versions and a hash of the package's
  sources, so a change to either starts from empty caches (the cold path runs too) and a stale
  entry can never stand in for the code under test. `JAXGEN_TEST_CACHE` moves the root; older keys
  beyond the newest few are removed. Tests of the caches themselves use directories of their own.
  """
  base = pathlib.Path(os.environ.get("JAXGEN_TEST_CACHE") or pathlib.Path.home() / ".cache" / "jaxgen-tests")
  package = pathlib.Path(jaxgen.__file__).parent
  h = hashlib.sha256(f"jax {jax.__version__} jaxlib {jaxlib.__version__}".encode())
  files = [*package.glob("*.py"), *(p for d in _SOURCES for ext in ("*.py", "*.cc") for p in (package / d).rglob(ext))]
  for path in sorted(files):
    rel = path.relative_to(package)
    h.update(str(rel).encode() + b"\0" + path.read_bytes() + b"\0")
  root = base / h.hexdigest()[:16]
  root.mkdir(parents=True, exist_ok=True)
  os.utime(root)  # in use: the pruning below goes by the time a key was last used
  if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process prunes: workers share the root
    # Only keys unused for a day, and never the newest few: another checkout's run may be using one.
    keys = sorted((p for p in base.iterdir() if p.is_dir() and p != root), key=lambda p: p.stat().st_mtime)
    for old in keys[:-3]:
      if time.time() - old.stat().st_mtime > _PRUNE_AFTER_S:
        shutil.rmtree(old, ignore_errors=True)
  return root


_CACHE = _cache_root()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE / "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
# Converted weights (checkpoints.cache) likewise: the suite's own, never the user's.
os.environ.setdefault("JAXGEN_CACHE_DIR", str(_CACHE / "jaxgen"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def tiny_config(**kw) -> ModelConfig:
  """A Gemma-3-shaped model small enough to compile in about a second."""
  base = dict(family="gemma3", vocab_size=300, embed_dim=32, num_layers=4, num_heads=4, num_kv_heads=2,
              head_dim=16, mlp_dim=64, max_context=512, norm_offset=1.0, rope_base=1e6, rope_base_local=1e4,
              sliding_window=8, query_scale=0.25, embed_scale=True, activation="gelu_tanh", qk_norm=True,
              sandwich_norm=True)
  base.update(kw)
  base.setdefault("layer_kinds", layer_pattern(base["num_layers"], 2, base["sliding_window"]))
  return ModelConfig(**base)


class ToyTokenizer:
  """Ids 0..2 are special (pad, eos, bos); every id i >= 3 decodes to one printable ASCII character.

  Enough for engine tests on tiny random models (special ids decode to nothing).
  """

  bos_id, eos_id, pad_id, add_bos = 2, 1, 0, True

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  @property
  def stop_ids(self):
    return frozenset({1})

  def _char(self, i: int) -> str:
    return chr(0x41 + (i - 3) % 58)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    ids = [3 + (ord(c) - 0x41) % 58 for c in text]
    return ([2] if add_special_tokens else []) + ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return "".join(self._char(i) for i in ids if i >= 3)


def run_to_end(eng, prompts, params) -> list:
  """Submits every prompt to an engine (one SamplingParams or one per prompt) and steps until all
  finish; the final RequestOutputs in submission order."""
  params = params if isinstance(params, list) else [params] * len(prompts)
  ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
  done = {}
  while eng.has_unfinished():
    for out in eng.step():
      if out.finished:
        done[out.request_id] = out
  return [done[i] for i in ids]


def platform_for(impl: str, dtype: str = "float32") -> platforms.Platform:
  """A CPU platform whose ops take one side of the kernel interface: "xla" (the plain formulation
  TPU and GPU run), "xla_chunked" (XLA:CPU's own formulations, the fallback without the kernels)
  or "cpu" (jaxgen's CPU kernels; skipped where they cannot run)."""
  if impl == "cpu":
    status = cpu_kernels.status()
    if not status.available:
      pytest.skip(f"the CPU kernels cannot run here: {status.reason}")
    return platforms.resolve(dtype)
  if impl == "xla":
    return platforms.resolve(dtype, attention="xla", matmul="xla")
  no_kernels = cpu_kernels.Status(False, "left out on purpose by the test")
  return platforms.resolve(dtype, kernels=no_kernels)


def tiny_model(cfg: ModelConfig | None = None, seed: int = 0, dtype=jnp.float32) -> Transformer:
  cfg = cfg or tiny_config()
  model = Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
  # Give the norms some spread so a wrong (1 + w) convention would show.
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if "norm" in str(path[-1]):
      var.set_value(jnp.asarray(rng.normal(0, 0.3, var.get_value().shape), dtype))
  return model


@pytest.fixture(scope="session")
def golden():
  """The committed reference data: {name: {ids, top_ids, top_logprobs, greedy_ids, greedy_margin}}."""
  path = DATA / "gemma3_270m_golden.npz"
  z = np.load(path, allow_pickle=False)
  out = {}
  for name in z["names"]:
    name = str(name)
    out[name] = {k: z[f"{name}/{k}"] for k in ("text", "ids", "top_ids", "top_logprobs", "greedy_ids", "greedy_margin")}
  return out


@pytest.fixture(scope="session")
def llm():
  """The embedded Gemma 3 270M in float32 with a small engine (loaded once per session)."""
  from jaxgen import LLM

  return LLM(dtype="float32", max_len=1536, max_batch=4, prefill_chunk=256, seed=0)


@pytest.fixture(scope="session")
def llm_bf16():
  from jaxgen import LLM

  return LLM(dtype="bfloat16", max_len=256, max_batch=1, prefill_chunk=256, seed=0)


# Modules by the time they take, longest first (a cold run's `--durations`): with `-n 2 --dist
# loadscope --no-loadscope-reorder` each module goes whole to a worker in this order, so the long
# ones start at once and the short ones fill in at the end. Modules not named follow in file order.
SLOWEST_FIRST = ("test_speculative", "test_engine", "test_generate", "test_plan", "test_prefix", "test_sharding",
                 "test_emulated", "test_serve", "test_golden", "test_cli", "test_cache", "test_pallas", "test_weights",
                 "test_notebook", "test_quant", "test_orbax", "test_serve_faults", "test_gguf", "test_cpu_kernels",
                 "test_hf", "test_multiprocess")


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: file order within a module
  if os.environ.get("JAXGEN_SKIP_SLOW"):
    skip = pytest.mark.skip(reason="JAXGEN_SKIP_SLOW is set")
    for item in items:
      if "slow" in item.keywords:
        item.add_marker(skip)
