#!/usr/bin/env bash
# The GPU checks of issues 14 and 15 as one command for a lent GPU machine (H100/H200, torch with
# CUDA, ncu, no network): every part has its own time limit inside one overall deadline, writes
# under $OUT/r as it goes, and a part that fails or runs out of time leaves the others' results.
# Pure-Python dependencies travel as wheels in .whl/: bench/gpu/device-wheels.txt says which and how.
#
#   OUT=/tmp/gpu DEADLINE_S=540 bash bench/gpu/device_checks.sh
set -u
source "$(dirname "$0")/parts.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
export NCU R
log "ncu: ${NCU:-none}"
part env 30 bash -c 'nvidia-smi; "$NCU" --version; python3 -c "import torch, transformers, servprof.middleware, locust, fastapi;
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0));
print(\"transformers\", transformers.__version__)"'

# Issue 15: calibration, then one decode step at batch 1/8/32 under torch.profiler and under ncu.
part calibrate 60 bash -c 'python3 -m servprof.cli calibrate && python3 -m servprof.cli calibrate --copy-mib 2048 --no-save \
    && python3 -m servprof.cli calibrate --copy-mib 64 --no-save'
mkdir -p "$R/bw"
part bw_profile 90 python3 bench/gpu/decode_step.py profile --batch 1 8 32 --out "$R/bw"
ncu_step() {
    "$NCU" --profile-from-start off --target-processes all --clock-control none \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        --csv --page raw --print-units base --log-file "$R/bw/ncu_b$1.csv" \
        python3 bench/gpu/decode_step.py ncu --batch "$1" &&
    python3 bench/gpu/ncu_compare.py "$R/bw/decode_b$1.json.gz" "$R/bw/ncu_b$1.csv" --json "$R/bw/compare_b$1.json"
}
export -f ncu_step
[ -n "$NCU" ] && part ncu_b1 90 bash -c 'ncu_step 1'

# Issue 14: small real CUDA traces of the demo engine (the fixtures), then the demo server under load.
mkdir -p "$R/fx"
part fixtures_tiny 60 python3 bench/record_fixtures.py --device cuda --size tiny --out "$R/fx" \
    --only clean step_delay_20ms sync_per_step
[ -n "$NCU" ] && part ncu_b32 90 bash -c 'ncu_step 32'
demo() {
    python3 -m servprof.cli demo --device cuda --size 1b --duration 15 --users 8 --sample 4 --out "$R/demo_$1" "${@:2}"
}
export -f demo
part demo_gap 80 bash -c 'demo gap --inject decode-gap'
part demo_sync 80 bash -c 'demo sync --inject sync'
[ -n "$NCU" ] && part ncu_b8 90 bash -c 'ncu_step 8'
part demo_clean 80 bash -c 'demo clean'
part zero_touch 150 env SERVPROF_TEST_DEVICE=cuda python3 -m pytest tests/test_zero_touch.py -q -p no:cacheprovider
part lag 120 python3 bench/bench_sampling_lag.py --device cuda --size 1b --users 8 --baseline-s 6 --window-s 3 \
    --repeat 1 --budgets 0 1 5 --details --status-out "$R/lag_status.json"
part fixtures_small 60 python3 bench/record_fixtures.py --device cuda --size small --out "$R/fx" \
    --only clean step_delay_20ms sync_per_step
for f in "$R"/fx/*.json.gz; do
    [ -f "$f" ] && timeout 60 python3 -m servprof.cli analyze "$f" --json "${f%.json.gz}.analysis.json" >/dev/null 2>&1
done
log "done"
# What comes back: at most 8 files of at most 16 MiB; big traces stay behind (their analyses come back).
find "$R" -name '*.json.gz' -size +6M -print -delete | sed 's/^/left behind (size): /' >>"$R/parts.txt"
tar -C "$R" -czf "$OUT/results.tgz" --exclude='demo_*' .
for d in "$R"/demo_*; do [ -d "$d" ] && tar -C "$R" -czf "$OUT/$(basename "$d").tgz" "$(basename "$d")"; done
cp "$R/parts.txt" "$OUT/parts.txt"
ls -la "$OUT"
