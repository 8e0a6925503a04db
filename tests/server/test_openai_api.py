"""`minivllm serve` through the official `openai` client on a tiny checkpoint: both
endpoints streamed and not, n > 1, stop strings, token-id prompts, every error code, a
dropped stream that frees its KV blocks, a /metrics scrape, and 64 concurrent streams of
which a quarter are dropped."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ALIAS, MODEL


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def scrape(server) -> dict[str, float]:
    """`/metrics` parsed with prometheus-client's parser: {name{labels}: value}."""
    text = httpx.get(f"{server.url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}"] = s.value
    return values


def engine_idle(server) -> dict[str, float]:
    m = scrape(server)
    key = f"engine=0,model_name={MODEL}"
    return {
        "running": m[f"vllm:num_requests_running{{{key}}}"],
        "waiting": m[f"vllm:num_requests_waiting{{{key}}}"],
        "kv": m[f"vllm:kv_cache_usage_perc{{{key}}}"],
    }


def wait_idle(server, timeout: float) -> float:
    """Seconds until the engine runs nothing and holds no KV block; fails after `timeout`."""
    start = time.monotonic()
    while (state := engine_idle(server)) != {"running": 0, "waiting": 0, "kv": 0}:
        assert time.monotonic() - start < timeout, f"still busy after {timeout} s: {state}"
        time.sleep(0.02)
    return time.monotonic() - start


def test_completions_streamed_equals_plain(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Hello world", max_tokens=12, temperature=0)
    plain = client.completions.create(**kwargs)
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 12 and plain.usage.prompt_tokens > 0
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_streamed_equals_plain_with_the_servers_template(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    kwargs = dict(model=ALIAS, messages=messages, max_completion_tokens=10, temperature=0)
    plain = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert plain.choices[0].message.role == "assistant"
    assert plain.model == ALIAS and plain.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == plain.choices[0].message.content
    )
    # --chat-template rendered the prompt: a completion of the rendered text is the same
    rendered = "[user] Hello\n[assistant]"
    same = client.completions.create(
        model=MODEL,
        prompt=rendered,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "add_special_tokens": False},
    )
    assert same.choices[0].text == plain.choices[0].message.content
    assert same.usage.prompt_tokens == plain.usage.prompt_tokens


def test_n_choices_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=3, n=3)
    out = client.completions.create(prompt=["Hello", "The quick"], **kwargs)
    assert [c.index for c in out.choices] == list(range(6))
    assert out.usage.completion_tokens == 6 * 6
    assert len({c.text for c in out.choices[:3]}) > 1, "n samples should differ"
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt=["Hello", "The quick"], stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    # seeded: child i samples with seed + i, so the stream repeats the plain texts
    assert streamed == {c.index: c.text for c in out.choices}


