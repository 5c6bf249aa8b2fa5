"""The memory planner: bytes per device of weights, KV cache, sampler state and working set.

Computed from the same specs and rules that place the arrays (`rules.param_shardings`, and the
state trees with their logical axes that the caller hands in), before anything is allocated or
compiled: a layout that cannot divide is refused by the rules (ValueError naming the axis and
sizes), one that cannot fit by `Plan.check()`. Weights, cache and sampler state are exact (every
device holds an equal shard); the working set is an estimate of the largest program's temporaries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxgen.model.params import param_specs
from jaxgen.sharding import rules
from jaxgen.sharding.mesh import MeshConfig, as_mesh

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-device bytes of one model + cache on one mesh. `capacity`: device memory, if known."""

  mesh: dict[str, int]
  weights: int
  kv_cache: int
  sampler: int
  working_set: int
  capacity: int | None = None
  notes: tuple[str, ...] = ()
  prefix_store: int = 0
  draft: int = 0  # a speculative draft model: its own weights (none when it shares the target's) and cache

  @property
  def total(self) -> int:
    return self.weights + self.kv_cache + self.sampler + self.working_set + self.prefix_store + self.draft

  @property
  def free(self) -> int | None:
    """Device bytes the plan leaves unused (None where the device does not say)."""
    return None if self.capacity is None else self.capacity - self.total

  def check(self) -> "Plan":
    """Raises ValueError when the plan exceeds the device memory; returns self otherwise."""
    if self.capacity is not None and self.total > self.capacity:
      raise ValueError(
          f"the model needs {_fmt(self.total)} per device on mesh {_mesh_str(self.mesh)} but a device has "
          f"{_fmt(self.capacity)} (weights {_fmt(self.weights)}, KV cache {_fmt(self.kv_cache)}, prefix store "
          f"{_fmt(self.prefix_store)}, draft model {_fmt(self.draft)}, sampler {_fmt(self.sampler)}, working set "
          f"~{_fmt(self.working_set)}); split the weights over a larger model axis, the cache over a larger data "
          "axis, or lower max_batch / max_len / prefix_cache_tokens, or use a 16-bit dtype or a smaller draft")
    return self

  def __str__(self) -> str:
    rows = [("weights", self.weights), ("KV cache", self.kv_cache), ("prefix store", self.prefix_store),
            *([("draft model", self.draft)] if self.draft else []), ("sampler state", self.sampler),
            ("working set (est.)", self.working_set), ("total", self.total)]
    if self.capacity is not None:
      rows.append(("device memory", self.capacity))
    n = 1
    for s in self.mesh.values():
      n *= s
    lines = [f"memory per device, mesh {_mesh_str(self.mesh)} ({n} devices)"]
    lines += [f"  {name:<20}{_fmt(b):>12}" for name, b in rows]
    lines += [f"  note: {note}" for note in self.notes]
    return "\n".join(lines)


def plan(cfg, dtype, mesh: MeshConfig | Mesh, kv_cache, sampler, *, slots: int, max_len: int,
         capacity: int | None = None, prefix_store=None, draft=None) -> Plan:
  """The plan for `cfg` weights in `dtype` and the given state on `mesh`.

  kv_cache, sampler, prefix_store (optional): (tree of ShapeDtypeStructs, the same tree of
  logical-axis tuples) each.
  draft (optional): (draft config, dtype, its cache as above); the config None when the draft's
  weights are the target's own arrays (the target itself, or its first layers).
  slots, max_len: the cache's rows and tokens per row (for the working-set estimate).
  `capacity` (bytes per device) defaults to what the first device reports (TPU/GPU; CPU reports
  nothing, and then `check()` only refuses what cannot divide). Raises ValueError for a layout
  that cannot divide; nothing is allocated or compiled.
  """
  mesh = as_mesh(mesh)

  def weight_bytes(cfg, dtype):
    p_sh = rules.param_shardings(cfg, dtype, mesh)
    return sum(rules.shard_bytes(p_sh[name], s.shape, s.dtype) for name, s in param_specs(cfg, dtype).items())

  def state_bytes(part, prefix):
    shapes, axes = part
    sh = rules.tree_shardings(shapes, axes, mesh, prefix)
    return sum(jax.tree.leaves(jax.tree.map(lambda s, x: rules.shard_bytes(x, s.shape, s.dtype), shapes, sh)))

  sizes = dict(mesh.shape)
  draft_bytes = 0
  if draft is not None:
    draft_cfg, draft_dtype, draft_cache = draft
    draft_bytes = state_bytes(draft_cache, "draft.")
    if draft_cfg is not None:
      draft_bytes += weight_bytes(draft_cfg, draft_dtype)
  return Plan(sizes, weight_bytes(cfg, dtype), state_bytes(kv_cache, "cache."), state_bytes(sampler, "sampler."),
              working_set(cfg, dtype, slots, max_len, sizes), _capacity(mesh) if capacity is None else capacity,
              _notes(cfg, sizes), 0 if prefix_store is None else state_bytes(prefix_store, "store."), draft_bytes)


def working_set(cfg, dtype, slots: int, max_len: int, sizes: dict[str, int], prefill_chunk: int = 512) -> int:
  """Estimated temporaries of the largest program (decode step or one prefill chunk), per device.

  Decode: the sampler works on float32 [B, V] logits (a few copies). Prefill of T tokens:
  activations [T, D + 2F/model + 3NH/model], attention scores [N/model, T, S + T] and logits [V].
  Weights stored in 16 bits are upcast one matrix at a time on CPU: the largest shard in float32.
  """
  m = sizes["model"]
  f32 = 4
  b, v = slots, cfg.vocab_size
  decode = 4 * b * v * f32
  t = min(prefill_chunk, max_len)
  heads = cfg.num_heads // m
  acts = t * (4 * cfg.embed_dim + 2 * cfg.mlp_dim // m + 3 * heads * cfg.head_dim) * f32
  scores = heads * t * (max_len + t) * f32
  prefill = acts + scores + 4 * v * f32
  upcast = 0
  if jnp.dtype(dtype).itemsize < f32:
    upcast = max(v * cfg.embed_dim // m, 2 * cfg.mlp_dim * cfg.embed_dim // m) * f32
  return max(decode, prefill) + upcast


def _notes(cfg, sizes: dict[str, int]) -> tuple[str, ...]:
  notes = []
  m = sizes["model"]
  if m > 1 and cfg.num_kv_heads % m:
    notes.append(f"kv_heads={cfg.num_kv_heads} does not divide model={m}: kv weights and the KV cache are "
                 "replicated over 'model' (the cache is split by batch over 'data' only)")
  return tuple(notes)


def _capacity(mesh: Mesh) -> int | None:
  device = mesh.devices.flat[0]
  if device.process_index != jax.process_index():
    device = next((d for d in mesh.devices.flat if d.process_index == jax.process_index()), device)
  stats = device.memory_stats()  # None on CPU
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def _fmt(n: int) -> str:
  if n >= 1 << 30:
    return f"{n / (1 << 30):.2f} GiB"
  if n >= _MIB:
    return f"{n / _MIB:.1f} MiB"
  return f"{n / 1024:.1f} KiB"


def _mesh_str(sizes: dict[str, int]) -> str:
  return " x ".join(f"{k}={v}" for k, v in sizes.items())
