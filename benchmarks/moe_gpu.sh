#!/usr/bin/env bash
# Mixtures of experts on GPUs, in one call, most important first:
#   bash benchmarks/moe_gpu.sh [tests] [kernels] [qwen3] [tp2] [ep2] [equality] [mixtral] [fp8]
# (no arguments: tests kernels qwen3, then tp2 ep2 equality where there are 2 GPUs).
# tests: the MoE GPU tests (kernels against the torch loop at real sizes, fp32 tokens against
# transformers, CUDA graphs against eager); kernels: `kernels.py --only moe`; qwen3: the
# reference workload on the Qwen3-30B-A3B geometry against its floor (one GPU); tp2 / ep2:
# the same on 2 GPUs, experts sliced by TP or whole per rank; equality: greedy tokens equal
# at TP 1 and 2, and under EP (fp32, the geometry's first 8 layers); mixtral: Mixtral-8x7B
# (an H200, or 2 GPUs: MIXTRAL_TP=2); fp8 (named only): Qwen3-30B-A3B with its experts and
# attention in FP8 blocks, against its floor. Output goes to $OUT/log.txt, a summary last; a step
# starts only while less than $BUDGET_S seconds (default 540) have passed.
set -u
OUT=${OUT:-/tmp/minivllm-moe}
source "$(dirname "$0")/gpu_steps.sh"
export NCCL_NVLS_ENABLE=0
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}  # the scripts import this tree's minivllm
B="python -m minivllm.frontend.cli bench"
S="python $ROOT/benchmarks"  # the scripts: $S/NAME.py
GPUS=$(nvidia-smi --list-gpus | wc -l)
STEPS=("$@")
if [ ${#STEPS[@]} -eq 0 ]; then
    STEPS=(tests kernels qwen3)
    [ "$GPUS" -ge 2 ] && STEPS+=(tp2 ep2 equality)
fi

log_machine
for step in "${STEPS[@]}"; do
    case $step in
    tests) run tests 300 python -m pytest -q -m gpu -p no:cacheprovider \
        tests/worker/test_fused_moe_ops.py tests/worker/test_gpu_moe.py ;;
    kernels) run kernels 200 $S/kernels.py --only moe ;;
    qwen3) run qwen3 300 $B throughput --geometry qwen3-30b-a3b --output-json "$OUT/qwen3.json" ;;
    tp2) run tp2 300 $B throughput --geometry qwen3-30b-a3b -tp 2 --output-json "$OUT/tp2.json" ;;
    ep2) run ep2 300 $B throughput --geometry qwen3-30b-a3b -tp 2 --enable-expert-parallel \
        --output-json "$OUT/ep2.json" ;;
    equality)
        for ep in "" --enable-expert-parallel; do
            run "tp-equality $ep" 200 $S/tp_equality.py --geometry qwen3-30b-a3b --num-layers 8 \
                --dtype float32 --tp-sizes 1 2 $ep
        done ;;
    fp8) run fp8 300 $B throughput --geometry qwen3-30b-a3b --quantization fp8 \
        --output-json "$OUT/qwen3-fp8.json" ;;
    mixtral) run mixtral 400 $B throughput --geometry mixtral-8x7b -tp "${MIXTRAL_TP:-1}" \
        --output-json "$OUT/mixtral.json" ;;
    esac
done

echo "======== summary ($((SECONDS - START)) s)"
grep -E "^== |passed|failed|Error|Throughput:|floor, |Elapsed|fused_moe|tokens equal|IDENTICAL|DIFFERENT" \
    "$LOG" | grep -v "^== .*: python\|^== .*: timeout" | cut -c1-220
