"""Prometheus metrics for one server app, on a private registry.

A private ``CollectorRegistry`` per app keeps two apps in one process (tests,
an embedding program) from colliding on metric names. Counters and
histograms are fed when a request ends; the engine gauges are read from
``AsyncEngine.stats()`` at scrape time.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from atom.outputs import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineTotal:
    """A counter fed from a running total the engine keeps: each scrape adds what it gained since the last."""

    def __init__(self, counter: Counter) -> None:
        self.counter, self.seen = counter, 0

    def update(self, total: float) -> None:
        self.counter.inc(total - self.seen)
        self.seen = total


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("atom_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("atom_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("atom_generation_tokens", "Generated tokens", registry=r)
        self.running = Gauge("atom_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("atom_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("atom_kv_block_usage", "Fraction of KV cache blocks in use", registry=r)
        self.slot_usage = Gauge("atom_state_slot_usage", "Fraction of recurrent state slots in use", registry=r)
        self.buffer_lent = Gauge("atom_kv_transfer_buffer_bytes_lent",
                                 "P/D: bytes of the connector's host buffer lent to transfers now", registry=r)
        # totals the engine keeps, by their key in AsyncEngine.stats()
        self.engine_totals = {
            "kv_transfer_staged_bytes": EngineTotal(Counter(
                "atom_kv_transfer_staged_bytes", "P/D: bytes gathered into or scattered from the connector's host "
                "buffer", registry=r)),
            "deferred_steps": EngineTotal(Counter(
                "atom_deferred_decode_steps", "Decode steps that returned before their tokens reached the host "
                "(async scheduling)", registry=r)),
        }
        self.spec_drafted = Counter("atom_spec_decode_draft_tokens", "Draft tokens proposed and verified",
                                    registry=r)
        self.spec_accepted = Counter("atom_spec_decode_accepted_tokens", "Draft tokens accepted", registry=r)
        self.spec_accept_len = Histogram(
            "atom_spec_decode_acceptance_length", "Per finished request: tokens emitted per verification step",
            buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8), registry=r)
        self.ttft = Histogram("atom_time_to_first_token_seconds", "Time to first token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("atom_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("atom_e2e_request_latency_seconds", "Arrival to last token", buckets=_E2E_BUCKETS,
                             registry=r)

    def observe_finished(self, out: RequestOutput, finish_reason: str | None = None) -> None:
        """Record one ended request; ``finish_reason`` overrides the output's (e.g. "abort" on disconnect)."""
        completion = out.outputs[0]
        reason = finish_reason or completion.finish_reason or "abort"
        num_generated = len(completion.token_ids)
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(num_generated)
        metrics = out.metrics
        drafted, accepted = metrics.get("num_draft_tokens", 0), metrics.get("num_accepted_tokens", 0)
        if drafted:
            self.spec_drafted.inc(drafted)
            self.spec_accepted.inc(accepted)
            steps = metrics.get("num_verify_steps", 0)
            if steps:
                self.spec_accept_len.observe((accepted + steps) / steps)
        if "e2e" in metrics:
            self.e2e.observe(metrics["e2e"])
        if "ttft" in metrics:
            self.ttft.observe(metrics["ttft"])
            if "e2e" in metrics and num_generated > 1:
                self.tpot.observe((metrics["e2e"] - metrics["ttft"]) / (num_generated - 1))

    def render(self, engine_stats: dict[str, float]) -> bytes:
        self.running.set(engine_stats["num_running"])
        self.waiting.set(engine_stats["num_waiting"])
        self.kv_usage.set(engine_stats["kv_block_usage"])
        self.slot_usage.set(engine_stats["state_slot_usage"])
        self.buffer_lent.set(engine_stats.get("kv_transfer_buffer_bytes_lent", 0))
        for key, total in self.engine_totals.items():
            total.update(engine_stats.get(key, 0))
        return generate_latest(self.registry)
