"""`LLM`: the offline API (vLLM's shape) over the engine: load, generate, stream, logits."""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgen.decode.cache import CacheSpec
from jaxgen.decode.engine import Engine, buckets
from jaxgen.decode.outputs import RequestOutput
from jaxgen.decode.params import SamplingParams
from jaxgen.sharding import distributed, planner, rules
from jaxgen.sharding.mesh import MeshConfig, as_mesh

Prompt = str | Sequence[int]


class LLM:
  """A model with its tokenizer and a serving engine.

  LLM() loads the embedded Gemma 3 270M; LLM("model.gguf", dtype="bfloat16") a given file.
  max_len: tokens per cache slot (prompt + output); max_batch: slots decoded together.
  mesh: a `jaxgen.sharding.MeshConfig` (or a jax Mesh) to split the model over many devices: each
  device receives only its shards of the weights (a layout that cannot divide is refused before
  any is placed), the memory plan (`self.plan`) is checked before the cache is allocated or any
  program compiled, and max_batch must be a multiple of the data axis. Across several
  processes (`jaxgen.sharding.distributed.initialize`) every process makes the same calls; only
  process 0 gets outputs back (the others get empty lists and streams).
  """

  def __init__(self, model: str | None = None, *, dtype: str = "float32", max_len: int = 2048,
               max_batch: int = 8, prefill_chunk: int | None = None, cache_dtype: str | None = None,
               compilation_cache_dir: str | None = None, mesh: MeshConfig | jax.sharding.Mesh | None = None):
    if compilation_cache_dir:
      jax.config.update("jax_compilation_cache_dir", compilation_cache_dir)
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from jaxgen.checkpoints.load import load

    t0 = time.perf_counter()
    if dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"dtype={dtype!r} is not supported; use 'float32', 'bfloat16' or 'float16'")
    self.dtype = dtype
    self.mesh = None if mesh is None else as_mesh(mesh)
    self.cfg, self.model, self.tokenizer = load(model, dtype, mesh=self.mesh)
    self.max_len = min(max_len, self.cfg.max_context)
    cache_dtype = cache_dtype or ("float32" if jax.default_backend() == "cpu" else dtype)
    self.plan, shardings = None, None
    if self.mesh is not None:
      spec = CacheSpec(slots=max_batch, max_len=self.max_len, dtype=cache_dtype)
      self.plan = planner.plan(self.cfg, dtype, spec, self.mesh).check()
      shardings = rules.engine_shardings(self.cfg, dtype, spec, self.mesh, nnx.state(self.model))
    self.load_s = time.perf_counter() - t0
    if prefill_chunk is None:
      # Largest prefill bucket. On CPU, attention over longer chunks costs more than the larger
      # matmuls save (measured: 256 is fastest for a 1,185-token prompt); accelerators take more.
      prefill_chunk = 256 if jax.default_backend() == "cpu" else 1024
    self.engine = Engine(self.model, self.tokenizer, max_batch=max_batch, max_len=self.max_len,
                         prefill_chunk=prefill_chunk, cache_dtype=cache_dtype, shardings=shardings)
    logits_kw = {}
    if shardings is not None:
      everywhere = rules.replicated(self.mesh)
      logits_kw = dict(in_shardings=(shardings["params"], everywhere), out_shardings=everywhere)
      # Requests without a seed draw one on the host: every process must draw the same.
      self.engine._host_rng.seed(distributed.same_seed(self.engine._host_rng.getrandbits(64)))
    self._logits_fn = jax.jit(functools.partial(_uncached_logits, self.engine.graphdef), **logits_kw)

  # ------------------------------------------------------------------------------------- scoring
  def logits(self, token_ids: Sequence[int]) -> np.ndarray:
    """One uncached forward pass: float32 logits [T, V] for every position of `token_ids`."""
    ids = np.asarray(list(token_ids), dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
      raise ValueError(f"token_ids must be a non-empty list of ints, got shape {ids.shape}")
    bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
    if bad.size:
      raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.cfg.vocab_size})")
    if ids.size > self.cfg.max_context:
      raise ValueError(f"{ids.size} tokens exceed the model's context length {self.cfg.max_context}")
    t = ids.size
    padded = next(b for b in buckets(max(t, 16)) if b >= t)
    tokens = np.zeros((1, padded), np.int32)
    tokens[0, :t] = ids
    return np.asarray(self._logits_fn(self.engine.params, tokens))[0, :t]

  # ---------------------------------------------------------------------------------- generation
  def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
               use_tqdm: bool = True) -> list[RequestOutput]:
    """Generates for one prompt or many (str, list of str, or list of token-id lists).

    Returns one RequestOutput per prompt, in input order. Every prompt is validated before any
    runs: one bad input raises ValueError and nothing is generated.
    """
    prompts = _as_prompt_list(prompts)
    if isinstance(params, SamplingParams) or params is None:
      params = [params or SamplingParams()] * len(prompts)
    elif len(params) != len(prompts):
      raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
    eng = self.engine
    ids = []
    try:
      for i, (p, sp) in enumerate(zip(prompts, params)):
        try:
          ids.append(eng.add_request(p, sp))
        except ValueError as e:
          raise ValueError(f"prompt {i}: {e}") from None
    except ValueError:
      for rid in ids:
        eng.abort(rid)
      while eng.has_unfinished():
        eng.step()
      raise
    results: dict[str, RequestOutput] = {}
    bar = _progress(len(ids)) if use_tqdm and jax.process_index() == 0 else None
    while eng.has_unfinished():
      for out in eng.step():
        if out.finished and out.request_id in ids:
          results[out.request_id] = out
          if bar is not None:
            bar.update(1)
    if bar is not None:
      bar.close()
    return [results[r] for r in ids] if jax.process_index() == 0 else []

  def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
    """Yields text deltas of one request as they are produced (n=1)."""
    params = params or SamplingParams()
    if params.n != 1:
      raise ValueError(f"SamplingParams.n={params.n}: stream() serves one sample; use generate() for n > 1")
    eng = self.engine
    rid = eng.add_request(prompt, params)
    sent = 0
    self.last_output = None
    try:
      while eng.has_unfinished():
        for out in eng.step():
          if out.request_id != rid:
            continue
          self.last_output = out
          text = out.text
          if len(text) > sent and jax.process_index() == 0:
            yield text[sent:]
            sent = len(text)
    finally:
      if self.last_output is None or not self.last_output.finished:
        eng.abort(rid)

  def chat(self, messages, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
           chat_template: str | None = None, add_generation_prompt: bool = True,
           use_tqdm: bool = True) -> list[RequestOutput]:
    """Replies to a conversation ([{"role": ..., "content": ...}, ...]) or a list of them (vLLM's chat).

    The prompt is rendered with the model's own chat template (or `chat_template`), see
    `jaxgen.checkpoints.chat`; generation also stops on the template's end-of-turn token.
    """
    from jaxgen.checkpoints.chat import chat_format, conversations

    fmt = chat_format(self.tokenizer, chat_template)
    if fmt.note:
      warnings.warn(fmt.note, stacklevel=2)
    prompts = [fmt.encode(self.tokenizer, c, add_generation_prompt) for c in conversations(messages)]
    many = params if isinstance(params, (list, tuple)) else [params or SamplingParams()]
    many = [dataclasses.replace(p, stop_token_ids=sorted(set(p.stop_token_ids) | fmt.stop_ids)) for p in many]
    return self.generate(prompts, many if isinstance(params, (list, tuple)) else many[0], use_tqdm=use_tqdm)

  def warmup(self) -> float:
    """Compiles every program serving can need; returns seconds."""
    t = self.engine.warmup()
    self._logits_fn(self.engine.params, np.zeros((1, 16), np.int32)).block_until_ready()
    return t


def _uncached_logits(graphdef, params, tokens):
  model = nnx.merge(graphdef, params)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  hidden = model(tokens, positions)
  return model.logits(hidden)


def _as_prompt_list(prompts) -> list[Prompt]:
  if isinstance(prompts, str):
    return [prompts]
  prompts = list(prompts)
  if not prompts:
    raise ValueError("prompts is empty: give a string, a list of strings or a list of token-id lists")
  if all(isinstance(x, (int, np.integer)) for x in prompts):
    return [prompts]  # one prompt given as token ids
  return prompts


def _progress(total: int):
  from tqdm.auto import tqdm

  return tqdm(total=total, desc="generate", unit="req", delay=1.0, leave=False)


