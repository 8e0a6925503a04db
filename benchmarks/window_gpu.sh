#!/usr/bin/env bash
# Sliding windows and Gemma 3 on one GPU, in one call, most important first:
#   bash benchmarks/window_gpu.sh [tests] [gemma3] [qwen3]
# (no arguments: all three). tests: the GPU tests of windows and Gemma 3 (the Triton
# attention kernels with windows against a float64 reference, Gemma 3 1B's head_dim 256
# among them; Gemma's norm and GELU kernels; fp32 tokens against transformers through the
# Triton kernels and CUDA graphs; bf16 graphs against eager); gemma3: the reference workload
# on the Gemma 3 1B geometry against its floor (which counts each sliding layer's KV in its
# 512-token window only); qwen3: the same on Qwen3-0.6B, the dense baseline of this machine.
# Output goes to $OUT/log.txt, a summary last; a step starts only while less than $BUDGET_S
# seconds (default 540) have passed.
set -u
OUT=${OUT:-/tmp/minivllm-window}
source "$(dirname "$0")/gpu_steps.sh"
B="python -m minivllm.frontend.cli bench"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(tests gemma3 qwen3)

log_machine
for step in "${STEPS[@]}"; do
    case $step in
    tests) run tests 300 python -m pytest -q -m gpu -p no:cacheprovider \
        tests/worker/test_triton_attention.py tests/worker/test_gemma_ops.py \
        "tests/worker/test_gpu_runner.py::test_sliding_windows_match_transformers" \
        "tests/worker/test_gpu_runner.py::test_gemma3_bf16_graphs_give_the_eager_tokens" ;;
    gemma3) run gemma3 300 $B throughput --geometry gemma3-1b --output-json "$OUT/gemma3.json" ;;
    qwen3) run qwen3 300 $B throughput --geometry qwen3-0.6b --output-json "$OUT/qwen3.json" ;;
    esac
done

echo "======== summary ($((SECONDS - START)) s)"
grep -E "^== |passed|failed|Error|Throughput:|floor, |Elapsed" \
    "$LOG" | grep -v "^== .*: python\|^== .*: timeout" | cut -c1-220