def test_stop_strings(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=24, temperature=0)
    text = base.choices[0].text
    stop = text[8:11]
    assert stop and text.find(stop) >= 0
    out = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=24, temperature=0, stop=[stop, "\x00never"]
    )
    choice = out.choices[0]
    assert choice.text == text[: text.find(stop)]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    streamed = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_token_id_prompts(server, client: openai.OpenAI) -> None:
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"] == (
        "Hello world"
    )
    by_text = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=8, temperature=0
    )
    by_ids = client.completions.create(
        model=MODEL, prompt=[ids, ids[:2]], max_tokens=8, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert len(by_ids.choices) == 2 and by_ids.usage.prompt_tokens == len(ids) + 2
    echoed = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, echo=True, user="someone"
    )
    assert echoed.choices[0].text == "Hello world" + by_text.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=8, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_errors(server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    assert "temperature" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 5000, max_tokens=4)
    assert "maximum context length" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x" * 5000}]
        )
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens="many")  # type: ignore[arg-type]
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="Hi")
    assert e.value.status_code == 404 and e.value.body["param"] == "model"
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(
            server.url + path,
            content=b'{"prompt": "Hi"',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "JSON" in r.json()["error"]["message"]
    # the server is unharmed
    assert (
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens
        == 2
    )


def test_models_and_version(server, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_dropped_stream_is_aborted_within_a_second_and_frees_its_kv(server) -> None:
    wait_idle(server, timeout=30)
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or not line for line in got)
        assert engine_idle(server)["running"] == 1 and engine_idle(server)["kv"] > 0
    # leaving the block closed the connection
    assert wait_idle(server, timeout=1.0) < 1.0


def test_dropped_plain_request_is_aborted(server) -> None:
    wait_idle(server, timeout=30)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 450, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
    assert wait_idle(server, timeout=1.0) < 1.0


def test_metrics_scrape(server) -> None:
    m = scrape(server)
    labels = f"engine=0,model_name={MODEL}"
    assert m[f"vllm:generation_tokens_total{{{labels}}}"] > 0
    assert m[f"vllm:prompt_tokens_total{{{labels}}}"] > 0
    success = "vllm:request_success_total{engine=0,finished_reason=%s,model_name=" + MODEL + "}"
    assert m[success % "length"] > 0 and m[success % "stop"] > 0
    assert m[success % "abort"] >= 2  # the two dropped requests above
    assert m[f"vllm:time_to_first_token_seconds_count{{{labels}}}"] > 0
    assert m[f"vllm:inter_token_latency_seconds_count{{{labels}}}"] > 0
    assert m[f"vllm:e2e_request_latency_seconds_count{{{labels}}}"] > 0
    assert m[f"vllm:request_queue_time_seconds_count{{{labels}}}"] > 0
    assert m[f"vllm:prefix_cache_queries_total{{{labels}}}"] > 0
    assert f"vllm:num_preemptions_total{{{labels}}}" in m
    ttft_bounds = sorted(
        float(k.split("le=")[1].split(",")[0].rstrip("}"))
        for k in m
        if k.startswith("vllm:time_to_first_token_seconds_bucket")
    )
    assert ttft_bounds[:4] == [0.001, 0.005, 0.01, 0.02] and ttft_bounds[-1] == float("inf")


def test_stream_interval_sets_the_tokens_per_chunk(server) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 9, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True, "stream_interval": 4, "return_token_ids": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json=body)
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        chunks = [e["choices"][0]["token_ids"] for e in events if e["choices"]]
        assert [len(c) for c in chunks] == [1, 4, 4]
        bad = http.post("/v1/completions", json={**body, "stream_interval": 0})
    assert bad.status_code == 400 and "stream_interval" in bad.text


def test_64_streams_a_quarter_dropped(server) -> None:
    prompts = [[(7 * i + j) % 300 + 3 for j in range(4 + i % 5)] for i in range(64)]
    base = {"model": MODEL, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    base["return_token_ids"] = True

    async def plain(http: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        r = await http.post("/v1/completions", json={**base, "prompt": prompt})
        return r.json()["choices"][0]["token_ids"]

    dropped_unfinished = []

    async def streamed(http: httpx.AsyncClient, prompt: list[int], drop_after: int | None):
        ids: list[int] = []
        async with http.stream(
            "POST", "/v1/completions", json={**base, "prompt": prompt, "stream": True}
        ) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                ids += choice["token_ids"]
                if drop_after is not None and len(ids) >= drop_after:
                    if choice["finish_reason"] is None:
                        dropped_unfinished.append(prompt)
                    return None  # leaving the block drops the connection mid-stream
        return ids

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            expected = await asyncio.gather(*(plain(http, p) for p in prompts))
            got = await asyncio.gather(
                *(streamed(http, p, 5 if i % 4 == 0 else None) for i, p in enumerate(prompts))
            )
        return expected, got

    before = scrape(server)
    expected, got = asyncio.run(main())
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        if i % 4:
            assert have == want, f"stream {i}"
    wait_idle(server, timeout=5)
    assert httpx.get(f"{server.url}/health").status_code == 200
    after = scrape(server)
    success = "vllm:request_success_total{engine=0,finished_reason=%s,model_name=" + MODEL + "}"
    new = {r: after[success % r] - before[success % r] for r in ("abort", "length")}
    # every request ended exactly once; a dropped one that had already finished in the
    # engine when its client left counts as "length"
    assert new["abort"] + new["length"] == 128
    assert len(dropped_unfinished) >= 8, "most drops should come mid-stream"
    assert 1 <= new["abort"] <= len(dropped_unfinished)


def test_stats_log_line(server) -> None:
    log = server.read_log()
    lines = [line for line in log.splitlines() if "Avg prompt throughput" in line]
    assert lines, log[-2000:]
    line = lines[-1]
    for part in ("Engine 000: ", "Avg generation throughput:", "Running:", "Waiting:"):
        assert part in line
    assert "CPU KV cache usage:" in line and "Prefix cache hit rate:" in line
