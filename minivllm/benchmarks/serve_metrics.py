"""`bench serve`'s results: per-request timings -> vLLM's metrics, its printed table (the
same lines as `vllm bench serve`), the saved JSON, and latency-against-rate plots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# (key, name, header) as vLLM prints them
METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class RequestResult:
    """One request as the client saw it (times in seconds, perf_counter clock)."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


def _line(label: str, value: Any) -> str:
    fmt = "{:<40} {:<10.2f}" if isinstance(value, float) else "{:<40} {:<10}"
    return fmt.format(label, value)


def _peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """The most output tokens in any one second, and the most requests in flight in it."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    seconds = int(np.ceil(max(r.start_time + r.latency for r in ok) - t0)) + 1
    tokens, concurrent = np.zeros(seconds), np.zeros(seconds)
    for r in ok:
        token_times = np.cumsum([r.start_time + r.ttft, *r.itl])
        np.add.at(tokens, (token_times - t0).astype(int), 1)
        concurrent[int(r.start_time - t0) : int(r.start_time + r.latency - t0) + 1] += 1
    return float(tokens.max()), int(concurrent.max())


def summarize(
    results: list[RequestResult],
    duration: float,
    percentiles: list[float],
    metrics: list[str],
    max_concurrency: int | None,
    request_rate: float,
) -> dict[str, Any]:
    """Print vLLM's result table and return its result dict."""
    ok = [r for r in results if r.success]
    _print_failures([r for r in results if not r.success])
    result = _throughputs(ok, len(results) - len(ok), duration)
    lines = _throughput_lines(result, max_concurrency, request_rate)
    latencies = _latencies(ok)
    for key in metrics:
        lines += _latency_lines(key, latencies[key], percentiles, result)
    lines.append("=" * 50)
    print("\n".join(lines), flush=True)
    result.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_tokens for r in results],
        ttfts=[r.ttft for r in results],
        itls=[r.itl for r in results],
        latencies=[r.latency for r in results],
        start_times=[r.start_time for r in results],
        generated_texts=[r.generated_text for r in results],
        errors=[r.error for r in results],
    )
    return result


def _print_failures(failed: list[RequestResult]) -> None:
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, r in enumerate(failed[:10]):
            print(f"Error {i}: {r.error}")


def _throughputs(ok: list[RequestResult], failed: int, duration: float) -> dict[str, Any]:
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    peak_tokens, peak_concurrency = _peaks(ok)
    return {
        "duration": duration,
        "completed": len(ok),
        "failed": failed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_concurrency,
    }


def _throughput_lines(
    result: dict[str, Any], max_concurrency: int | None, request_rate: float
) -> list[str]:
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        _line("Successful requests:", result["completed"]),
        _line("Failed requests:", result["failed"]),
    ]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_line("Request rate configured (RPS):", float(request_rate)))
    return lines + [
        _line("Benchmark duration (s):", float(result["duration"])),
        _line("Total input tokens:", result["total_input_tokens"]),
        _line("Total generated tokens:", result["total_output_tokens"]),
        _line("Request throughput (req/s):", result["request_throughput"]),
        _line("Output token throughput (tok/s):", result["output_throughput"]),
        _line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]),
        _line("Peak concurrent requests:", float(result["max_concurrent_requests"])),
        _line("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]


def _latencies(ok: list[RequestResult]) -> dict[str, list[float]]:
    """Seconds, per metric of METRICS."""
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def _latency_lines(
    key: str, seconds: list[float], percentiles: list[float], result: dict[str, Any]
) -> list[str]:
    """One metric's section of the table; its figures (ms) go into `result`."""
    name, header = METRICS[key]
    data = seconds or [0.0]
    lines = ["{s:{c}^{n}}".format(s=header, n=50, c="-")]
    for label, stat in (("Mean", np.mean), ("Median", np.median)):
        value = float(stat(data)) * 1000
        lines.append(_line(f"{label} {name} (ms):", value))
        result[f"{label.lower()}_{key}_ms"] = value
    result[f"std_{key}_ms"] = float(np.std(data)) * 1000
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        value = float(np.percentile(data, p)) * 1000
        lines.append(_line(f"P{word} {name} (ms):", value))
        result[f"p{word}_{key}_ms"] = value
    return lines


def plot(
    runs: list[dict[str, Any]], metrics: list[str], percentiles: list[float], path: str
) -> None:
    """Latency against request rate, one panel per metric: mean, median and each
    percentile. An unlimited rate is drawn at the throughput it reached."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [
        r["request_throughput"] if r["request_rate"] == float("inf") else r["request_rate"]
        for r in runs
    ]
    order = np.argsort(xs)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.6), squeeze=False)
    for ax, key in zip(axes[0], metrics, strict=True):
        name, header = METRICS[key]
        stats = ["mean", "median"] + [f"p{int(p) if int(p) == p else p}" for p in percentiles]
        for stat in stats:
            ys = [runs[i][f"{stat}_{key}_ms"] for i in order]
            ax.plot([xs[i] for i in order], ys, marker="o", label=stat)
        ax.set_title(header, fontsize=10)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
