#!/usr/bin/env bash
# servprof on a GPU as users meet it, in one command for a lent GPU machine: traces recorded the
# way users record them (torch.profiler around transformers' generate, a hand-written loop, a
# compiled static-cache model), every test server under load with servprof sampling, and the
# tests that serve those servers run with the model on the GPU. Results under $OUT (traces gzipped,
# analyses, logs); each part has its own limit inside one deadline (bench/gpu/parts.sh).
#
#   OUT=/tmp/gpu DEADLINE_S=420 bash bench/gpu/wild_checks.sh
#
# A shorter rerun picks its parts: USER_VARIANTS (user_traces.py's), SERVERS (servers_on_gpu.py's
# names, "" for none), TESTS (pytest paths, "" for none), STATIC=0 (no compiled static-cache trace).
set -u
source "$(dirname "$0")/parts.sh"
export SERVPROF_TEST_DEVICE=${SERVPROF_TEST_DEVICE:-cuda}
USER_VARIANTS=${USER_VARIANTS-plain shapes schedule sync_loop}
SERVERS=${SERVERS-all}
TESTS=${TESTS-tests/test_zero_touch.py tests/test_concurrent_requests.py tests/test_queue_wait.py
tests/test_embeddings_server.py tests/test_model_on_loop.py tests/test_process_pool_server.py
tests/test_compiled_model_steps.py}
part env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc;
python3 -c "import torch, transformers, fastapi, servprof.middleware; print(torch.__version__, transformers.__version__)"'

# Users' own traces of generate(), the model alone on the GPU (0.2B Llama, bf16).
mkdir -p "$R/user"
[ -n "$USER_VARIANTS" ] && part user_traces 90 env SERVPROF_TEST_MODEL=gpu python3 bench/gpu/user_traces.py \
    --out "$R/user" $USER_VARIANTS

# The test servers served with servprof (0.2B model; handwritten_loop and embeddings keep their own
# small models), four at a time, beside the server tests on the tiny model.
only=()
[ "$SERVERS" != all ] && only=(--only $SERVERS)
[ -n "$SERVERS" ] && part servers 240 python3 bench/gpu/servers_on_gpu.py --out "$R/servers" \
    --device "$SERVPROF_TEST_DEVICE" --model gpu --seconds 15 --parallel "${PARALLEL:-4}" "${only[@]}" &
[ -n "$TESTS" ] && part server_tests 200 python3 -m pytest -q -p no:cacheprovider -rfE --durations=8 $TESTS
wait
[ "${STATIC:-1}" = 1 ] && part user_static 100 env SERVPROF_TEST_MODEL=gpu python3 bench/gpu/user_traces.py \
    --out "$R/user" static
analyze_all() {
    mkdir -p "$R/user_analysis"
    for f in "$R"/user/*.json; do
        local name=$(basename "${f%.json}")
        python3 -m servprof.cli analyze "$f" --json "$R/user_analysis/$name.json" >"$R/user_analysis/$name.txt" 2>&1 &
    done
    wait
}
export -f analyze_all
part analyze_user 40 bash -c analyze_all
log "done"
# What comes back: at most 8 files of 16 MiB; the users' traces one file each, the rest in one archive.
gzip -f "$R"/user/*.json 2>/dev/null
mv "$R"/user/*.json.gz "$OUT/" 2>/dev/null
find "$OUT" -maxdepth 1 -name '*.json.gz' -size +15M -print -delete | sed 's/^/left behind (size): /' >>"$R/parts.txt"
cp "$R/parts.txt" "$OUT/" 2>/dev/null
cp "$R/servers/summary.md" "$OUT/" 2>/dev/null
tar -C "$R" -czf "$OUT/results.tgz" .
[ "$(stat -c %s "$OUT/results.tgz")" -gt 15000000 ] && find "$R/servers" -name '*.pt.trace.json.gz' -delete &&
    tar -C "$R" -czf "$OUT/results.tgz" . && echo "server traces left behind (size)" >>"$OUT/parts.txt"
ls -la "$OUT"
