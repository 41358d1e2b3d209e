# What every GPU check script starts with (sourced): $R for results under $OUT, one overall deadline,
# `part` to run a step within it, and the carried wheels installed.
OUT=${OUT:-/tmp/servprof-gpu}
R=$OUT/r
mkdir -p "$R"
DEADLINE_S=${DEADLINE_S:-540}
export R
T0=$(date +%s)
export PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=6 SERVPROF_CACHE_DIR=$R/cache
log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$R/parts.txt"; }
# part NAME LIMIT_S COMMAND...: runs COMMAND with its output in $R/NAME.log, within the deadline.
part() {
    local name=$1 limit=$2 left
    shift 2
    left=$((DEADLINE_S - ($(date +%s) - T0) - 15))
    if [ "$left" -lt 20 ]; then log "skip $name (deadline)"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    log "start $name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@" >"$R/$name.log" 2>&1
    local rc=$?
    log "end $name rc=$rc $(tail -c 300 "$R/$name.log" | tr '\n' ' ' | tail -c 200)"
}

if [ -d .whl ] && [ -z "${NO_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$R/wheels.log" 2>&1 || { log "wheel install failed"; tail -5 "$R/wheels.log"; }
fi
export PYTHONPATH=/tmp/site:$PWD
