"""`python benchmarks/tp_equality.py`: greedy tokens at every tensor-parallel size are the same
(dummy weights of a real geometry).

    python benchmarks/tp_equality.py --geometry qwen3-8b --tp-sizes 1 2 --dtype float32

Run on a machine with as many GPUs as the largest TP size (NCCL_NVLS_ENABLE=0), or on CPU
with gloo (`--device cpu`, with a small geometry). Prints one line per TP size and exits 1
if any differs from the first.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from minivllm import LLM, SamplingParams
from minivllm.benchmarks import run_script
from minivllm.benchmarks.geometry import write_geometry


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--geometry", default="qwen3-8b", help="the model shape (random weights)")
    p.add_argument(
        "--tp-sizes", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes compared"
    )
    p.add_argument("--dtype", default="float32", help="the model's dtype")
    p.add_argument("--device", default="auto", help="auto: CUDA when there is a GPU")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts generated")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens of each")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="only the geometry's first N layers (fp32 of a large model on one GPU)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="mixtures of experts: whole experts per rank at TP > 1",
    )


def main(args: argparse.Namespace) -> bool:
    """True when every TP size gave the first one's tokens (the command exits 1 otherwise)."""
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randint(0, 10000) for _ in range(rng.randint(16, 256))]}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_geometry(args.geometry, tmp)
        for tp in args.tp_sizes:
            start = time.perf_counter()
            llm = LLM(
                model,
                load_format="dummy",
                dtype=args.dtype,
                tensor_parallel_size=tp,
                skip_tokenizer_init=True,
                max_model_len=1024,
                device=args.device,
                enforce_eager=args.enforce_eager,
                enable_expert_parallel=args.enable_expert_parallel,
                hf_overrides={"num_hidden_layers": args.num_layers} if args.num_layers else {},
            )
            outs = llm.generate(prompts, params, use_tqdm=False)
            llm.shutdown()
            results[tp] = [o.outputs[0].token_ids for o in outs]
            print(
                f"TP={tp}: {len(results[tp])} x {args.max_tokens} greedy tokens in "
                f"{time.perf_counter() - start:.1f} s; first: {results[tp][0][:8]}",
                flush=True,
            )
    base = results[args.tp_sizes[0]]
    same = True
    for tp, tokens in results.items():
        agree = sum(
            a == b for x, y in zip(base, tokens, strict=True) for a, b in zip(x, y, strict=True)
        )
        total = sum(len(x) for x in base)
        print(f"TP={tp} vs TP={args.tp_sizes[0]}: {agree}/{total} tokens equal")
        same &= tokens == base
    print("IDENTICAL" if same else "DIFFERENT")
    if not same:
        raise SystemExit(1)
    return same


if __name__ == "__main__":
    run_script(__doc__, add_arguments, main)
