"""The serving worker's counters, rendered for ``/metrics`` (Prometheus text format)."""

from __future__ import annotations

import collections
import threading


class Metrics:
    """Counters for ``/metrics`` (Prometheus text format)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = collections.Counter()  # by outcome: ok, error, cancelled, rejected
        self.prompt_tokens = self.generated_tokens = self.steps = self.verify_steps = self.accepted = 0
        self.busy_seconds = 0.0
        # engine steps of a running batch: prefills of joining rows (every running row waits meanwhile), decoding
        self.prefill_seconds = self.decode_seconds = 0.0
        self.batch_size = 0

    def count(self, outcome: str) -> None:
        with self.lock:
            self.requests[outcome] += 1

    def record_step(self, new_tokens: int, accepted: int, first: bool) -> None:
        with self.lock:
            self.generated_tokens += new_tokens
            self.steps += 1
            if not first:
                self.verify_steps += 1
                self.accepted += accepted

    def record_time(self, seconds: float, prefill: bool) -> None:
        with self.lock:
            if prefill:
                self.prefill_seconds += seconds
            else:
                self.decode_seconds += seconds

    def render(self, queue_depth: int, running: int, drafter: str) -> str:
        with self.lock:
            rate = self.generated_tokens / self.busy_seconds if self.busy_seconds else 0.0
            mean_accepted = self.accepted / self.verify_steps if self.verify_steps else 0.0
            lines = ["# HELP eagle_requests_total Requests by outcome.", "# TYPE eagle_requests_total counter"]
            lines += [f'eagle_requests_total{{outcome="{k}"}} {self.requests[k]}'
                      for k in ("ok", "error", "cancelled", "rejected")]
            for name, kind, value, text in [
                ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of finished requests."),
                ("generated_tokens_total", "counter", self.generated_tokens, "Generated tokens."),
                ("steps_total", "counter", self.steps,
                 "Generation steps per request (prefills included; a batched step counts once per request)."),
                ("busy_seconds_total", "counter", round(self.busy_seconds, 6), "Seconds the model was generating."),
                ("prefill_seconds_total", "counter", round(self.prefill_seconds, 6),
                 "Seconds of prompt prefills (joining requests; the running batch waits meanwhile)."),
                ("decode_seconds_total", "counter", round(self.decode_seconds, 6),
                 "Seconds of decoding steps (draft and verification, or one plain step) of running batches."),
                ("tokens_per_second", "gauge", round(rate, 4), "Generated tokens per busy second."),
                ("mean_accepted_tokens_per_step", "gauge", round(mean_accepted, 4),
                 f"Accepted draft tokens per verification step (default drafter: {drafter})."),
                ("queue_depth", "gauge", queue_depth, "Requests waiting for the model."),
                ("running_requests", "gauge", running, "Requests being generated."),
                ("batch_size", "gauge", self.batch_size, "Requests in the batch running now."),
            ]:
                lines += [f"# HELP eagle_{name} {text}", f"# TYPE eagle_{name} {kind}", f"eagle_{name} {value}"]
        return "\n".join(lines) + "\n"
