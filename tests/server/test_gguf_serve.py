"""`minivllm serve FILE.gguf`: the tokenizer and chat template come from the file, and the
tokens are transformers' on the same dequantized weights."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.gguf_files import build_tiny_gguf
from tests.hf_reference import hf_greedy, parity_prompts


@pytest.fixture(scope="module")
def served(server_factory, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gguf-serve"))
    path = build_tiny_gguf(root, "llama")
    # `-q gguf`: vLLM's spelling for a GGUF file, accepted though it is implied
    return server_factory([path, "--dtype", "float32", "-q", "gguf"]), path, f"{root}/llama"


def test_completion_tokens_equal_transformers(served) -> None:
    server, path, _ = served
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [path]  # vLLM's default name: the model path
    prompt = parity_prompts()[1]
    body = {"model": path, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    body.update(ignore_eos=True, return_token_ids=True)
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(path + ".reference", [prompt], 8)[0]


def test_chat_uses_the_files_template(served) -> None:
    server, path, hf_dir = served
    messages = [{"role": "user", "content": "Hello world!"}]
    body = {"model": path, "messages": messages, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    expected = AutoTokenizer.from_pretrained(hf_dir).apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
