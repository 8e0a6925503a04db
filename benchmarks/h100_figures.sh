#!/usr/bin/env bash
# The figures of RESULTS.md's table on one H100, in one call, most important first:
#   bash benchmarks/h100_figures.sh [tests] [fp8] [prefix] [bf16] [latency] [step] [step1] [kernels] [accuracy]
# (no arguments: all of them, in that order; a step may be named twice). Named only:
# [startup] (LLM() to ready three times: on a fresh machine the first compiles the Triton
# kernels), [first-batch] (the reference workload three times on one engine), [gpu-suite]
# (every GPU test, with its own 590 s limit). The quantized
# weights' figures, named only: [quant-tests] [quant-latency] [quant-throughput]
# [quant-kernels] [quant-accuracy] (Qwen3-8B's geometry; one or two per call). Each step's output
# goes to $OUT/log.txt; a summary of the lines that carry figures is printed last. Steps
# start only while less than $BUDGET_S seconds (default 540) have passed, so the call ends
# inside a 600 s limit. $TESTS overrides the GPU test files.
set -u
OUT=${OUT:-/tmp/minivllm-figures}
source "$(dirname "$0")/gpu_steps.sh"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}  # the scripts import this tree's minivllm
B="python -m minivllm.frontend.cli bench"
S="python $ROOT/benchmarks"  # the scripts: $S/NAME.py
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(tests fp8 prefix bf16 bf16 latency step step1 kernels accuracy)
TESTS=${TESTS:-tests/worker/test_triton_attention.py tests/worker/test_triton_ops.py \
tests/worker/test_gpu_kv.py tests/worker/test_gpu_runner.py}

log_machine
for step in "${STEPS[@]}"; do
    case $step in
    # shellcheck disable=SC2086 - TESTS is a list of files
    tests) run tests 300 python -m pytest -q -m gpu -p no:cacheprovider $TESTS ;;
    fp8) run fp8 150 $B throughput --kv-cache-dtype fp8 --output-json "$OUT/fp8.json" ;;
    prefix)  # 256 x (2048 shared + 64) -> 64 greedy tokens, cascade on and off
        for cascade in no-disable disable; do
            run "prefix --$cascade-cascade-attn" 120 env \
                MINIVLLM_STEP_TRACE="$OUT/trace_prefix_$cascade.jsonl" $B throughput \
                --num-prompts 256 --input-len 64 --output-len 64 --prefix-len 2048 \
                --temperature 0 --$cascade-cascade-attn
            run "trace prefix $cascade" 20 $S/trace.py "$OUT/trace_prefix_$cascade.jsonl"
        done ;;
    bf16)
        run bf16 150 env MINIVLLM_STEP_TRACE="$OUT/trace_bf16.jsonl" $B throughput
        run "trace bf16" 20 $S/trace.py "$OUT/trace_bf16.jsonl" ;;
    latency) run latency 150 $B latency --batch-size 1 --input-len 512 --output-len 128 \
        --num-iters-warmup 3 --num-iters 10 ;;
    step) run step 120 $S/step.py --prefill 512 --steps 20 --profile-sort cpu ;;
    step1) run step1 120 $S/step.py --num 1 --ctx 512 --steps 50 ;;
    kernels) run kernels 150 $S/kernels.py --only attention ;;
    accuracy) run accuracy 120 $S/kv_accuracy.py --calculate-kv-scales ;;
    startup) run startup 300 env MINIVLLM_LOG_LEVEL=DEBUG $S/startup_profile.py --no-phases \
        --ready-runs 3 --out "$OUT/startup" ;;
    first-batch) run first-batch 300 $B throughput --num-runs 3 ;;
    gpu-suite)  # every GPU test in one call: four pytest workers ($GPU_TEST_WORKERS) on
        # the one GPU (each test's engine has a fixed KV cache, so they fit side by side,
        # and a fresh host's Triton builds run in parallel; an idle worker takes tests from
        # a busy one, not whole files), then the data-parallel test, which profiles the
        # GPU's memory, alone. -v: each outcome is in the log as it ends, even if the call
        # is cut.
        # Modules whose client packages (openai, ray) a GPU host lacks hold no GPU test.
        # The workers share the host's cores: each one's torch gets its share of threads
        # (transformers' CPU references ran 16 threads in each of 6 workers on 16 cores,
        # and one fp32 MoE reference passed pytest's 300 s timeout).
        export MINIVLLM_TEST_FAILURES=$OUT/test_failures.txt  # each failure as it happens
        workers=${GPU_TEST_WORKERS:-4}
        OMP_NUM_THREADS=$(( $(nproc) / workers > 1 ? $(nproc) / workers : 1 )) \
        BUDGET_S=590 run gpu-suite 480 python -m pytest -v -m gpu -p no:cacheprovider -n "$workers" \
            --dist worksteal --tb=short --durations=25 --continue-on-collection-errors \
            --ignore tests/e2e/test_data_parallel.py tests
        BUDGET_S=590 run gpu-suite-dp 100 python -m pytest -v -m gpu -p no:cacheprovider \
            -o console_output_style=times --tb=short tests/e2e/test_data_parallel.py ;;
    quant-tests) run quant-tests 300 python -m pytest -q -m gpu -p no:cacheprovider \
        -k "fp8 or w4a16" tests/worker/test_quant_kernels.py tests/worker/test_fp8_moe_ops.py \
        tests/worker/test_gpu_moe.py ;;
    quant-latency)  # batch-1 TPOT: FP8 block-wise <= 0.6x bf16's, AWQ INT4 <= 0.45x
        for q in bf16 fp8 awq; do
            flags=()
            [ "$q" != bf16 ] && flags=(--quantization "$q")
            run "latency qwen3-8b $q" 200 $B latency --geometry qwen3-8b "${flags[@]}" \
                --batch-size 1 --input-len 512 --output-len 128 --num-iters-warmup 2 --num-iters 5
        done ;;
    quant-throughput)  # the reference workload: FP8 block-wise >= 1.2x bf16's output tok/s
        run "throughput qwen3-8b bf16" 300 $B throughput --geometry qwen3-8b
        run "throughput qwen3-8b fp8" 300 $B throughput --geometry qwen3-8b --quantization fp8 ;;
    quant-kernels) run quant-kernels 200 $S/kernels.py --only quant ;;  # + Qwen3-30B-A3B's FP8 experts
    quant-accuracy) run quant-accuracy 200 $S/kv_accuracy.py --geometry qwen3-8b --quantization fp8 ;;
    esac
done

echo "======== summary ($((SECONDS - START)) s)"
grep -E "^== |passed|failed|FAILED|Error|Throughput:|LLM\(\) to ready|engine core ready|^Run |\
after start-up|floor, |Elapsed|TTFT|TPOT|prefill of|host launch|\
agreement|KV cache: [0-9]|captured|decode attention|cascade attention|prefill attention|\
steps, |^decode <=|^prefill \(|decode step|graph replay|quantized linear|fp8 moe" "$LOG" \
    | grep -v "^== .*: python\|^== .*: env\|^== .*: timeout" | cut -c1-200
