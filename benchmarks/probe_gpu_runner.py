"""Throughput probe of the GPU worker through an in-process EngineCore (no frontend).

The nano-vllm offline workload on Qwen3-0.6B's geometry with random weights: 256 requests,
prompts of randint(100, 1024) ids, outputs of randint(100, 1024) tokens, temperature 0.6,
ignore_eos. Prints output tokens per second. Example:

    python benchmarks/probe_gpu_runner.py --executor mp
    python benchmarks/probe_gpu_runner.py --executor mp --enforce-eager
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import tempfile
import time

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "eos_token_id": 151645,
}


def workload(num_requests: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's draw order: every prompt first, then every output length."""
    random.seed(seed)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
        for _ in range(num_requests)
    ]
    out_lens = [random.randint(100, 1024) for _ in range(num_requests)]
    return prompts, out_lens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--executor", choices=["mp", "uni"], default="mp")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--no-async", action="store_true", help="async_scheduling=False")
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("MINIVLLM_LOG_LEVEL", "INFO"))

    from minivllm.config import EngineArgs
    from minivllm.engine_core.engine_core import EngineCore
    from minivllm.protocol.messages import EngineCoreRequest
    from minivllm.protocol.sampling_params import SamplingParams

    model_dir = tempfile.mkdtemp(prefix="qwen3-0.6b-dummy-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(QWEN3_0_6B, f)
    engine_args = EngineArgs(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        distributed_executor_backend=args.executor,
        async_scheduling=not args.no_async,
    )
    start = time.perf_counter()
    core = EngineCore(engine_args.create_engine_config())
    startup = time.perf_counter() - start

    prompts, out_lens = workload(args.num_requests)
    # warm-up: compile the prefill kernels and touch every path once, outside the timing
    warm = SamplingParams(temperature=args.temperature, max_tokens=8, ignore_eos=True)
    core.add_request(EngineCoreRequest("warm", prompts[0][:300], warm))
    while core.has_work():
        core.step()

    # as the engine-core process does: the start-up heap (torch, transformers) is never
    # scanned again, or each full collection would stall a step for tens of milliseconds
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, out_lens, strict=True)):
        params = SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True)
        core.add_request(EngineCoreRequest(str(i), p, params))
    num_out = steps = 0
    while core.has_work():
        steps += 1
        for outs in core.step().values():
            num_out += sum(len(o.new_token_ids) for o in outs.outputs)
    elapsed = time.perf_counter() - start
    core.shutdown()
    print(
        f"RESULT executor={args.executor} eager={args.enforce_eager} async={not args.no_async} "
        f"requests={args.num_requests} prompt_tokens={sum(map(len, prompts))} "
        f"output_tokens={num_out} (expected {sum(out_lens)}) time={elapsed:.2f}s "
        f"throughput={num_out / elapsed:.0f} tok/s core_steps={steps} startup={startup:.1f}s",
        flush=True,
    )


if __name__ == "__main__":
    main()
