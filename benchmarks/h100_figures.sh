#!/usr/bin/env bash
# The figures of RESULTS.md's table on one H100, in one call, most important first:
#   bash benchmarks/h100_figures.sh [tests] [fp8] [prefix] [bf16] [bf16] [latency] [step] [kernels] [accuracy]
# (no arguments: all of them, in that order). Each step's output goes to $OUT/log.txt; a
# summary of the lines that carry figures is printed last. Steps start only while less than
# $BUDGET_S seconds (default 540) have passed, so the call ends inside a 600 s limit.
set -u
OUT=${OUT:-/tmp/minivllm-figures}
BUDGET_S=${BUDGET_S:-540}
mkdir -p "$OUT"
LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
B="python -m minivllm.frontend.cli bench"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(tests fp8 prefix bf16 latency step kernels accuracy)
START=$SECONDS

run() {  # run NAME TIMEOUT COMMAND...: one step, logged, skipped once the budget is spent
    local name=$1 limit=$2
    shift 2
    if (( SECONDS - START > BUDGET_S )); then
        echo "== $name: skipped (budget spent)" | tee -a "$LOG"
        return
    fi
    echo "== $name: $*" | tee -a "$LOG"
    local t=$SECONDS
    timeout "$limit" "$@" >>"$LOG" 2>&1
    echo "== $name: exit $? after $((SECONDS - t)) s" | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a "$LOG"
git log -1 --format='tree %h %s' 2>/dev/null | cut -c1-80 | tee -a "$LOG"
for step in "${STEPS[@]}"; do
    case $step in
    tests) run tests 300 python -m pytest -q -m gpu -x -p no:cacheprovider \
        tests/worker/test_triton_attention.py tests/worker/test_triton_ops.py \
        tests/worker/test_gpu_kv.py tests/worker/test_gpu_runner.py ;;
    fp8) run fp8 150 $B throughput --kv-cache-dtype fp8 --output-json "$OUT/fp8.json" ;;
    prefix)
        for cascade in --no-disable-cascade-attn --disable-cascade-attn; do
            run "prefix $cascade" 120 $B throughput --num-prompts 256 --input-len 64 \
                --output-len 64 --prefix-len 2048 --temperature 0 $cascade
        done ;;
    bf16) run bf16 150 env MINIVLLM_STEP_TRACE="$OUT/trace.jsonl" $B throughput ;;
    latency) run latency 150 $B latency --batch-size 1 --input-len 512 --output-len 128 \
        --num-iters-warmup 3 --num-iters 10 ;;
    step) run step 120 $B step --prefill 512 --steps 20 --profile-sort cpu ;;
    kernels) run kernels 150 $B kernels --only attention ;;
    accuracy)
        run "accuracy (scales 1.0)" 120 $B kv-accuracy
        run "accuracy (calculated)" 120 $B kv-accuracy --calculate-kv-scales ;;
    esac
done

echo "======== summary ($((SECONDS - START)) s)"
grep -E "^== |passed|failed|Error|Throughput:|floor, |Elapsed|TTFT|TPOT|prefill of|host launch|\
agreement|KV cache: [0-9]|captured|decode attention|cascade attention|prefill attention" "$LOG" \
    | grep -v "^== .*: python\|^== .*: env\|^== .*: timeout" | cut -c1-200
