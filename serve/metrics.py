"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own per app.

Per-request figures are recorded when a request finishes (finish reasons, token counts, TTFT and
TPOT histograms: prefill and decode kept apart, as everywhere in jaxgen); engine figures (queue,
running rows, KV-cache use, prefix-cache and speculation counters, compilations since warm-up)
are read from the loop's latest snapshot when scraped.
"""

from __future__ import annotations

from jaxgen.decode import compiles
from jaxgen.decode.outputs import RequestOutput
from jaxgen.serve.loop import EngineLoop
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
# (metric name, engine.metrics() key, help): counters the engine keeps
_ENGINE_COUNTERS = (
    ("jaxgen_prefill_tokens", "prefill_tokens", "Prompt tokens prefilled (prefix-cache hits excluded)."),
    ("jaxgen_decode_tokens", "decode_tokens", "Tokens made by decode steps."),
    ("jaxgen_prefill_seconds", "prefill_s", "Device seconds spent in prefill."),
    ("jaxgen_decode_seconds", "decode_s", "Device seconds spent in decode steps."),
    ("jaxgen_prefix_cache_query_tokens", "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache."),
    ("jaxgen_prefix_cache_hit_tokens", "prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache."),
    ("jaxgen_spec_draft_tokens", "spec_draft_tokens", "Speculative tokens proposed."),
    ("jaxgen_spec_accepted_tokens", "spec_accepted_tokens", "Speculative tokens accepted."),
)


class Metrics:
  def __init__(self, loop: EngineLoop):
    self.registry = CollectorRegistry()
    r = self.registry
    self.requests = Counter("jaxgen_requests", "Completions finished, by finish reason.", ["finish_reason"], registry=r)
    self.rejected = Counter("jaxgen_requests_rejected", "Requests refused before queueing, by HTTP status.",
                            ["status"], registry=r)
    self.prompt_tokens = Counter("jaxgen_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
    self.generation_tokens = Counter("jaxgen_generation_tokens", "Tokens generated for finished requests.", registry=r)
    self.ttft = Histogram("jaxgen_time_to_first_token_seconds", "Time to first token (queue and prefill).",
                          buckets=_LATENCY, registry=r)
    self.tpot = Histogram("jaxgen_time_per_output_token_seconds", "Decode time per output token after the first.",
                          buckets=_PER_TOKEN, registry=r)
    self.e2e = Histogram("jaxgen_e2e_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY, registry=r)
    r.register(_EngineCollector(loop))

  def on_finish(self, out: RequestOutput) -> None:
    """Records one finished request (called on the engine loop's thread)."""
    m = out.metrics
    for c in out.outputs:
      self.requests.labels(c.finish_reason).inc()
      self.generation_tokens.inc(len(c.token_ids))
    self.prompt_tokens.inc(len(out.prompt_token_ids))
    if m.ttft_s is not None:
      self.ttft.observe(max(m.ttft_s, 0.0))
    if m.tpot_s is not None:
      self.tpot.observe(m.tpot_s)
    if m.finished_time is not None:
      self.e2e.observe(m.finished_time - m.arrival_time)


class _EngineCollector:
  """Reads the loop's latest engine snapshot at scrape time."""

  def __init__(self, loop: EngineLoop):
    self.loop = loop

  def collect(self):
    snap, loop = self.loop.snapshot, self.loop

    def gauge(name, doc, value):
      return GaugeMetricFamily(name, doc, value=float(value))

    yield gauge("jaxgen_requests_waiting", "Requests waiting for a cache slot.", loop.waiting)
    yield gauge("jaxgen_requests_running", "Rows decoding in the latest step.", snap["running"])
    yield gauge("jaxgen_requests_unfinished", "Requests accepted and not yet finished.", loop.unfinished)
    yield gauge("jaxgen_slots", "Cache slots (max_batch).", snap["slots"])
    yield gauge("jaxgen_kv_cache_usage_ratio", "Share of the KV cache's bytes holding tokens.",
                snap["kv_cache_bytes_in_use"] / max(snap["kv_cache_bytes_allocated"], 1))
    yield gauge("jaxgen_ready", "1 once warm-up finished.", loop.ready.is_set())
    for name, key, doc in _ENGINE_COUNTERS:
      yield CounterMetricFamily(name, doc, value=float(snap.get(key) or 0))
    if loop.compiles_at_ready is not None:
      yield CounterMetricFamily("jaxgen_compilations_after_warmup", "XLA compilations since warm-up finished "
                                "(0 when every shape is bucketed).", value=compiles.count() - loop.compiles_at_ready)
