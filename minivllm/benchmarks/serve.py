"""`minivllm bench serve`: load an OpenAI-compatible server (`minivllm serve`, `vllm serve`)
and print vLLM's `bench serve` result table.

Requests go to /v1/completions, streamed (`stream_options.include_usage`), with the prompt as
token ids from the served model's vocabulary: its tokenizer is --tokenizer, else --model,
else the served model's directory (/v1/models' `root`). They arrive as a Poisson process at
--request-rate (default inf: all at once), at most --max-concurrency in flight. Several rates
run one after another; --plot draws their latencies against the rate. --save-result writes
vLLM's result JSON (one file per rate). A run where requests fail prints the first error and
exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime
from typing import Any

import msgspec
import numpy as np

from minivllm.benchmarks.common import max_token_id
from minivllm.benchmarks.serve_metrics import METRICS, RequestResult, plot, summarize
from minivllm.benchmarks.workloads import (
    REFERENCE_TEMPERATURE,
    Workload,
    random_workload,
    reference_workload,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="the server (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="the server's host")
    p.add_argument("--port", type=int, default=8000, help="the server's port")
    p.add_argument("--endpoint", default="/v1/completions", help="the path requests go to")
    p.add_argument(
        "--model",
        default=None,
        help="the served model name to ask for, and its tokenizer's directory unless "
        "--tokenizer is given (default: the server's first model)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="directory of the model's tokenizer or config, for the vocabulary of random "
        "prompts (default: --model, else the served model's directory, /v1/models' root)",
    )
    p.add_argument(
        "--dataset-name",
        choices=("random", "reference"),
        default="random",
        help="random prompts, or the reference workload",
    )
    p.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    p.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens of each")
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths vary uniformly by this fraction around the above",
    )
    p.add_argument(
        "--random-prefix-len", type=int, default=0, help="tokens of a prefix every prompt shares"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    p.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[float("inf")],
        help="requests per second (inf: all at once); several: one run each",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson arrivals")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent first, untimed")
    p.add_argument("--ignore-eos", action="store_true", help="every request sets ignore_eos")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="the requests' temperature (default: the server's; the reference workload's "
        f"{REFERENCE_TEMPERATURE} with --dataset-name reference)",
    )
    p.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help=f"metrics with percentiles, of {','.join(METRICS)}",
    )
    p.add_argument("--metric-percentiles", default="99", help="percentiles, comma-separated")
    p.add_argument("--save-result", action="store_true", help="write vLLM's result JSON")
    p.add_argument("--result-dir", default=None, help="where --save-result writes (default: here)")
    p.add_argument(
        "--result-filename",
        default=None,
        help="the result file's name (default: vLLM's, from the backend, rate and model)",
    )
    p.add_argument(
        "--plot", default=None, metavar="FILE.png", help="plot latencies against the rate"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a bearer token (default: OPENAI_API_KEY)",
    )


def _workload(args: argparse.Namespace, root: str) -> tuple[Workload, float | None]:
    """The requests and the temperature to ask for (None: the server's default); `root`:
    the served model's directory."""
    if args.dataset_name == "reference":
        workload = reference_workload()
        if args.num_prompts < len(workload.prompts):
            workload = workload.subset(args.num_prompts)
        return workload, REFERENCE_TEMPERATURE if args.temperature is None else args.temperature
    max_id = vocabulary_limit(tokenizer_dir(args, root))
    workload = random_workload(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.seed,
        max_id,
        args.random_prefix_len,
        args.random_range_ratio,
    )
    return workload, args.temperature


def tokenizer_dir(args: argparse.Namespace, root: str) -> str:
    """Where the served model's vocabulary is read: --tokenizer, else --model (when it is a
    directory), else the server's model directory; SystemExit when none is readable here."""
    if args.tokenizer is not None:
        if not os.path.isdir(args.tokenizer):
            raise SystemExit(f"bench serve: --tokenizer {args.tokenizer!r} is not a directory")
        return args.tokenizer
    for candidate in (args.model, root):
        if candidate and os.path.isdir(candidate):
            return candidate
    raise SystemExit(
        f"bench serve: the served model's directory {root!r} (/v1/models' root) is not "
        "readable here, and random prompts must use its vocabulary: pass --tokenizer DIR"
    )


def vocabulary_limit(directory: str) -> int:
    """The largest id a random prompt may use: 10000 (vLLM's range) unless the model's
    vocabulary (config.json's, else the tokenizer's) is smaller."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return max_token_id(directory)
    from minivllm.frontend.tokenizer import load_tokenizer

    return min(10000, len(load_tokenizer(directory)) - 1)


def warmups(workload: Workload, n: int) -> Workload:
    """n requests of the workload's median prompt length (16 tokens out), other prompts
    than the workload's, so the prefix cache gives the timed run nothing."""
    length = int(np.median([len(p) for p in workload.prompts]))
    max_id = max(max(p) for p in workload.prompts)
    return random_workload(n, length, 16, seed=12345, vocab_limit=max_id)


async def _arrivals(n: int, rate: float, burstiness: float, seed: int):
    """Yield 0..n-1, spaced by gamma-distributed gaps of mean 1/rate (Poisson at 1.0)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if rate != float("inf") and i + 1 < n:
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


class _Choice(msgspec.Struct):
    text: str | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    """The fields of a completions stream chunk that the benchmark reads."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


async def _request(
    session, url: str, payload: dict, prompt_len: int, headers: dict
) -> RequestResult:
    """Stream one completion; events that arrive in one read share its timestamp (as in
    vLLM's client)."""
    result = RequestResult(prompt_len)
    text: list[str] = []
    pending = b""
    start = last = time.perf_counter()
    result.start_time = start
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for data in response.content.iter_any():
                now = time.perf_counter()
                *events, pending = (pending + data).split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: {"):
                        continue
                    chunk = _decode_chunk(event[6:])
                    if chunk.choices:
                        if not text:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        text.append(chunk.choices[0].text or "")
                    elif chunk.usage is not None:
                        result.output_tokens = chunk.usage.completion_tokens
                    elif chunk.error is not None:
                        result.error = str(chunk.error)
                        return result
        result.latency = last - start
        result.generated_text = "".join(text)
        result.success = bool(text)
        if not result.success:
            result.error = "no token arrived"
    except Exception as e:  # a benchmark records failures; it does not stop on them
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_once(
    args: argparse.Namespace,
    url: str,
    model: str,
    workload: Workload,
    temperature: float | None,
    rate: float,
) -> tuple[list[RequestResult], float]:
    """Send the whole workload at `rate`; (per-request results, duration)."""
    import aiohttp

    limit = args.max_concurrency or 0
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, force_close=False)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    def payload(i: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": workload.prompts[i],
            "max_tokens": workload.output_lens[i],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if args.ignore_eos or args.dataset_name == "reference":
            body["ignore_eos"] = True
        if temperature is not None:
            body["temperature"] = temperature
        return body

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(i: int) -> RequestResult:
            async with semaphore or contextlib.nullcontext():
                return await _request(session, url, payload(i), len(workload.prompts[i]), headers)

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(workload.prompts), rate, args.burstiness, args.seed):
            tasks.append(asyncio.create_task(one(i)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _first_model(base_url: str, api_key: str | None) -> tuple[str, str]:
    """The server's first model: (its name, its `root`, the model it serves)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{base_url}/v1/models", headers=headers)
    with urllib.request.urlopen(request) as response:
        card = json.load(response)["data"][0]
    return card["id"], card.get("root") or card["id"]


def check_failures(results: list[RequestResult], what: str) -> None:
    """SystemExit naming the first error when any request failed."""
    failed = [r for r in results if not r.success]
    if failed:
        raise SystemExit(
            f"bench serve: {len(failed)} of {len(results)} {what} failed; the first error: "
            f"{failed[0].error}"
        )


def _prepare(args: argparse.Namespace) -> tuple[str, str, Workload, float | None]:
    """The endpoint's URL, the model to ask for, the workload and its temperature."""
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    first, root = _first_model(base_url, args.api_key)
    model = args.model or first
    workload, temperature = _workload(args, root)
    print(
        f"{workload.name}: {workload.num_prompt_tokens} prompt tokens, "
        f"{workload.num_output_tokens} output tokens at most; model {model!r} at {base_url}"
    )
    return base_url + args.endpoint, model, workload, temperature


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    import uvloop

    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise SystemExit(f"--percentile-metrics: unknown {unknown}; choose from {list(METRICS)}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    url, model, workload, temperature = _prepare(args)
    if args.num_warmups:
        warm = warmups(workload, args.num_warmups)
        results, _ = uvloop.run(run_once(args, url, model, warm, temperature, float("inf")))
        check_failures(results, "warm-up requests")
        print(f"Warmed up with {args.num_warmups} requests")
    arrivals = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    runs = []
    for rate in args.request_rate:
        print(f"Traffic request rate: {rate}")
        print(f"Burstiness factor: {args.burstiness} ({arrivals})")
        print(f"Maximum request concurrency: {args.max_concurrency}")
        results, duration = uvloop.run(run_once(args, url, model, workload, temperature, rate))
        result = summarize(results, duration, percentiles, metrics, args.max_concurrency, rate)
        result.update(
            date=datetime.now().strftime("%Y%m%d-%H%M%S"),
            backend="openai",
            model_id=model,
            dataset_name=args.dataset_name,
            num_prompts=len(workload.prompts),
            request_rate=rate if rate != float("inf") else "inf",
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
        )
        if args.save_result:
            _save(args, result, model, rate)
        runs.append({**result, "request_rate": rate})
        check_failures(results, "requests")
    if args.plot:
        plot(runs, metrics, percentiles, args.plot)
        print(f"Plot written to {args.plot}")
    return runs


def _save(args: argparse.Namespace, result: dict[str, Any], model: str, rate: float) -> None:
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = f"openai-{rate}qps{concurrency}-{model.split('/')[-1]}-{result['date']}.json"
    if args.result_filename:
        name = args.result_filename
        if len(args.request_rate) > 1:
            stem, ext = os.path.splitext(name)
            name = f"{stem}-{rate}qps{ext}"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    with open(name, "w") as f:
        json.dump(result, f)
    print(f"Results written to {name}")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="minivllm bench serve")
    add_arguments(parser)
    return parser.parse_args(argv)


def run(argv: list[str]) -> list[dict[str, Any]]:
    """`minivllm bench serve ARGV` in this process; the result dict of each rate."""
    return main(_parse(argv))


def run_together(argv: list[str], wait: Callable[[], Any]) -> dict[str, Any]:
    """The first rate of `bench serve ARGV`, its requests sent once `wait()` returns (so
    that several client processes load one server at once); the result dict, with the
    run's wall-clock `start_time` and `end_time`."""
    import uvloop

    args = _parse(argv)
    url, model, workload, temperature = _prepare(args)
    rate = args.request_rate[0]
    wait()
    start = time.time()
    results, duration = uvloop.run(run_once(args, url, model, workload, temperature, rate))
    result = summarize(results, duration, [99.0], list(METRICS), args.max_concurrency, rate)
    return {**result, "start_time": start, "end_time": start + duration}
