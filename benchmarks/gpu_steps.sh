# Sourced by the GPU figure scripts (h100_figures.sh, moe_gpu.sh, spec_decode_gpu.sh,
# window_gpu.sh) once they have set OUT: the log ($OUT/log.txt), the step budget ($BUDGET_S
# seconds, default 540, so a call ends inside a 600 s limit), `run` and `log_machine`.
BUDGET_S=${BUDGET_S:-540}
mkdir -p "$OUT"
LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
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

log_machine() {  # the GPUs and the tree, first in the log
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a "$LOG"
    git log -1 --format='tree %h %s' 2>/dev/null | cut -c1-80 | tee -a "$LOG"
}
