"""`python benchmarks/ab_trees.py BASE_DIR NEW_DIR`: two source trees of minivllm against
each other on one GPU, each an `LLM` kept alive in its own process, in alternating rounds
(base first in odd rounds, new first in even ones) of the reference workload and of batch-1
latency (a 512-token prompt, 128 output tokens), through the public API only, so any two
trees compare. Each tree runs one untimed reference batch first. Prints every round and the
means, with new/base ratios; writes the rounds to $OUT/ab_trees.json when $OUT is set.

    python benchmarks/ab_trees.py /path/to/old-checkout . --rounds 6
    python benchmarks/ab_trees.py A B --tiny --rounds 1     # a quick look on the CPU

Both engines share the GPU (a fixed 40 GiB KV cache each, the reference workload's 30 GiB
fits), but only one runs at a time. Warm: no start-up or first-batch effect in a round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", help="the base tree: a directory holding the minivllm package")
    p.add_argument("new", help="the tree compared with it")
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds (each runs both)")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no round after this")
    p.add_argument(
        "--tiny", action="store_true", help="a 2-layer model, 8 short requests, 16-token latency"
    )


def _write_model(model: str, tiny: bool) -> None:
    """Qwen3-0.6B's geometry (TINY's overrides with --tiny) and the reference workload (8
    requests of 16 tokens with --tiny), both from this tree's minivllm, written into `model`
    so that both trees read the same config and prompts whatever their own code holds."""
    sys.path.insert(0, _REPO)  # this process only: each tree's engine imports its own
    from minivllm.benchmarks.geometry import GEOMETRIES
    from minivllm.benchmarks.workloads import reference_workload

    workload = reference_workload()
    prompts, outs = workload.prompts, workload.output_lens
    if tiny:
        prompts, outs = prompts[:8], [16] * 8
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({**GEOMETRIES["qwen3-0.6b"], **(TINY if tiny else {})}, f)
    with open(os.path.join(model, "workload.json"), "w") as f:
        json.dump({"prompts": prompts, "output_lens": outs}, f)


def _child(model: str, tiny: bool) -> None:
    """One tree's engine: answers "reference" and "latency" lines on stdin with RESULT lines."""
    from minivllm import LLM, SamplingParams

    kv = (2 if tiny else 40) << 30
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              kv_cache_memory_bytes=kv)  # fmt: skip
    with open(os.path.join(model, "workload.json")) as f:
        workload = json.load(f)
    reqs = [{"prompt_token_ids": p} for p in workload["prompts"]]
    params = [
        SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True)
        for n in workload["output_lens"]
    ]
    seeds = iter(range(10**6, 2 * 10**6))
    out_len, warmup, iters = (16, 1, 3) if tiny else (128, 3, 10)

    def one(max_tokens: int) -> float:
        rng = random.Random(next(seeds))
        prompt = [{"prompt_token_ids": [rng.randint(0, 10000) for _ in range(512)]}]
        sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        return time.perf_counter() - start

    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "reference":
            start = time.perf_counter()
            done = llm.generate(reqs, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(r.outputs[0].token_ids) for r in done)
            out = {"seconds": seconds, "tok_s": tokens / seconds, "tokens": tokens}
        elif line.strip() == "latency":  # as `minivllm bench latency`, 3 + 10 iterations
            for _ in range(warmup):
                one(out_len)
            avg = statistics.mean(one(out_len) for _ in range(iters))
            ttft = statistics.median(one(1) for _ in range(iters))
            out = {"ttft_ms": ttft * 1e3, "tpot_ms": (avg - ttft) / (out_len - 1) * 1e3}
        else:
            break
        print("RESULT " + json.dumps(out), flush=True)
    llm.shutdown()


class _Tree:
    """A child process running `_child` on one tree's minivllm."""

    def __init__(self, name: str, root: str, model: str, tiny: bool, log: Any) -> None:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(root)}
        cmd = [sys.executable, os.path.abspath(__file__), "--child", model]
        self.name, self.log = name, log
        self.proc = subprocess.Popen(
            cmd + (["--tiny"] if tiny else []), cwd=root, env=env, text=True, bufsize=1,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
        )  # fmt: skip
        self._wait_for("READY")

    def _wait_for(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            self.log.write(line)  # the engine's own lines
        raise RuntimeError(f"the {self.name} tree's engine ended: exit {self.proc.wait()}")

    def ask(self, what: str) -> dict[str, float]:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return json.loads(self._wait_for("RESULT "))

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def _report(runs: dict[str, list[dict[str, float]]]) -> None:
    means = {
        name: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    for name, m in means.items():
        print(f"{name}: mean {m['tok_s']:,.0f} output tok/s, TPOT {m['tpot_ms']:.4f} ms, "
              f"TTFT {m['ttft_ms']:.3f} ms over {len(runs[name])} rounds")  # fmt: skip
    ratios = {k: means["new"][k] / means["base"][k] for k in ("tok_s", "tpot_ms", "ttft_ms")}
    print(
        f"new/base: throughput {ratios['tok_s']:.4f}, TPOT {ratios['tpot_ms']:.4f}, "
        f"TTFT {ratios['ttft_ms']:.4f}"
    )


def main(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    start = time.time()
    out_dir = os.environ.get("OUT") or tempfile.gettempdir()
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    with (
        tempfile.TemporaryDirectory() as model,
        open(os.path.join(out_dir, "ab_trees.log"), "w") as log,
    ):
        _write_model(model, args.tiny)
        trees = {name: _Tree(name, getattr(args, name), model, args.tiny, log) for name in runs}
        print(f"both engines ready at {time.time() - start:.1f} s", flush=True)
        for name, tree in trees.items():
            print(f"{name}: untimed batch {tree.ask('reference')['seconds']:.3f} s", flush=True)
        for i in range(args.rounds):
            if time.time() - start > args.budget_s:
                break
            for name in ("base", "new") if i % 2 == 0 else ("new", "base"):
                r = {**trees[name].ask("reference"), **trees[name].ask("latency")}
                runs[name].append(r)
                line = f"{r['tok_s']:,.0f} output tok/s ({r['seconds']:.3f} s), TPOT "
                line += f"{r['tpot_ms']:.3f} ms, TTFT {r['ttft_ms']:.2f} ms"
                print(f"round {i + 1} {name}: {line}", flush=True)
        for tree in trees.values():
            tree.stop()
    if runs["base"]:
        _report(runs)
    if os.environ.get("OUT"):
        with open(os.path.join(out_dir, "ab_trees.json"), "w") as f:
            json.dump(runs, f, indent=1)
    return runs


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], "--tiny" in sys.argv)
    else:
        parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        add_arguments(parser)
        main(parser.parse_args())
