"""A daemon's clients need no copy of the model: a daemon started with a relative model path
serves clients in other directories, with its model directory gone from under them, over
tcp; its tokenizer, limits and sampling defaults travel in the handshake."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from minivllm import AsyncLLM, RequestOutputKind, SamplingParams
from minivllm.frontend.server.launch import ServerProcess
from tests.e2e.daemon import env
from tests.hf_reference import hf_greedy

PROMPTS = [[5, 17, 99, 3], [200, 1, 42, 42, 7, 8]]
DEFAULTS = {"eos_token_id": [0], "top_k": 1, "max_new_tokens": 6}

CLIENT = """
import json, sys
from minivllm import LLM, SamplingParams
llm = LLM.connect(sys.argv[1])
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])], greedy)
text = llm.generate(["Hello world"], greedy, use_tqdm=False)[0].outputs[0]
plain = llm.generate(["Hello world"], use_tqdm=False)[0].outputs[0]
d = llm.get_default_sampling_params()
print(json.dumps({
    "tokens": [list(o.outputs[0].token_ids) for o in outs],
    "text_ids": list(text.token_ids), "text": text.text,
    "plain_ids": list(plain.token_ids), "defaults": [d.top_k, d.max_tokens],
}))
llm.shutdown()
"""


@pytest.fixture(scope="module")
def daemon(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """`engine-core --model tiny-qwen3` run in the model's parent directory, on tcp; once it
    listens its model directory is moved away: no client can read it."""
    home = tmp_path_factory.mktemp("daemon-home")
    model = home / "tiny-qwen3"
    shutil.copytree(qwen3_dir, model)
    (model / "generation_config.json").write_text(json.dumps(DEFAULTS))
    log_path = home / "daemon.log"
    cmd = [sys.executable, "-m", "minivllm.frontend.cli", "engine-core", "--model", "tiny-qwen3"]
    cmd += ["--dtype", "float32", "--address", "tcp://127.0.0.1:0"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=home, stdout=log, stderr=subprocess.STDOUT, env=env())
    try:
        address = _wait_listening(proc, log_path)
        model.rename(home / "moved-away")
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_listening(proc: subprocess.Popen, log_path, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"engine-core listening on (tcp://\S+)", log_path.read_text())
        if found:
            return found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"the daemon did not start:\n{log_path.read_text()}")


def test_client_elsewhere_without_model_files(daemon: str, qwen3_dir: str, tmp_path) -> None:
    from transformers import AutoTokenizer

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, daemon, json.dumps(PROMPTS)],
        cwd=tmp_path,  # an empty directory: no model here, nor at the daemon's path
        env=env(TMPDIR=str(tmp)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tokens"] == hf_greedy(qwen3_dir, PROMPTS, 8)
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    assert result["text_ids"] == hf_greedy(qwen3_dir, [tokenizer.encode("Hello world")], 8)[0]
    assert result["text"] == tokenizer.decode(result["text_ids"])
    # the model's generation_config.json came along: top_k=1 (greedy), six tokens at most
    assert result["defaults"] == [1, 6]
    assert result["plain_ids"] == result["text_ids"][: len(result["plain_ids"])]
    assert 1 <= len(result["plain_ids"]) <= 6
    assert "generation_config.json" in out.stderr  # the warning naming the defaults
    assert os.listdir(tmp) == []  # the tokenizer's files were removed once loaded


def test_async_client_with_its_own_tokenizer(daemon: str, qwen3_dir: str) -> None:
    expected = hf_greedy(qwen3_dir, PROMPTS, 8)

    async def run(llm: AsyncLLM) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        got = []
        for i, prompt in enumerate(PROMPTS):
            async for out in llm.generate({"prompt_token_ids": prompt}, params, f"r{i}"):
                final = out
            got.append(list(final.outputs[0].token_ids))
        return got

    for tokenizer in (None, qwen3_dir):
        llm = AsyncLLM.connect(daemon, tokenizer=tokenizer)
        try:
            assert llm.model_config.max_model_len == 512
            assert asyncio.run(run(llm)) == expected
        finally:
            llm.shutdown()


def test_serve_connect_needs_no_model_files(daemon: str, tmp_path) -> None:
    with ServerProcess(["--connect", daemon], str(tmp_path / "serve.log"), env()) as server:
        body = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        # the chat template came with the tokenizer; max_tokens from the model's defaults
        assert r.json()["usage"]["completion_tokens"] == 6
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        assert models[0]["id"].endswith(os.sep + "tiny-qwen3")  # resolved by the daemon
