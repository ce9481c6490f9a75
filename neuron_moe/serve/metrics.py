"""`GET /metrics`: the server's counters in Prometheus' text format (`prometheus-client`).

Named after vLLM's where they mean the same thing, so that dashboards and alerts written for vLLM
read these unchanged (label `model_name`); what only this server has is `neuron_moe:*`:

    vllm:num_requests_running              gauge      requests in a row of the batch (or a thread)
    vllm:num_requests_waiting              gauge      admitted, waiting for one
    vllm:prompt_tokens_total               counter    prompt tokens of the requests prefilled
    vllm:generation_tokens_total           counter    tokens generated (an EOS counts, as in usage)
    vllm:request_success_total             counter    requests ended, by finished_reason: stop,
                                                      length, abort (cancelled, failed, drained)
    vllm:time_to_first_token_seconds       histogram  admission -> first token
    vllm:time_per_output_token_seconds     histogram  the gap before each later token
    vllm:request_time_per_output_token_seconds  histogram  per request: (e2e - ttft) / (tokens - 1)
    vllm:e2e_request_latency_seconds       histogram  admission -> last token
    vllm:prefix_cache_queries              counter    prompt tokens of the requests looked up in the
                                                      prefix cache (each request once, at admission)
    vllm:prefix_cache_hits                 counter    of those, the tokens taken from a held prefix
    vllm:spec_decode_num_drafts            counter    speculative decoding: rows' verify steps that
                                                      checked drafted tokens
    vllm:spec_decode_num_draft_tokens      counter    the tokens they checked
    vllm:spec_decode_num_accepted_tokens   counter    of those, the tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos  counter  the same by draft position (label
                                                      `position`, from 0): per-position acceptance
                                                      is it over num_drafts
    neuron_moe:batch_rows                  gauge      rows of the batching engine's graphs
    neuron_moe:batch_rows_in_use           gauge      rows holding a request now
    neuron_moe:prefill_calls_total         counter    prefill graph calls
    neuron_moe:prefill_rows_total          counter    prompts (or pieces of one) those calls held
    neuron_moe:decode_calls_total          counter    decode graph calls
    neuron_moe:decode_rows_total           counter    rows that generated a token in them
    neuron_moe:copy_calls_total            counter    copy graph calls (a held prefix into another row)

Everything is counted where it happens: the request-level series by `scheduler.Job`, which every
request passes through from admission to its end whatever the engine, the graph calls and rows
by the engine (`engine.py`), the drafts by the engine's verify step (`spec_decoded`), the
gauges read at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # prometheus_client.CONTENT_TYPE_LATEST
REASONS = ("stop", "length", "abort")
_TTFT_S = (
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
    160.0,
    640.0,
)
_TPOT_S = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
_E2E_S = (
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)


class Metrics:
    """One server's series, in a registry of its own (never the process-wide default one)."""

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry(auto_describe=True)
        label = {"model_name": model_name}

        def series(kind, name, doc, **kw):
            return kind(name, doc, list(label), registry=registry, **kw).labels(**label)

        self.running = series(Gauge, "vllm:num_requests_running", "Requests generating now.")
        self.waiting = series(Gauge, "vllm:num_requests_waiting", "Requests admitted, waiting to run.")
        self.prompt_tokens = series(Counter, "vllm:prompt_tokens", "Prompt tokens of the requests prefilled.")
        self.generation_tokens = series(Counter, "vllm:generation_tokens", "Tokens generated (an EOS counts).")
        success = Counter(
            "vllm:request_success",
            "Requests ended, by finished reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.success = {reason: success.labels(model_name=model_name, finished_reason=reason) for reason in REASONS}
        self.ttft = series(Histogram, "vllm:time_to_first_token_seconds", "Admission to first token.", buckets=_TTFT_S)
        self.tpot = series(
            Histogram, "vllm:time_per_output_token_seconds", "The gap before each token but the first.", buckets=_TPOT_S
        )
        self.request_tpot = series(
            Histogram,
            "vllm:request_time_per_output_token_seconds",
            "Per request: (e2e - ttft) / (tokens - 1).",
            buckets=_TPOT_S,
        )
        self.e2e = series(Histogram, "vllm:e2e_request_latency_seconds", "Admission to the last token.", buckets=_E2E_S)
        self.prefix_cache_queries = series(
            Counter, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = series(
            Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.rows = series(Gauge, "neuron_moe:batch_rows", "Rows of the batching engine's graphs.")
        self.rows_in_use = series(Gauge, "neuron_moe:batch_rows_in_use", "Rows holding a request now.")
        self.prefill_calls = series(Counter, "neuron_moe:prefill_calls", "Prefill graph calls.")
        self.prefill_rows = series(Counter, "neuron_moe:prefill_rows", "Prompts (or pieces of one) in those calls.")
        self.decode_calls = series(Counter, "neuron_moe:decode_calls", "Decode graph calls.")
        self.decode_rows = series(Counter, "neuron_moe:decode_rows", "Rows that generated a token in those calls.")
        self.copy_calls = series(Counter, "neuron_moe:copy_calls", "Copy graph calls (a held prefix into a row).")
        self.spec_drafts = series(Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = series(Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = series(
            Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self._spec_per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["model_name", "position"],
            registry=registry,
        )
        self._model_name = model_name

    def spec_decoded(self, drafted: list[int], accepted: list[int]) -> None:
        """One verify step, per row: the tokens drafted for it and how many of them were accepted (the
        first `accepted`, in order). A row with no drafts (prompt lookup found none) is no draft, as
        vLLM counts."""
        for row_drafted, row_accepted in zip(drafted, accepted, strict=True):
            if row_drafted <= 0:
                continue
            self.spec_drafts.inc()
            self.spec_draft_tokens.inc(row_drafted)
            self.spec_accepted_tokens.inc(row_accepted)
            for position in range(row_accepted):
                self._spec_per_position.labels(model_name=self._model_name, position=str(position)).inc()

    def watch(self, load) -> None:
        """`load()` -> (running, waiting, rows, rows in use; the last two None without a batch),
        read at every scrape."""
        self._load = load

    def render(self) -> bytes:
        running, waiting, rows, in_use = self._load() if hasattr(self, "_load") else (0, 0, None, None)
        self.running.set(running)
        self.waiting.set(waiting)
        self.rows.set(rows or 0)
        self.rows_in_use.set(in_use or 0)
        return generate_latest(self.registry)


class RequestClock:
    """One request's times, from its admission: observed into `metrics` as its tokens come."""

    def __init__(self, metrics: Metrics | None, now: float):
        self.metrics, self.start, self.last, self.first = metrics, now, now, None
        self.tokens = 0

    def token(self, now: float, prompt_tokens: int) -> None:
        m = self.metrics
        if m is None:
            return
        if self.first is None:
            self.first = now
            m.ttft.observe(now - self.start)
            m.prompt_tokens.inc(prompt_tokens)
        else:
            m.tpot.observe(now - self.last)
        self.last, self.tokens = now, self.tokens + 1
        m.generation_tokens.inc()

    def end(self, reason: str | None) -> None:
        m = self.metrics
        if m is None:
            return
        m.success[reason if reason in ("stop", "length") else "abort"].inc()
        if self.first is not None and reason is not None:
            m.e2e.observe(self.last - self.start)
            if self.tokens > 1:
                m.request_tpot.observe((self.last - self.first) / (self.tokens - 1))
