"""The engine's counters, one typed field each, and the plain snapshot `Engine.metrics()` returns.

Prefill and decode are kept apart in every figure; compile time is in neither. The scheduler
counts moves and prefix lookups, the runner device time and steps, the output processor tokens
and speculation's acceptances: each writes its own fields of one shared `Stats`.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxgen.decode.prefix_index import BLOCK


@dataclasses.dataclass
class Stats:
  prefill_tokens: int = 0
  prefill_calls: int = 0
  prefill_s: float = 0.0  # device time, compile time excluded
  decode_tokens: int = 0
  decode_steps: int = 0
  decode_s: float = 0.0
  compile_s: float = 0.0
  moves: int = 0  # rows moved by compaction
  decode_rows: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # row bucket: steps
  prefix_queries: int = 0
  prefix_query_tokens: int = 0
  prefix_hits: int = 0
  prefix_hit_tokens: int = 0
  prefix_saved_blocks: int = 0
  spec_steps: int = 0
  spec_draft_tokens: int = 0
  spec_accepted_tokens: int = 0
  spec_proposing_rows: int = 0

  def clear(self) -> None:
    for f in dataclasses.fields(self):
      setattr(self, f.name, f.default_factory() if f.default is dataclasses.MISSING else f.default)


def snapshot(config, stats: Stats, scheduler) -> dict:
  """A plain dict of the engine now: occupancy, cache use, per-phase throughput, prefix cache and
  speculation (vLLM's names where vLLM has the figure)."""
  slots = scheduler.slots
  occupied = [s for s in slots if s is not None]
  running = [s for s in occupied if s.running]
  used = sum(len(s.req.prompt_ids) + len(s.token_ids) for s in occupied)
  cfg, st, cache = config.model, stats, config.cache
  return dict(
      running=len(running), prefilling=len(occupied) - len(running), waiting=len(scheduler.waiting),
      slots=len(slots), slot_occupancy=len(occupied) / len(slots),
      kv_cache_bytes_allocated=cache.total_bytes(cfg),
      kv_cache_bytes_in_use=int(min(used, len(occupied) * config.max_len) * cache.bytes_per_token(cfg)),
      kv_cache_bytes_per_slot=cache.bytes_per_slot(cfg),
      prefill_tokens=st.prefill_tokens, decode_tokens=st.decode_tokens,
      prefill_s=st.prefill_s, decode_s=st.decode_s, compile_s=st.compile_s,
      prefill_tok_s=st.prefill_tokens / st.prefill_s if st.prefill_s else None,
      decode_tok_s=st.decode_tokens / st.decode_s if st.decode_s else None,
      decode_steps=st.decode_steps, row_moves=st.moves, decode_rows=dict(sorted(st.decode_rows.items())),
      **_prefix(config, st, scheduler.index), **_speculation(config, st))


def _speculation(config, st: Stats) -> dict:
  """Proposals made and accepted; the mean accepted length counts the token every verify row
  emits after its accepted proposals (vLLM's mean acceptance length)."""
  spec, rows = config.speculative, st.spec_proposing_rows
  return dict(
      speculative=None if spec is None else f"{spec.method}:{spec.k}",
      spec_verify_steps=st.spec_steps, spec_draft_tokens=st.spec_draft_tokens,
      spec_accepted_tokens=st.spec_accepted_tokens,
      spec_acceptance_rate=st.spec_accepted_tokens / st.spec_draft_tokens if st.spec_draft_tokens else None,
      spec_mean_accepted_length=1 + st.spec_accepted_tokens / rows if rows else None)


def _prefix(config, st: Stats, index) -> dict:
  """vLLM's prefix-cache figures: hit rate = prompt tokens reused / prompt tokens looked up."""
  on = index is not None
  queried = st.prefix_query_tokens
  return dict(
      prefix_cache=on, prefix_cache_note=config.prefix_note,
      prefix_cache_blocks=config.store.usable if on else 0, prefix_cache_block_size=BLOCK,
      prefix_cache_blocks_used=len(index) if on else 0,
      prefix_cache_bytes=config.store.total_bytes(config.model) if on else 0,
      prefix_cache_queries=st.prefix_queries, prefix_cache_hits=st.prefix_hits,
      prefix_cache_query_tokens=queried, prefix_cache_hit_tokens=st.prefix_hit_tokens,
      prefix_cache_hit_rate=st.prefix_hit_tokens / queried if queried else None,
      prefix_cache_saved_blocks=st.prefix_saved_blocks,
      prefix_cache_evictions=index.evictions if on else 0)
