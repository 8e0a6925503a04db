"""One timed run of a workload: what `bench throughput` prints and records of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunResult:
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    digest: str = ""  # of every request's output token ids, in request order
    outputs: list[Any] | None = field(default=None, repr=False)  # the RequestOutputs

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def figures(self, prefix: str = "") -> dict[str, Any]:
        names = ("elapsed_s", "num_requests", "prompt_tokens", "output_tokens")
        names += ("requests_per_s", "total_tokens_per_s", "output_tokens_per_s")
        return {prefix + name: getattr(self, name) for name in names}
