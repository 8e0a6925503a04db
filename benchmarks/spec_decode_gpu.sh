#!/usr/bin/env bash
# Speculative decoding's figures on one H100, in one call, most important first:
#   bash benchmarks/spec_decode_gpu.sh [tests] [copy] [copy-dummy] [copy-8b] [reference]
#        [self] [self-fp32] [pair]
# (no arguments: all of them, in that order):
#   tests       the GPU tests of the verification path (CUDA graphs, draft model)
#   copy        batch 1, copy-heavy chat prompts, SmolLM2-135M-Instruct (GGUF, bf16):
#               output tok/s without and with n-gram speculation, greedy tokens compared
#   copy-dummy  the same on Qwen3-0.6B's geometry (random weights, a repeated token block)
#   copy-8b     the same on Qwen3-8B's geometry, whose forward dwarfs a step's host work
#   reference   the reference workload (bench throughput) without and with n-gram
#   self        Qwen3-0.6B as its own draft model: every draft accepted at temperature 0
#   self-fp32   the same in float32 (no bfloat16 near-ties between the kernels)
#   pair        a draft model of another geometry (Qwen3-0.6B for Qwen3-8B, random weights)
# Each step's output goes to $OUT/log.txt, its figures to $OUT/*.json; a summary of the lines
# that carry figures is printed last. Steps start only while less than $BUDGET_S seconds
# (default 540) have passed, so the call ends inside a 600 s limit.
set -u
OUT=${OUT:-/tmp/minivllm-spec}
source "$(dirname "$0")/gpu_steps.sh"
PY=${PY:-python3}
B="$PY -m minivllm.frontend.cli bench"
S="$PY benchmarks/spec_decode.py"
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(tests copy copy-dummy copy-8b reference self self-fp32 pair)

log_machine
for step in "${STEPS[@]}"; do
    case $step in
    tests) run tests 240 $PY -m pytest -q -m gpu -p no:cacheprovider tests/worker/test_gpu_spec_decode.py ;;
    copy) run copy 150 $S copy --output-json "$OUT/copy.json" ;;
    copy-dummy) run copy-dummy 120 $S copy --geometry qwen3-0.6b --output-json "$OUT/copy_dummy.json" ;;
    copy-8b) run copy-8b 180 $S copy --geometry qwen3-8b --max-tokens 128 \
        --output-json "$OUT/copy_8b.json" ;;
    reference)
        run "reference" 150 $B throughput --output-json "$OUT/reference.json"
        run "reference ngram" 150 $B throughput --speculative-config "$NGRAM" \
            --output-json "$OUT/reference_ngram.json" ;;
    self) run self 120 $S draft --geometry qwen3-0.6b --draft-geometry self \
        --output-json "$OUT/self.json" ;;
    self-fp32) run self-fp32 150 $S draft --geometry qwen3-0.6b --draft-geometry self \
        --dtype float32 --output-json "$OUT/self_fp32.json" ;;
    pair) run pair 150 $S draft --geometry qwen3-8b --draft-geometry qwen3-0.6b \
        --output-json "$OUT/pair.json" ;;
    *) echo "unknown step $step" | tee -a "$LOG" ;;
    esac
done
echo "== summary"
grep -E "^(==|copy|draft model|Throughput|SpecDecoding|Model:|[0-9]+ passed|FAILED|Traceback|[A-Za-z]*Error)" "$LOG"
