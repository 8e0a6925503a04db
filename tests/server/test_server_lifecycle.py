"""--api-key, and a server whose engine dies: /health says 503 and requests fail fast with
503, while the server itself keeps answering."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

from tests.server.conftest import descendants


@pytest.fixture(scope="module")
def server(server_factory, qwen3_dir: str):
    return server_factory([qwen3_dir, "--dtype", "float32", "--api-key", "sesame"])


def test_api_key(server) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="open", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=server_model(server), prompt="Hi", max_tokens=2)
    assert e.value.status_code == 401
    assert set(e.value.body) == {"message", "type", "param", "code"}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 401  # no key at all, checked before the body
    right = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
    out = right.completions.create(model=server_model(server), prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens == 2
    # health and metrics are for operators, outside /v1
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def server_model(server) -> str:
    r = httpx.get(f"{server.url}/v1/models", headers={"authorization": "Bearer sesame"})
    return r.json()["data"][0]["id"]


def test_health_is_503_once_the_engine_is_dead(server) -> None:
    # the engine-core is the server's child that has a child of its own (the worker)
    (core,) = [p for p in descendants(server) if p.ppid() == server.proc.pid and p.children()]
    body = {"model": server_model(server), "prompt": "Hi", "max_tokens": 400, "ignore_eos": True}
    headers = {"authorization": "Bearer sesame"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            core.send_signal(signal.SIGKILL)
            rest = "\n".join(lines)  # the stream ends (with an error event), never hangs
        assert '"error"' in rest and rest.strip().endswith("data: [DONE]")
        start = time.monotonic()
        while http.get("/health").status_code != 503:
            assert time.monotonic() - start < 10
            time.sleep(0.1)
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 503 and "dead" in r.json()["error"]["message"]
        assert http.get("/v1/models").status_code == 200  # the server itself still answers
    assert server.proc.poll() is None
