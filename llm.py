"""`LLM`: the offline API (vLLM's shape) over the engine: load, generate, stream, chat, logits."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
from typing import Callable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jaxgen.checkpoints import source, weights
from jaxgen.checkpoints.chat import chat_format, conversations
from jaxgen.checkpoints.tokenizer import Tokenizer
from jaxgen.decode import draft, speculative
from jaxgen.decode.buckets import bucket, half_steps
from jaxgen.decode.config import MIN_PROMPT_BUCKET, EngineConfig
from jaxgen.decode.engine import Engine
from jaxgen.decode.outputs import RequestOutput
from jaxgen.decode.params import SamplingParams, token_ids
from jaxgen.decode.steps import memory_plan
from jaxgen.model import quant
from jaxgen.model.kernels import cpu_kernels
from jaxgen.model import platform as platforms
from jaxgen.model.config import ModelConfig
from jaxgen.model.params import check_tree, flat_params
from jaxgen.sharding import distributed, rules
from jaxgen.sharding.mesh import MeshConfig, as_mesh
from tqdm.auto import tqdm

Prompt = str | Sequence[int]
DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxgen", "xla")


class LLM:
  """A model with its tokenizer and a serving engine.

  LLM() loads the embedded Gemma 3 270M; LLM("model.gguf", dtype="bfloat16") a given file, HF
  directory or orbax checkpoint. max_len: tokens per cache slot (prompt + output); max_batch:
  slots decoded together (a step covers the rows that run, not every slot).
  mesh: a `jaxgen.sharding.MeshConfig` (or a jax Mesh) to split the model over many devices: each
  device receives only its shards of the weights (a layout that cannot divide is refused before
  any is placed), the memory plan (`self.plan`) is checked before the cache is allocated or any
  program compiled, and max_batch must be a multiple of the data axis. Across several
  processes (`jaxgen.sharding.distributed.initialize`) every process makes the same calls; only
  process 0 gets outputs back (the others get empty lists and streams).
  compilation_cache_dir: JAX's persistent compilation cache (default ~/.cache/jaxgen/xla, unless
  the process set one up already; None or "" leaves JAX's setting alone): a later start finds its
  programs compiled. A GGUF or HF model's converted weights are cached too (`checkpoints.cache`).
  `self.timings` says where the start-up went.
  attention_impl, matmul_impl: "auto", "xla" (the plain formulation TPU and GPU run) or "cpu"
  (jaxgen's CPU kernels); attention also "pallas" (the ragged Pallas kernel for TPU and GPU,
  interpreted on CPU); `self.platform` says what was chosen and why.
  seed: seeds the draw of a seed for requests that give none (None: from the OS).
  quantization: None (weights in `dtype`) or "int8": projection and embedding weights stored int8
  on the device with a float32 scale per block of 32 inputs (`jaxgen.model.quant`; a GGUF's Q8_0
  tensors load as they are); activations stay in the compute dtype. cache_dtype="int8": the KV
  cache int8 with a float32 scale per block of 16 of each key and value vector (`model.kv`).
  enable_prefix_caching: reuse the KV cache of prompt prefixes seen before (vLLM's automatic
  prefix caching, `jaxgen.decode.prefix`); prefix_cache_tokens: its budget in tokens (default:
  half the device memory left free, or as many bytes as the KV cache where a device does not
  report its memory). `RequestOutput.num_cached_tokens` says what a request reused.
  speculative_config: speculative decoding, vLLM's dict: {"method": "ngram",
  "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
  (`jaxgen.decode.speculative`); the output is token for token what it would be without.
  {"method": "draft_model", "model": PATH or "self", "num_speculative_tokens": 4} drafts with a
  smaller model sharing the vocabulary; "self" uses this model's own checkpoint, made cheaper with
  "quantization": "int8" and/or "draft_layers": N (its first N layers and head).
  emulate: "tpu" or "gpu": run here what that accelerator would (activations and cache in the
  weights' dtype, the plain XLA ops, the Pallas attention interpreted), to check its numerics on a
  CPU; slow, for tests.
  """

  def __init__(self, model: str | None = None, *, dtype: str = "float32", max_len: int = 2048,
               max_batch: int = 8, prefill_chunk: int | None = None, cache_dtype: str | None = None,
               compilation_cache_dir: str | None = DEFAULT_COMPILATION_CACHE,
               mesh: MeshConfig | jax.sharding.Mesh | None = None, attention_impl: str = "auto",
               matmul_impl: str = "auto", seed: int | None = None,
               quantization: str | None = None, enable_prefix_caching: bool = True,
               prefix_cache_tokens: int | None = None, speculative_config=None, emulate: str | None = None,
               _weights=None):
    quant.check(quantization)
    spec_cfg = speculative.parse(speculative_config)  # a bad config is refused before any load
    if compilation_cache_dir and not (compilation_cache_dir == DEFAULT_COMPILATION_CACHE
                                      and jax.config.jax_compilation_cache_dir):  # a cache set up already stays
      jax.config.update("jax_compilation_cache_dir", compilation_cache_dir)
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    t0 = time.perf_counter()
    self.mesh = None if mesh is None else as_mesh(mesh)
    resolve = functools.partial(platforms.resolve, dtype, cache_dtype=cache_dtype, matmul=matmul_impl,
                                attention=attention_impl, prefill_chunk=prefill_chunk, emulate=emulate,
                                devices=1 if self.mesh is None else self.mesh.size)
    if self.mesh is None or self.mesh.size == 1:
      cpu_kernels.prepare()  # a first build of the CPU kernels runs while the weights are read
    resolve(quantization=quantization, kernels=cpu_kernels.Status(True, "not yet known"))  # bad options: before any load
    self.dtype = dtype
    # Start-up by phase: read_s, place_s, weight_cache, engine_s, tokenizer_s (then warmup_s).
    self.timings: dict = {}
    if _weights is None:
      self.cfg, self.model, tokenizer = source.load(model, dtype, mesh=self.mesh, quantization=quantization,
                                                    timings=self.timings, defer_tokenizer=True)
    else:  # LLM.from_weights
      cfg, tree, given = _weights
      tokenizer = lambda: given  # noqa: E731
      self.model = weights.from_tree(cfg, tree, dtype, mesh=self.mesh, quantization=quantization)
      self.cfg = self.model.cfg
    # A later start (weights from the weight cache, programs likely in the compilation cache)
    # loads the first decode program while the tokenizer is parsed (`Engine.build_decode_ahead`).
    ahead = self.timings.get("weight_cache") == "hit" and spec_cfg is None
    self.tokenizer = None if ahead else self._parse_tokenizer(tokenizer)
    self.platform = resolve(quantization=self.cfg.weight_quant)  # an orbax checkpoint saved int8 restores int8
    _warn_if_kernels_failed(self.platform)
    self.max_len = min(max_len, self.cfg.max_context)
    draft_model = None
    if spec_cfg is not None and spec_cfg.method == "draft_model":
      if _weights is not None and spec_cfg.model == "self" and spec_cfg.quantization not in (None, quantization):
        raise ValueError("speculative_config model='self' with other quantization needs a checkpoint to re-read; "
                         "an LLM from weights in memory can draft with itself or its first layers only")
      draft_model = draft.load(spec_cfg, self.model, model, self.tokenizer, dtype, self.mesh)
    settings = dict(max_batch=max_batch, max_len=self.max_len, platform=self.platform, mesh=self.mesh,
                    enable_prefix_caching=enable_prefix_caching, prefix_cache_tokens=prefix_cache_tokens,
                    speculative_config=spec_cfg,
                    draft=None if draft_model is None else (draft_model.cfg, str(draft_model.dtype)),
                    draft_platform=None if draft_model is None else resolve(quantization=draft_model.cfg.weight_quant))
    self.plan = None
    if self.mesh is not None:
      # Requests without a seed draw one on the host: every process must draw the same.
      settings["seed"] = distributed.same_seed(seed if seed is not None else np.random.SeedSequence().entropy % 2**63)
      config = EngineConfig.resolve(self.cfg, dtype, **{**settings, "enable_prefix_caching": False})
      planned = None if draft_model is None else (draft_model.cfg, draft_model.dtype,
                                                  _shares_weights(draft_model, self.model))
      plan = functools.partial(memory_plan, self.cfg, dtype, config.cache, self.mesh, draft=planned)
      self.plan = plan().check()
      # The prefix store's default budget comes from what the plan leaves free, and is planned with it.
      config = EngineConfig.resolve(self.cfg, dtype, **settings, free_bytes=self.plan.free)
      if config.store is not None:
        self.plan = plan(store=config.store).check()
    else:
      config = EngineConfig.resolve(self.cfg, dtype, **settings, seed=seed)
    t1 = time.perf_counter()
    self.config = config
    self.engine = Engine(self.model, self.tokenizer, config, draft_model=draft_model)
    self.logits_buckets = half_steps(self.cfg.max_context, MIN_PROMPT_BUCKET)
    self.timings["engine_s"] = time.perf_counter() - t1
    if ahead:
      self.engine.build_decode_ahead()
      self.tokenizer = self.engine.tokenizer = self._parse_tokenizer(tokenizer)
    self.load_s = time.perf_counter() - t0

  def _parse_tokenizer(self, tokenizer: Callable[[], Tokenizer]) -> Tokenizer:
    t0 = time.perf_counter()
    out = tokenizer()
    self.timings["tokenizer_s"] = time.perf_counter() - t0
    return out

  @classmethod
  def from_weights(cls, config: ModelConfig, weights_tree, tokenizer, *, dtype: str | None = None, **kwargs) -> "LLM":
    """An LLM over weights held in memory (just initialised, or being trained): `weights_tree` is
    {parameter name: array} in jaxgen's layout (what `LLM.weights()` returns; from a Hugging Face
    state dict: `jaxgen.checkpoints.hf.tree_from_hf`). Arrays already on their devices stay there
    (on a mesh: those laid out as the rules table says are not copied). dtype: the weights'
    (default: read from the tree); other keyword arguments as for `LLM(...)`."""
    if dtype is None:
      norm = weights_tree.get("final_norm") if hasattr(weights_tree, "get") else None
      if norm is None:
        raise ValueError("weights_tree has no 'final_norm' to read the dtype from: pass dtype=")
      dtype = str(np.dtype(norm.dtype))
    return cls(None, dtype=dtype, _weights=(config, weights_tree, tokenizer), **kwargs)

  # --------------------------------------------------------------------------------- weights
  def weights(self) -> dict[str, jax.Array]:
    """The parameters the engine runs: {name: array} in jaxgen's layout, with their shardings
    (int8 weights with their `_scale` arrays under quantization). The arrays are the engine's own:
    read them, do not donate them."""
    return flat_params(self.engine.model())

  def update_weights(self, weights_tree) -> None:
    """Swaps in new parameters of the same names, shapes and dtypes; nothing recompiles.

    Arrays already laid out like the current ones are used as they are (no copy); others move
    device to device, host arrays are placed by the rules table. Under int8 quantization float
    weights (without scales) are quantized where they live: a jax.Array on its devices, a numpy
    array on the host. A tree that differs is refused with a ValueError naming the first differing
    name, shape or dtype, and the old weights stay in use. Requests in flight are aborted
    (finish_reason "abort": their tokens so far came from the old weights); the prefix cache is
    emptied. A draft model keeps its own weights (speculation stays exact, it may accept fewer
    proposals). Not while a server's engine loop owns the engine.
    """
    current = self.weights()
    values = check_tree(self.cfg, self.dtype, weights_tree, source="update_weights")
    values = rules.place_tree(values, {name: x.sharding for name, x in current.items()})
    self.engine.update_weights(values)
    self.model = self.engine.model()  # the old arrays are no longer held here either

  # ------------------------------------------------------------------------------------- scoring
  def logits(self, token_ids_: Sequence[int]) -> np.ndarray:
    """One uncached forward pass: float32 logits [T, V] for every position of the token ids.

    The ids are padded to a power-of-two bucket, so many lengths share one compiled program.
    """
    ids = token_ids(token_ids_, self.cfg.vocab_size)
    if not ids:
      raise ValueError("token_ids is empty: give at least one token id")
    if len(ids) > self.cfg.max_context:
      raise ValueError(f"{len(ids)} tokens exceed the model's context length {self.cfg.max_context}")
    tokens = np.zeros((1, bucket(len(ids), self.logits_buckets)), np.int32)
    tokens[0, :len(ids)] = ids
    return self.engine.logits(tokens)[0, :len(ids)]

  # ---------------------------------------------------------------------------------- generation
  def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
               use_tqdm: bool = True) -> list[RequestOutput]:
    """Generates for one prompt or many (str, list of str, or list of token-id lists).

    Returns one RequestOutput per prompt, in input order. Every prompt is validated before any
    runs: one bad input raises ValueError naming the prompt, and nothing is generated.
    """
    prompts = _as_prompt_list(prompts)
    if isinstance(params, SamplingParams) or params is None:
      params = [params or SamplingParams()] * len(prompts)
    elif len(params) != len(prompts):
      raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
    # As vLLM's LLM.generate: only the final outputs are wanted, so none is built before (a
    # "delta" request would otherwise end with its last piece only).
    params = [dataclasses.replace(p, output_kind="final_only") for p in params]
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
    bar = tqdm(total=len(ids), desc="generate", unit="req", delay=1.0, leave=False,
               disable=not use_tqdm or not distributed.is_main())
    while eng.has_unfinished():
      for out in eng.step():
        if out.finished and out.request_id in ids:
          results[out.request_id] = out
          bar.update(1)
    bar.close()
    return [results[r] for r in ids] if distributed.is_main() else []

  def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> "Stream":
    """Text deltas of one request (n=1) as they are produced; `.output` is its last RequestOutput."""
    params = params or SamplingParams()
    if params.n != 1:
      raise ValueError(f"SamplingParams.n={params.n}: stream() serves one sample; use generate() for n > 1")
    params = dataclasses.replace(params, output_kind="cumulative")  # the stream takes the deltas itself
    return Stream(self.engine, self.engine.add_request(prompt, params))

  def chat(self, messages, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
           chat_template: str | None = None, add_generation_prompt: bool = True,
           use_tqdm: bool = True) -> list[RequestOutput]:
    """Replies to a conversation ([{"role": ..., "content": ...}, ...]) or a list of them (vLLM's chat).

    The prompt is rendered with the model's own chat template (or `chat_template`), see
    `jaxgen.checkpoints.chat`; generation also stops on the template's end-of-turn token.
    """
    fmt = chat_format(self.tokenizer, chat_template)
    if fmt.note:
      warnings.warn(fmt.note, stacklevel=2)
    prompts = [fmt.encode(self.tokenizer, c, add_generation_prompt) for c in conversations(messages)]
    many = params if isinstance(params, (list, tuple)) else [params or SamplingParams()]
    many = [dataclasses.replace(p, stop_token_ids=sorted(set(p.stop_token_ids) | fmt.stop_ids)) for p in many]
    return self.generate(prompts, many if isinstance(params, (list, tuple)) else many[0], use_tqdm=use_tqdm)

  def reset_prefix_cache(self) -> bool:
    """Forgets every cached prompt prefix; False when prefix caching is off."""
    return self.engine.reset_prefix_cache()

  def warmup(self) -> float:
    """Compiles every program serving can need (`Engine.warmup`); returns seconds. Without it,
    each program compiles on first use (a persistent compilation cache makes that a lookup)."""
    self.timings["warmup_s"] = self.engine.warmup()
    return self.timings["warmup_s"]


class Stream:
  """Iterates over the text deltas of one request; `output` holds its latest RequestOutput.

  Leaving the loop early (break, an exception, garbage collection) aborts the request.
  """

  def __init__(self, engine: Engine, request_id: str):
    self.engine, self.request_id = engine, request_id
    self.output: RequestOutput | None = None
    self._deltas = self._run()

  def __iter__(self) -> Iterator[str]:
    return self._deltas

  def __next__(self) -> str:
    return next(self._deltas)

  def close(self) -> None:
    """Stops the stream; an unfinished request is aborted and its slot freed."""
    self._deltas.close()

  def __enter__(self) -> "Stream":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _run(self) -> Iterator[str]:
    sent = 0
    try:
      while self.engine.has_unfinished():
        for out in self.engine.step():
          if out.request_id != self.request_id:
            continue
          self.output = out
          if len(out.text) > sent and distributed.is_main():
            yield out.text[sent:]
            sent = len(out.text)
        if self.output is not None and self.output.finished:
          return
    finally:
      if self.output is None or not self.output.finished:
        self.engine.abort(self.request_id)


def _shares_weights(draft_model, target) -> bool:
  """Whether every weight of the draft is one of the target's arrays (the target itself, or its first layers)."""
  own = {id(x) for x in jax.tree.leaves(nnx.state(target))}
  return all(id(x) in own for x in jax.tree.leaves(nnx.state(draft_model)))


def _warn_if_kernels_failed(platform: platforms.Platform) -> None:
  """Shows (not only logs) why the CPU kernels could not be built where the machine could run them."""
  status = platform.cpu_kernels
  if status is not None and status.fault:
    warnings.warn(f"jaxgen's CPU kernels are not used ({status.reason}); generation runs on XLA's own code, "
                  "slower in batched decode. `jaxgen info` shows the choices.", stacklevel=3)


def _as_prompt_list(prompts) -> list[Prompt]:
  """A string, a list of token ids, or a list of either -> a list of prompts."""
  if isinstance(prompts, str):
    return [prompts]
  prompts = list(prompts)
  if not prompts:
    raise ValueError("prompts is empty: give a string, a list of strings or a list of token-id lists")
  if all(isinstance(x, (str, Sequence, np.ndarray)) for x in prompts):
    return prompts
  return [prompts]  # one prompt of token ids (each id is checked by the engine)
