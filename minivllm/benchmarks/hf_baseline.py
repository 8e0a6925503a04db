"""The workload through HF transformers `generate`: `bench throughput --compare hf`."""

from __future__ import annotations

import time

import torch
from torch.nn.utils.rnn import pad_sequence

from minivllm.benchmarks.run_result import RunResult
from minivllm.benchmarks.workloads import Workload
from minivllm.gguf_file import pretrained_args


def run_hf(
    model_dir: str,
    workload: Workload,
    device: str,
    temperature: float,
    seed: int = 0,
    batch_size: int = 64,
) -> RunResult:
    """The workload through HF transformers `generate`, the baseline people quote: batches
    of 64 sorted by length, random weights from the model's config.json (bf16 on CUDA, fp32
    on CPU), as the published HF baseline. Each batch generates max-of-batch tokens, but
    only each request's own output length counts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(seed)
    name, kwargs = pretrained_args(model_dir)
    config = AutoConfig.from_pretrained(name, **kwargs)
    # .to(dtype) rather than from_config's dtype keyword, whose name changed in transformers 5
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
    order = sorted(range(len(workload.prompts)), key=lambda i: len(workload.prompts[i]))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    counted = 0
    start = time.perf_counter()
    for batch in batches:
        rows = [torch.tensor(workload.prompts[i]) for i in batch]
        ids, mask = (
            pad_sequence(xs, batch_first=True, padding_side="left").to(device)
            for xs in (rows, [torch.ones_like(row) for row in rows])
        )
        new = max(workload.output_lens[i] for i in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,  # ignore_eos: random weights may sample an EOS id
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )
        counted += sum(workload.output_lens[i] for i in batch)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return RunResult(elapsed, len(workload.prompts), workload.num_prompt_tokens, counted)
