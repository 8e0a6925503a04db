"""What `minivllm serve` does with what a request leaves out or adds: the model's generation
defaults fill unset fields (vLLM's rules), `--generation-config vllm` ignores them; vLLM's
older `guided_*` fields constrain the output; unknown fields are logged once per name.
Also: no --host listens on every interface, with a warning when there is no --api-key."""

from __future__ import annotations

import json
import shutil

import httpx
import psutil
import pytest

from minivllm.frontend.server.launch import ServerProcess
from tests.server.conftest import server_env, stop_cleanly

DEFAULTS = {"eos_token_id": [0], "top_k": 1, "max_new_tokens": 4}


@pytest.fixture(scope="module")
def model_dir(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    model = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(qwen3_dir, model)
    (model / "generation_config.json").write_text(json.dumps(DEFAULTS))
    return str(model)


def _start(model_dir: str, tmp_path_factory, *args: str, host: str | None = "127.0.0.1"):
    log = tmp_path_factory.mktemp("server") / "server.log"
    argv = [model_dir, "--dtype", "float32", "--served-model-name", "m", *args]
    return ServerProcess(argv, str(log), server_env(), startup_timeout=120, host=host)


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory):
    """No --host, no --api-key, requests logged."""
    server = _start(model_dir, tmp_path_factory, "--enable-log-requests", host=None)
    yield server
    stop_cleanly(server)


def _post(server: ServerProcess, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{path}", json={"model": "m", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(server: ServerProcess, **body) -> dict:
    messages = [{"role": "user", "content": "Tell me a story"}]
    return _post(server, "/v1/chat/completions", {"messages": messages, **body})


def test_listens_on_every_interface_and_warns_without_a_key(server: ServerProcess) -> None:
    ports = [c.laddr for c in psutil.Process(server.proc.pid).net_connections("tcp")]
    assert any(a.ip == "0.0.0.0" and str(a.port) in server.url for a in ports), ports
    assert "listens on all interfaces (no --host) with no --api-key" in server.read_log()


def test_model_defaults_fill_what_the_request_leaves_out(server: ServerProcess) -> None:
    # chat without max_tokens: the model's max_new_tokens; with it: the request's own
    assert _chat(server, ignore_eos=True)["usage"]["completion_tokens"] == 4
    assert _chat(server, ignore_eos=True, max_tokens=7)["usage"]["completion_tokens"] == 7
    # completions' max_tokens defaults to 16 (OpenAI's), which the model's default leaves
    body = {"prompt": "Hello", "ignore_eos": True}
    assert _post(server, "/v1/completions", body)["usage"]["completion_tokens"] == 16
    # the model's top_k=1: four samples at temperature 1 are one greedy text...
    texts = {c["message"]["content"] for c in _chat(server, n=4, max_tokens=12)["choices"]}
    assert len(texts) == 1
    # ...unless the request sets top_k itself
    free = _chat(server, n=4, max_tokens=12, top_k=0, ignore_eos=True)["choices"]
    assert len({c["message"]["content"] for c in free}) > 1
    assert "Default sampling parameters have been overridden" in server.read_log()


def test_generation_config_vllm_ignores_the_model_defaults(model_dir, tmp_path_factory) -> None:
    server = _start(model_dir, tmp_path_factory, "--generation-config", "vllm")
    try:
        body = {"n": 4, "max_tokens": 12, "ignore_eos": True}
        assert len({c["message"]["content"] for c in _chat(server, **body)["choices"]}) > 1
        assert "Default sampling parameters have been overridden" not in server.read_log()
        # no --host given to this one: loopback only, so no warning
        assert "no --api-key" not in server.read_log()
    finally:
        stop_cleanly(server)


def test_guided_choice_constrains_the_output(server: ServerProcess) -> None:
    choices = ["yes", "no", "maybe not"]
    body = {"prompt": "Answer:", "n": 6, "top_k": 0, "max_tokens": 32, "guided_choice": choices}
    out = _post(server, "/v1/completions", body)
    assert {c["text"] for c in out["choices"]} <= set(choices)
    assert {c["finish_reason"] for c in out["choices"]} == {"stop"}
    body = {"prompt": "Digits:", "max_tokens": 32, "guided_regex": "[0-9]{3}"}
    text = _post(server, "/v1/completions", body)["choices"][0]["text"]
    assert len(text) == 3 and text.isdigit()
    bad = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "x", "guided_regex": "[0-9", "max_tokens": 2},
        timeout=30,
    )
    assert bad.status_code == 400 and "regex" in bad.json()["error"]["message"]


def test_unknown_fields_are_logged_once_per_name(server: ServerProcess) -> None:
    for _ in range(3):
        _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "tempreature": 0})
    warned = "The following fields were present in the request but ignored: ['tempreature']"
    assert server.read_log().count(warned) == 1
    assert "Received request cmpl-" in server.read_log()  # --enable-log-requests
