"""`EngineConfig`: what the engine's rooms need, resolved once from the user's arguments.

`LLM`, `jaxgen serve`, `jaxgen bench` and `jaxgen plan` build one and pass it on; the scheduler,
the runner and the output processor read it and never resolve anything again. It also lists the
programs an engine compiles (`programs`): warm-up runs that list, and `program_count` is its length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxgen.decode import prefix, speculative
from jaxgen.decode.buckets import powers_of_two
from jaxgen.decode.cache import CacheSpec
from jaxgen.decode.prefix_index import BLOCK
from jaxgen.model.config import FLOAT16_OVERFLOWS, LOCAL, ModelConfig
from jaxgen.model import kv
from jaxgen.model.platform import KernelMesh, Platform, resolve
from jaxgen.sharding import rules

MIN_PROMPT_BUCKET = 16


def prompt_chunk(cfg: ModelConfig, spec: CacheSpec, prefill_chunk: int,
                 prefix_caching: bool) -> tuple[int, int | None, str | None]:
  """(the largest prompt chunk one prefill takes, the smallest ring's length or None, why prefix
  caching is off or None)."""
  chunk = min(prefill_chunk, spec.max_len)
  note = None if prefix_caching else "off (enable_prefix_caching=False)"
  ring = min((spec.layer_len(cfg, k) for k in cfg.layer_kinds if k == LOCAL), default=None)
  if note is None and ring is not None and ring < BLOCK:
    note = f"off: the sliding window of {ring} tokens is shorter than a block of {BLOCK}"
  if note is None:
    # Blocks are saved from the row after each chunk, so a chunk must fit the smallest ring and
    # start on a block boundary.
    limit = chunk if ring is None else min(chunk, ring)
    chunk = limit - limit % BLOCK if limit >= BLOCK else limit
  return chunk, ring, note


def prompt_buckets(chunk: int) -> tuple[int, ...]:
  """Prompt lengths a prefill program is compiled for: powers of two from 16 up to the chunk."""
  return powers_of_two(chunk, min(MIN_PROMPT_BUCKET, chunk))


def check_sizes(model: ModelConfig, max_batch: int, max_len: int) -> None:
  """A ValueError naming the value and its limit for slots or rows no engine of `model` can have."""
  if max_batch < 1:
    raise ValueError(f"max_batch={max_batch} must be >= 1")
  if max_len < 2:
    raise ValueError(f"max_len={max_len} must be >= 2")
  if max_len > model.max_context:
    raise ValueError(f"max_len={max_len} exceeds the model's context length {model.max_context}")


def program_list(max_batch: int, prefill_chunk: int, data_parallel: int = 1, prefix_caching: bool = False,
                 speculative: bool = False, draft: bool = False) -> tuple[tuple, ...]:
  """The programs an engine compiles in warm-up, as (name, *static shape): prefill fresh and
  continued per prompt bucket, decode per row bucket, the sampler per row bucket and for the one
  row of a prefill (`steps.sample_rows`), fork, move, the uncached forward of the
  smallest `LLM.logits` bucket, with prefix caching save and restore, with speculation verify per
  row bucket, with a draft model its catch-up per prompt bucket, propose per row bucket and move.
  Logarithmic in max_batch and the chunk."""
  prompts = prompt_buckets(prefill_chunk)
  rows = powers_of_two(max_batch) if data_parallel == 1 else (max_batch,)
  out = [("prefill", fresh, b) for fresh in (True, False) for b in prompts]
  out += [("decode", r) for r in rows] + [("sample", r) for r in sorted({1, *rows})]
  out += [("fork",), ("move",), ("logits", MIN_PROMPT_BUCKET)]
  out += [("verify", r) for r in rows] if speculative else []
  out += [("save",), ("restore",)] if prefix_caching else []
  if draft:
    out += [("draft_catch_up", b) for b in prompts] + [("draft_propose", r) for r in rows] + [("draft_move",)]
  return tuple(out)


def program_count(max_batch: int, prefill_chunk: int, data_parallel: int = 1, prefix_caching: bool = False,
                  speculative: bool = False) -> int:
  """How many programs `program_list` names."""
  return len(program_list(max_batch, prefill_chunk, data_parallel, prefix_caching, speculative))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """One engine's resolved settings. Build with `EngineConfig.resolve`.

  model: the model's configuration; platform: how its programs run (kernels, dtypes); cache: the
  KV cache's rows (slots = max_batch), length and dtype; chunk: the largest prompt chunk one
  prefill takes, prompt_buckets the chunk lengths compiled; row_buckets: rows a decode step runs
  over (powers of two; all slots when a mesh's data axis splits them); store: the prefix cache's
  store, None when prefix caching is off (prefix_note says why); speculative: the speculation
  config or None; mesh: the devices (None: one); seed: the host RNG's, for requests without one.
  """

  model: ModelConfig
  platform: Platform
  cache: CacheSpec
  chunk: int
  ring: int | None  # the smallest sliding-window ring's length (None: global layers only)
  prompt_buckets: tuple[int, ...]
  row_buckets: tuple[int, ...]
  prefill_token_budget: int
  store: prefix.StoreSpec | None
  prefix_note: str | None
  speculative: speculative.SpecConfig | None = None
  draft_platform: Platform | None = None  # set when the speculation method is draft_model
  mesh: jax.sharding.Mesh | None = None
  seed: int | None = None

  @property
  def max_batch(self) -> int:
    return self.cache.slots

  @property
  def max_len(self) -> int:
    return self.cache.max_len

  @property
  def data_parallel(self) -> int:
    return 1 if self.mesh is None else self.mesh.shape.get("data", 1)

  @property
  def restore_blocks(self) -> int:
    """Blocks one restore program copies (a whole row's worth)."""
    return -(-self.max_len // BLOCK)

  @property
  def save_blocks(self) -> int:
    """Blocks one save program copies (a chunk's worth)."""
    return max(self.chunk // BLOCK, 1)

  @property
  def reads_first(self) -> bool:
    """Whether a step must read the sampled tokens back before it schedules: speculation makes its
    proposals from the latest tokens. Otherwise a step dispatches before it reads the previous
    one's results (a grammar's mask needs them only for the draw, which waits alone:
    `Runner.draw`)."""
    return self.speculative is not None

  @property
  def programs(self) -> tuple[tuple, ...]:
    return program_list(self.max_batch, self.chunk, self.data_parallel, self.store is not None,
                        self.speculative is not None, self.draft_platform is not None)

  @property
  def program_count(self) -> int:
    return len(self.programs)

  @classmethod
  def resolve(cls, model: ModelConfig, dtype: str, *, max_batch: int = 8, max_len: int = 2048,
              prefill_chunk: int | None = None, cache_dtype: str | None = None, platform: Platform | None = None,
              mesh: jax.sharding.Mesh | None = None, prefill_token_budget: int | None = None, seed: int | None = None,
              enable_prefix_caching: bool = True, prefix_cache_tokens: int | None = None, speculative_config=None,
              draft: tuple[ModelConfig, str] | None = None, draft_platform: Platform | None = None,
              free_bytes: int | None = None) -> EngineConfig:
    """Checks the arguments (a ValueError names the value and its limit) and resolves the rest.

    dtype: the weights'. platform: default `platform.resolve` for dtype. draft: (config, dtype) of
    the draft model when speculative_config's method is draft_model. free_bytes: device memory
    the prefix store may take half of by default (None: asked of the device; on a mesh, give the
    memory plan's)."""
    check_sizes(model, max_batch, max_len)
    if prefix_cache_tokens is not None and prefix_cache_tokens < 0:
      raise ValueError(f"prefix_cache_tokens={prefix_cache_tokens} must be >= 0")
    spec_cfg = speculative.parse(speculative_config)
    platform = platform or resolve(dtype, cache_dtype=cache_dtype, prefill_chunk=prefill_chunk,
                                   quantization=model.weight_quant)
    if platform.compute_dtype(dtype) == jnp.float16 and model.family in FLOAT16_OVERFLOWS:
      raise ValueError(f"dtype={dtype!r} computes in float16 on {platform.device_kind or platform.backend}, whose "
                       f"range {model.family} activations exceed (NaN); use dtype='bfloat16' or 'float32'")
    cache = CacheSpec(slots=max_batch, max_len=max_len, dtype=cache_dtype or platform.cache_dtype,
                      align=platform.cache_align, slack=spec_cfg.k if spec_cfg else 0)
    platform = with_kernel_mesh(platform, model, cache, mesh)
    chunk, ring, note = prompt_chunk(model, cache, prefill_chunk or platform.prefill_chunk, enable_prefix_caching)
    data_parallel = 1 if mesh is None else mesh.shape.get("data", 1)
    # Slots split over a data axis: a prefix of rows would sit on a few devices, so steps cover all.
    rows = powers_of_two(max_batch) if data_parallel == 1 else (max_batch,)
    store = None
    if note is None:
      if prefix_cache_tokens is None:
        free = free_bytes if free_bytes is not None or mesh is not None else _free_device_bytes()
        prefix_cache_tokens = prefix.default_tokens(model, cache.dtype, cache.total_bytes(model), free)
      store = prefix.spec_for(model, cache.dtype, prefix_cache_tokens)
      if store.usable < 1:
        store, note = None, (f"off: prefix_cache_tokens={prefix_cache_tokens} buys no block (a block is {BLOCK} "
                             "tokens, and one more is scratch)")
    method = None if spec_cfg is None else spec_cfg.method
    if method == "draft_model":
      if draft is None:
        raise ValueError("speculative_config method='draft_model' needs the draft model (Engine(draft_model=...); "
                         "LLM loads it from the config)")
      draft_cfg, draft_dtype = draft
      if draft_cfg.vocab_size != model.vocab_size:
        raise ValueError(f"draft_model has vocab_size={draft_cfg.vocab_size}; the target's is {model.vocab_size} "
                         "(a draft must share the target's vocabulary)")
      if draft_platform is None:
        same = draft_cfg.weight_quant == model.weight_quant and str(draft_dtype) == str(dtype)
        draft_platform = platform if same else resolve(str(draft_dtype), cache_dtype=cache.dtype, prefill_chunk=chunk,
                                                       quantization=draft_cfg.weight_quant)
      draft_platform = with_kernel_mesh(draft_platform, draft_cfg, cache, mesh)
    elif draft is not None:
      raise ValueError(f"draft_model is given but speculative_config method={method!r} does not use one")
    else:
      draft_platform = None
    return cls(model, platform, cache, chunk, ring, prompt_buckets(chunk), rows, prefill_token_budget or chunk,
               store, note, spec_cfg, draft_platform, mesh, seed)


def with_kernel_mesh(platform: Platform, model: ModelConfig, cache: CacheSpec, mesh) -> Platform:
  """The platform with how the Pallas kernel's operands split over `mesh`, as the rules table
  splits the cache (its slots and kv heads); unchanged on one device or without the kernel."""
  if platform.attention != "pallas" or mesh is None or mesh.size == 1:
    return platform
  shape = jax.tree.leaves(cache.shapes(model).layers)[0].shape
  rows, heads = rules.partition_spec("cache.k", shape, kv.AXES, mesh)[:2]
  return dataclasses.replace(platform, devices=mesh.size,
                             kernel_mesh=KernelMesh(mesh.abstract_mesh, rows, heads))


def _free_device_bytes() -> int | None:
  """Bytes the first local device has free (None where it does not say, or in a multi-process
  run, whose processes must all decide alike)."""
  if jax.process_count() > 1:
    return None
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" not in stats:
    return None
  return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
