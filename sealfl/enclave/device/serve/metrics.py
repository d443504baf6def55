"""Prometheus metrics of ``sealfl device serve`` (``GET /metrics``, text format 0.0.4).

Names follow Prometheus's naming practice (prometheus.io/docs/practices/naming/): a
``sealfl_llm_`` prefix, base units (seconds, bytes, a 0..1 ratio), ``_total`` on counters
(prometheus-client appends it), and label values from fixed sets only -- ``reason`` of a
rejection is one of :data:`REJECT_REASONS`, ``finish_reason`` one of :data:`FINISH_REASONS`,
``endpoint`` one of :data:`ENDPOINTS`; no label ever carries client input.

Families (one :class:`ServeMetrics` per server, in its own registry):

===================================================  =========  ==========================================
``sealfl_llm_time_to_first_token_seconds``           histogram  request received -> first token generated
``sealfl_llm_inter_token_latency_seconds``           histogram  between consecutive generated tokens
``sealfl_llm_prompt_tokens_total``                   counter    prompt tokens of accepted requests
``sealfl_llm_generation_tokens_total``               counter    tokens generated
``sealfl_llm_requests_total{endpoint,finish_reason}``  counter  finished requests
``sealfl_llm_requests_running``                      gauge      requests holding a slot
``sealfl_llm_requests_waiting``                      gauge      requests queued for a slot (``--queue``)
``sealfl_llm_requests_rejected_total{reason}``       counter    refused requests
``sealfl_llm_slots``                                 gauge      ``--max-concurrent``
``sealfl_llm_kv_cache_usage_ratio``                  gauge      tokens held in KV caches / (slots x context)
``sealfl_llm_model_verification_failures_total``     counter    releases refused at boot
``sealfl_llm_worker_restarts_total``                 counter    sandboxed children restarted after a crash
``sealfl_llm_release_switches_total``                counter    switches to a newer release while serving
``sealfl_llm_update_checks_total{result}``           counter    ``--repo`` polls: installed, current, refused
``sealfl_llm_model_loaded``                          gauge      1 once a verified model serves
``sealfl_llm_release_info{name,version,variant,root_digest}``  gauge  1 for the served release
``sealfl_llm_worker_resident_memory_bytes``          gauge      RSS of the sandboxed children (sum)
``sealfl_oip_infer_requests_total{status}``         counter    tabular /v2 infer requests by HTTP status
``sealfl_oip_infer_rows_total``                      counter    rows scored through /v2 infer
``sealfl_oip_infer_seconds``                         histogram  model time per /v2 infer request
``process_resident_memory_bytes`` and friends        (prometheus-client's process collector: the server)
===================================================  =========  ==========================================
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

__all__ = ["ServeMetrics", "REJECT_REASONS", "FINISH_REASONS", "ENDPOINTS", "UPDATE_RESULTS", "CONTENT_TYPE", "rss_bytes"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REJECT_REASONS = ("busy", "queue_timeout", "invalid", "not_ready", "unknown_model", "context")
FINISH_REASONS = ("stop", "length", "cancelled", "error")
#: results of an update check (``device serve --repo``)
UPDATE_RESULTS = ("installed", "current", "kept", "refused")
ENDPOINTS = ("chat", "completion")

# Latency buckets, seconds: first tokens of 10 ms .. 10 s; token gaps of 1 ms .. 1 s.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (``VmRSS`` of ``/proc/PID/status``; 0 if gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class ServeMetrics:
    """The server's metrics (module docstring).

    Args:
        slots: ``--max-concurrent``.
        worker_pids: returns the pids of the sandboxed children (for their RSS).
    """

    def __init__(self, slots: int, worker_pids: Callable[[], Iterable[int]] = tuple) -> None:
        # no ``*_created`` series: they are OpenMetrics' and only clutter the 0.0.4 text format
        # (process-wide switch of prometheus-client; the server process is ours)
        disable_created_metrics()
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        self._lock = threading.Lock()
        self._kv: dict[int, int] = {}
        self._slots = max(1, int(slots))
        self._capacity = self._slots
        self.ttft = Histogram("sealfl_llm_time_to_first_token_seconds", "Time from a request's arrival to its first "
                              "generated token.", buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("sealfl_llm_inter_token_latency_seconds", "Time between consecutive generated tokens of "
                             "a request.", buckets=_ITL_BUCKETS, registry=r)
        self.prompt_tokens = Counter("sealfl_llm_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("sealfl_llm_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("sealfl_llm_requests", "Finished generation requests.",
                                ["endpoint", "finish_reason"], registry=r)
        self.running = Gauge("sealfl_llm_requests_running", "Requests holding a generation slot.", registry=r)
        self.waiting = Gauge("sealfl_llm_requests_waiting", "Requests waiting in the queue for a slot.", registry=r)
        self.rejected = Counter("sealfl_llm_requests_rejected", "Requests refused, by reason.", ["reason"],
                                registry=r)
        self.slots = Gauge("sealfl_llm_slots", "Generation slots (--max-concurrent).", registry=r)
        self.kv_usage = Gauge("sealfl_llm_kv_cache_usage_ratio", "Tokens held in the slots' KV caches over their "
                              "capacity (slots x context).", registry=r)
        self.verification_failures = Counter("sealfl_llm_model_verification_failures", "Releases refused at boot "
                                             "(verification, canary, runtime).", registry=r)
        self.worker_restarts = Counter("sealfl_llm_worker_restarts", "Sandboxed model children restarted after they "
                                       "died.", registry=r)
        self.release_switches = Counter("sealfl_llm_release_switches", "Switches to a newer verified release while "
                                        "serving (--repo --poll).", registry=r)
        self.update_checks = Counter("sealfl_llm_update_checks", "Update checks of --repo, by result.", ["result"],
                                     registry=r)
        for result in UPDATE_RESULTS:
            self.update_checks.labels(result)
        self.loaded = Gauge("sealfl_llm_model_loaded", "1 once a verified model is loaded and serving.", registry=r)
        self.release_info = Gauge("sealfl_llm_release_info", "The served release (value 1).",
                                  ["name", "version", "variant", "root_digest"], registry=r)
        self.infer_requests = Counter("sealfl_oip_infer_requests", "Open Inference Protocol /infer requests, by "
                                      "HTTP status.", ["status"], registry=r)
        self.infer_rows = Counter("sealfl_oip_infer_rows", "Rows scored through /infer.", registry=r)
        self.infer_seconds = Histogram("sealfl_oip_infer_seconds", "Time the sandboxed model took per /infer "
                                       "request.", buckets=_ITL_BUCKETS, registry=r)
        self.worker_rss = Gauge("sealfl_llm_worker_resident_memory_bytes", "Resident memory of the sandboxed model "
                                "children, summed.", registry=r)
        self.worker_rss.set_function(lambda: float(sum(rss_bytes(p) for p in worker_pids())))
        self.slots.set(slots)
        for reason in REJECT_REASONS:  # every bounded label value exists from the start
            self.rejected.labels(reason)
        for e in ENDPOINTS:
            for f in FINISH_REASONS:
                self.requests.labels(e, f)

    def set_context(self, max_context: int) -> None:
        """The loaded release's context limit (tokens per slot's KV cache)."""
        self._capacity = self._slots * max(1, int(max_context))

    def reject(self, reason: str) -> None:
        """Count a refused request (``reason`` in :data:`REJECT_REASONS`)."""
        self.rejected.labels(reason if reason in REJECT_REASONS else "invalid").inc()

    def kv_tokens(self, slot: int, tokens: int) -> None:
        """Record how many tokens slot ``slot``'s KV cache holds now (0 when free)."""
        with self._lock:
            self._kv[slot] = max(0, int(tokens))
            self.kv_usage.set(min(1.0, sum(self._kv.values()) / self._capacity))

    def finished(self, endpoint: str, finish_reason: str) -> None:
        """Count a finished request."""
        self.requests.labels(endpoint if endpoint in ENDPOINTS else "chat",
                             finish_reason if finish_reason in FINISH_REASONS else "error").inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)

