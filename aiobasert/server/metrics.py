"""`GET /metrics`: Prometheus text via prometheus_client, vLLM's meanings under
an `aiobasert:` prefix.

| metric | vLLM counterpart |
|---|---|
| `aiobasert:time_to_first_token_seconds` (histogram) | `vllm:time_to_first_token_seconds` |
| `aiobasert:inter_token_latency_seconds` (histogram) | `vllm:inter_token_latency_seconds` |
| `aiobasert:e2e_request_latency_seconds` (histogram) | `vllm:e2e_request_latency_seconds` |
| `aiobasert:request_queue_time_seconds` (histogram) | `vllm:request_queue_time_seconds` |
| `aiobasert:num_requests_running` / `_waiting` (gauges) | `vllm:num_requests_running` / `_waiting` |
| `aiobasert:kv_blocks_used` / `aiobasert:kv_blocks_total` (gauges) | `vllm:kv_cache_usage_perc` (as blocks) |
| `aiobasert:kv_blocks_cached` (gauge) | none: blocks the prefix cache holds (evictable) |
| `aiobasert:kv_cache_bytes` (gauge, labelled `kv_cache_dtype`) | `vllm:cache_config_info`'s `cache_dtype` |
| `aiobasert:prefix_cache_hits_total` / `_queries_total` (counters, tokens) | `vllm:prefix_cache_hits` / `_queries` |
| `aiobasert:request_success_total` (counter, by finish reason) | `vllm:request_success_total` |
| `aiobasert:num_preemptions_total` (counter) | `vllm:num_preemptions_total` (lanes taken back, docs/fairness.md) |
| `aiobasert:event_loop_lag_seconds` (histogram) | none: how late the server's loop wakes |
| `aiobasert:abort_latency_seconds` (histogram) | none: client disconnect to lane freed |

Every metric carries a `model_name` label. Latencies come from the engine's own
timing of each request (`Completion.timing`); inter-token latency is measured
where the server receives the tokens; gauges are read from `Engine.stats()` at
scrape time. Each app has its own registry, so several apps in one process do
not collide.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
from starlette.responses import Response

from ..engine import Engine
from ..engine_thread import Final

try:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError("aiobasert's /metrics needs prometheus_client: pip install 'aiobasert[server]'") from exc

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0)
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LAG_INTERVAL_S = 0.1
"""How often the event-loop lag probe wakes."""


class Metrics:
    """The app's metrics and its registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, ["model_name"]
        self.ttft = Histogram("aiobasert:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("aiobasert:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             label, buckets=_FAST, registry=r)
        self.e2e = Histogram("aiobasert:e2e_request_latency_seconds", "Submission to last token.", label,
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("aiobasert:request_queue_time_seconds", "Submission to admission into a lane.",
                               label, buckets=_LATENCY, registry=r)
        self.running = Gauge("aiobasert:num_requests_running", "Requests holding a lane.", label, registry=r)
        self.waiting = Gauge("aiobasert:num_requests_waiting", "Requests waiting for a lane.", label, registry=r)
        self.kv_used = Gauge("aiobasert:kv_blocks_used",
                             "KV cache blocks held by live sequences (beyond the prefix cache's).", label, registry=r)
        self.kv_cached = Gauge("aiobasert:kv_blocks_cached", "KV cache blocks held by the prefix cache (evictable).",
                               label, registry=r)
        self.kv_total = Gauge("aiobasert:kv_blocks_total", "KV cache blocks in the pool.", label, registry=r)
        self.kv_bytes = Gauge("aiobasert:kv_cache_bytes", "The KV pool's capacity in bytes, by element type.",
                              [*label, "kv_cache_dtype"], registry=r)
        self.prefix_hits = Counter("aiobasert:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                   label, registry=r)
        self.prefix_queries = Counter("aiobasert:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      label, registry=r)
        self.success = Counter("aiobasert:request_success", "Finished requests by finish reason.",
                               [*label, "finished_reason"], registry=r)
        self.loop_lag = Histogram("aiobasert:event_loop_lag_seconds",
                                  "How late the server's event loop wakes from a timed sleep.",
                                  buckets=_FAST, registry=r)
        self.preemptions = Counter("aiobasert:num_preemptions",
                                   "Lanes taken back for another client's request (each resumed later).",
                                   label, registry=r)
        self._preempted: dict[str, int] = {}  # the engine's count at the last scrape, by model
        self.abort = Histogram("aiobasert:abort_latency_seconds",
                               "Client disconnect to its engine lane freed.", label, buckets=_FAST, registry=r)

    def observer(self, model: str, engine: Engine) -> RequestObserver:
        return RequestObserver(self, model, engine)

    async def probe_loop_lag(self) -> None:
        """Forever: sleep LAG_INTERVAL_S and record how much later the loop woke."""
        while True:
            start = time.perf_counter()
            await anyio.sleep(LAG_INTERVAL_S)
            self.loop_lag.observe(max(0.0, time.perf_counter() - start - LAG_INTERVAL_S))

    async def render(self, models: Sequence[tuple[str, Engine]]) -> Response:
        for name, engine in models:
            if engine.closed:
                continue
            s = await engine.stats()
            self.running.labels(name).set(s.active_lanes)
            self.waiting.labels(name).set(s.waiting_requests)
            # The engine counts the prefix cache's blocks as used (~100% at idle once it
            # fills); like vLLM's usage, report what live requests hold, cache apart.
            # A block a live sequence shares with the cache counts as cached.
            self.kv_used.labels(name).set(max(0, s.kv_blocks_used - s.prefix_blocks_cached))
            self.kv_cached.labels(name).set(s.prefix_blocks_cached)
            self.kv_total.labels(name).set(s.kv_blocks_total)
            self.kv_bytes.labels(name, engine.info.kv_cache_dtype).set(s.kv_cache_bytes)
            last = self._preempted.get(name, 0)
            if s.requests_preempted >= last:  # (a reloaded engine counts from 0 again)
                self.preemptions.labels(name).inc(s.requests_preempted - last)
            self._preempted[name] = s.requests_preempted
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class RequestObserver:
    """One request's measurements: tokens as they reach the server, the engine's
    timing when it ends, and how long an abort took to free the lane."""

    def __init__(self, metrics: Metrics, model: str, engine: Engine) -> None:
        self._m = metrics
        self._model = model
        self._engine = engine
        self._last: float | None = None

    def token(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._m.itl.labels(self._model).observe(now - self._last)
        self._last = now

    def finished(self, final: Final | None) -> None:
        if final is None:
            return
        m, name, t = self._m, self._model, final.timing
        m.ttft.labels(name).observe(t.time_to_first_token_s)
        m.e2e.labels(name).observe(t.total_s)
        m.queue.labels(name).observe(t.queued_s)
        m.prefix_hits.labels(name).inc(final.usage.cached_prompt_tokens)
        m.prefix_queries.labels(name).inc(final.usage.prompt_tokens)
        m.success.labels(name, final.finish_reason).inc()

    async def aborted(self, since: float) -> None:
        """After a disconnect (its stream already closed): wait until the engine
        thread has handled the cancel (a barrier call queued behind it: cancels
        release the lane on intake) and record the time since `since`."""
        engine = self._engine
        if engine.closed:
            return
        with anyio.move_on_after(10, shield=True) as scope:
            try:
                await engine._call(lambda: None)
            except Exception:  # the engine closed meanwhile: nothing to measure
                return
        if scope.cancelled_caught:
            return
        self._m.abort.labels(self._model).observe(time.perf_counter() - since)
