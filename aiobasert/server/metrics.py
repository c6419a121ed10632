"""`GET /metrics`: Prometheus text via prometheus_client, names that pass
`promtool check metrics` (`aiobasert_` prefix; counters end in `_total`), with
vLLM's meanings where vLLM has the metric.

| metric | vLLM counterpart |
|---|---|
| `aiobasert_time_to_first_token_seconds` (histogram) | `vllm:time_to_first_token_seconds` |
| `aiobasert_inter_token_latency_seconds` (histogram) | `vllm:inter_token_latency_seconds` |
| `aiobasert_e2e_request_latency_seconds` (histogram) | `vllm:e2e_request_latency_seconds` |
| `aiobasert_request_queue_time_seconds` (histogram) | `vllm:request_queue_time_seconds` |
| `aiobasert_num_requests_running` / `_waiting` (gauges) | `vllm:num_requests_running` / `_waiting` |
| `aiobasert_prompt_tokens_total` (counter) | `vllm:prompt_tokens_total` |
| `aiobasert_generation_tokens_total` (counter) | `vllm:generation_tokens_total` |
| `aiobasert_request_success_total` (counter, by `finished_reason`) | `vllm:request_success_total` |
| `aiobasert_requests_cancelled_total` (counter) | none: the client went away (disconnect, write timeout) |
| `aiobasert_requests_refused_total` (counter, by `status`, `code`) | none: 4xx answers, in-band ones included |
| `aiobasert_requests_failed_total` (counter, by `status`, `code`) | none: 5xx answers, in-band ones included |
| `aiobasert_kv_cache_usage_ratio` (gauge, 0 to 1) | `vllm:kv_cache_usage_perc`: what live requests hold |
| `aiobasert_kv_blocks_used` (gauge) | none: `EngineStats.kv_blocks_used`, the prefix cache's blocks included |
| `aiobasert_kv_blocks_cached` (gauge) | none: `EngineStats.prefix_blocks_cached` (evictable) |
| `aiobasert_kv_blocks_capacity` (gauge) | none: `EngineStats.kv_blocks_total` |
| `aiobasert_kv_cache_bytes` (gauge, labelled `kv_cache_dtype`) | `vllm:cache_config_info`'s `cache_dtype` |
| `aiobasert_prefix_cache_hits_total` / `_queries_total` (counters, tokens) | `vllm:prefix_cache_hits` / `_queries` |
| `aiobasert_num_preemptions_total` (counter) | `vllm:num_preemptions_total` (lanes taken back, docs/fairness.md) |
| `aiobasert_spec_decode_num_draft_tokens_total` (counter) | `vllm:spec_decode_num_draft_tokens` |
| `aiobasert_spec_decode_num_accepted_tokens_total` (counter) | `vllm:spec_decode_num_accepted_tokens` |
| `aiobasert_draft_prefix_cache_hits_total` (counter, tokens) | none: `EngineStats.draft_cached_tokens` |
| `aiobasert_event_loop_lag_seconds` (histogram) | none: how late the server's loop wakes |
| `aiobasert_abort_latency_seconds` (histogram) | none: client disconnect to lane freed |
| `aiobasert_build_info` (gauge, 1: `version`, `engine_version`, `abi`) | `vllm:cache_config_info`-style info |
| `process_*`, `python_info` | prometheus_client's process and platform collectors |

Every per-model metric carries a `model_name` label; the refused / failed
counters do not (a request can be refused before a model is chosen).
Latencies come from the engine's own timing of each request
(`Completion.timing`); inter-token latency is measured where the server
receives the tokens; token counters count each engine request (each choice of
an `n > 1` request) when it ends, a cancelled one with the tokens it had made;
gauges are read from `Engine.stats()` at scrape time. Each app has its own
registry, so several apps in one process do not collide. docs/operations.md
has recording rules that rebuild the former `aiobasert:` names.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import anyio
from starlette.responses import Response

from .._core.protocol import Final
from .._ffi import SUPPORTED_ABI
from ..engine import Engine

try:
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        CollectorRegistry,
        Counter,
        Gauge,
        Histogram,
        PlatformCollector,
        ProcessCollector,
        generate_latest,
    )
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError("aiobasert's /metrics needs prometheus_client: pip install 'aiobasert[server]'") from exc

_LATENCY = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LAG_INTERVAL_S = 0.1
"""How often the event-loop lag probe wakes."""


class _WithoutCreated:
    """A registry's metrics without the `_created` series prometheus_client adds to
    counters and histograms: the text format has no type for them, so Prometheus
    stores them as untyped series of their own and `promtool check metrics` finds
    them without help text. (`prometheus_client.disable_created_metrics()` would do
    it for the whole process, other registries of the user's included.)"""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class _BuildInfo(Collector):
    """`aiobasert_build_info`: this package's version, the ABI it speaks and the
    engine library's version (from the engines open at the last scrape)."""

    def __init__(self) -> None:
        self.engine_versions: set[str] = set()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        from .. import __version__

        family = GaugeMetricFamily(
            "aiobasert_build_info",
            "aiobasert's version, its baseRT ABI and the engine library's version (1).",
            labels=["version", "engine_version", "abi"],
        )
        for engine_version in sorted(self.engine_versions) or [""]:
            family.add_metric([__version__, engine_version, str(SUPPORTED_ABI)], 1)
        yield family


class Metrics:
    """The app's metrics and its registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, ["model_name"]
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.build_info = _BuildInfo()
        r.register(self.build_info)
        self.ttft = Histogram(
            "aiobasert_time_to_first_token_seconds", "Time to first token.", label, buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "aiobasert_inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            label,
            buckets=_FAST,
            registry=r,
        )
        self.e2e = Histogram(
            "aiobasert_e2e_request_latency_seconds", "Submission to last token.", label, buckets=_LATENCY, registry=r
        )
        self.queue = Histogram(
            "aiobasert_request_queue_time_seconds",
            "Submission to admission into a lane.",
            label,
            buckets=_LATENCY,
            registry=r,
        )
        self.running = Gauge("aiobasert_num_requests_running", "Requests holding a lane.", label, registry=r)
        self.waiting = Gauge("aiobasert_num_requests_waiting", "Requests waiting for a lane.", label, registry=r)
        self.kv_usage = Gauge(
            "aiobasert_kv_cache_usage_ratio",
            "Share of the KV pool live requests hold (the prefix cache's evictable blocks apart).",
            label,
            registry=r,
        )
        self.kv_used = Gauge(
            "aiobasert_kv_blocks_used",
            "KV cache blocks allocated, the prefix cache's included (EngineStats.kv_blocks_used).",
            label,
            registry=r,
        )
        self.kv_cached = Gauge(
            "aiobasert_kv_blocks_cached", "KV cache blocks held by the prefix cache (evictable).", label, registry=r
        )
        self.kv_capacity = Gauge("aiobasert_kv_blocks_capacity", "KV cache blocks in the pool.", label, registry=r)
        self.kv_bytes = Gauge(
            "aiobasert_kv_cache_bytes",
            "The KV pool's capacity in bytes, by element type.",
            [*label, "kv_cache_dtype"],
            registry=r,
        )
        self.prefix_hits = Counter(
            "aiobasert_prefix_cache_hits", "Prompt tokens served from the prefix cache.", label, registry=r
        )
        self.prefix_queries = Counter(
            "aiobasert_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", label, registry=r
        )
        self.prompt_tokens = Counter("aiobasert_prompt_tokens", "Prompt tokens of ended requests.", label, registry=r)
        self.generation_tokens = Counter(
            "aiobasert_generation_tokens", "Tokens generated, cancelled requests' too.", label, registry=r
        )
        self.success = Counter(
            "aiobasert_request_success", "Finished requests by finish reason.", [*label, "finished_reason"], registry=r
        )
        self.cancelled = Counter(
            "aiobasert_requests_cancelled",
            "Requests whose client went away (disconnected or too slow) before the end.",
            label,
            registry=r,
        )
        self.refused = Counter(
            "aiobasert_requests_refused",
            "Requests answered with a 4xx error (or error event), by status and error code.",
            ["status", "code"],
            registry=r,
        )
        self.failed = Counter(
            "aiobasert_requests_failed",
            "Requests answered with a 5xx error (or error event), by status and error code.",
            ["status", "code"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "aiobasert_event_loop_lag_seconds",
            "How late the server's event loop wakes from a timed sleep.",
            buckets=_FAST,
            registry=r,
        )
        self.preemptions = Counter(
            "aiobasert_num_preemptions",
            "Lanes taken back for another client's request (each resumed later).",
            label,
            registry=r,
        )
        self.spec_drafted = Counter(
            "aiobasert_spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified.",
            label,
            registry=r,
        )
        self.spec_accepted = Counter(
            "aiobasert_spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted.",
            label,
            registry=r,
        )
        self.draft_cached = Counter(
            "aiobasert_draft_prefix_cache_hits",
            "Speculative decoding from a draft model: prompt tokens its sequences took from its own prefix cache.",
            label,
            registry=r,
        )
        self._totals: dict[tuple[Counter, str], int] = {}
        """The engine's running totals at the last scrape, by counter and model (`_advance`)."""
        self.abort = Histogram(
            "aiobasert_abort_latency_seconds",
            "Client disconnect to its engine lane freed.",
            label,
            buckets=_FAST,
            registry=r,
        )

    def _advance(self, counter: Counter, model: str, total: int) -> None:
        """Move `counter` on by what the engine's running `total` gained since the last scrape (a
        reloaded engine counts from 0 again: that scrape adds nothing, the next count from there)."""
        last = self._totals.get((counter, model), 0)
        if total >= last:
            counter.labels(model).inc(total - last)
        self._totals[(counter, model)] = total

    def observer(self, model: str, engine: Engine) -> RequestObserver:
        return RequestObserver(self, model, engine)

    def count_error(self, status: int, code: str | None) -> None:
        """One request answered with an error (see oplog.py)."""
        counter = self.refused if status < 500 else self.failed
        counter.labels(str(status), code or "").inc()

    async def probe_loop_lag(self) -> None:
        """Forever: sleep LAG_INTERVAL_S and record how much later the loop woke."""
        while True:
            start = time.perf_counter()
            await anyio.sleep(LAG_INTERVAL_S)
            self.loop_lag.observe(max(0.0, time.perf_counter() - start - LAG_INTERVAL_S))

    async def render(self, models: Sequence[tuple[str, Engine]]) -> Response:
        versions: set[str] = set()
        for name, engine in models:
            if engine.closed:
                continue
            versions.add(engine.info.library_version)
            s = await engine.stats()
            self.running.labels(name).set(s.active_lanes)
            self.waiting.labels(name).set(s.waiting_requests)
            # The same counts as EngineStats: the engine counts the prefix cache's blocks as
            # used (~100% at idle once it fills). The usage ratio, like vLLM's, counts what
            # live requests hold, cache apart (a block one shares with the cache is cached).
            self.kv_used.labels(name).set(s.kv_blocks_used)
            self.kv_cached.labels(name).set(s.prefix_blocks_cached)
            self.kv_capacity.labels(name).set(s.kv_blocks_total)
            live = max(0, s.kv_blocks_used - s.prefix_blocks_cached)
            self.kv_usage.labels(name).set(live / s.kv_blocks_total if s.kv_blocks_total else 0.0)
            self.kv_bytes.labels(name, engine.info.kv_cache_dtype).set(s.kv_cache_bytes)
            self._advance(self.preemptions, name, s.requests_preempted)
            self._advance(self.spec_drafted, name, s.spec_draft_tokens)
            self._advance(self.spec_accepted, name, s.spec_accepted_tokens)
            self._advance(self.draft_cached, name, s.draft_cached_tokens)
        if versions:
            self.build_info.engine_versions = versions
        return Response(generate_latest(_WithoutCreated(self.registry)), media_type=CONTENT_TYPE_LATEST)


class RequestObserver:
    """One request's measurements: tokens as they reach the server, the engine's
    timing when it ends, and how long an abort took to free the lane."""

    def __init__(self, metrics: Metrics, model: str, engine: Engine) -> None:
        self._m = metrics
        self._model = model
        self._engine = engine
        self._last: float | None = None
        self._tokens = 0
        self._ended = False  # finished() counted it: a disconnect after the end is no cancel

    def token(self) -> None:
        self._tokens += 1
        now = time.perf_counter()
        if self._last is not None:
            self._m.itl.labels(self._model).observe(now - self._last)
        self._last = now

    def finished(self, final: Final | None) -> None:
        self._ended = True
        if final is None:  # it failed: no usage, no timing
            self._m.generation_tokens.labels(self._model).inc(self._tokens)
            return
        m, name, t = self._m, self._model, final.timing
        m.ttft.labels(name).observe(t.time_to_first_token_s)
        m.e2e.labels(name).observe(t.total_s)
        m.queue.labels(name).observe(t.queued_s)
        m.prefix_hits.labels(name).inc(final.usage.cached_prompt_tokens)
        m.prefix_queries.labels(name).inc(final.usage.prompt_tokens)
        m.prompt_tokens.labels(name).inc(final.usage.prompt_tokens)
        m.generation_tokens.labels(name).inc(final.usage.completion_tokens)
        m.success.labels(name, final.finish_reason).inc()

    async def aborted(self, since: float) -> None:
        """After a disconnect (its stream already closed): wait until the engine
        thread has handled the cancel (`Engine.stats`, answered by the engine thread
        after every message posted before it: cancels release the lane on intake)
        and record the time since `since`."""
        if not self._ended:
            self._ended = True
            self._m.cancelled.labels(self._model).inc()
            self._m.generation_tokens.labels(self._model).inc(self._tokens)
        engine = self._engine
        if engine.closed:
            return
        with anyio.move_on_after(10, shield=True) as scope:
            try:
                await engine.stats()
            except Exception:  # the engine closed meanwhile: nothing to measure
                return
        if scope.cancelled_caught:
            return
        self._m.abort.labels(self._model).observe(time.perf_counter() - since)
