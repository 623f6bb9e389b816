#!/usr/bin/env bash
# Scenario serve: `entrollm serve` under concurrent streaming clients: every answer checked
# against its prompt's greedy answer (bench/serve-load.py), busy and failed requests, tok/s, and
# the server's resident memory after the solo answers and after the run.
#   Inputs:  MODEL (default: SmolLM2 Q4_1's container, compressed here from scripts/fetch-smollm2),
#            CLIENTS (default 64; --tiny: 4), LOAD_SECONDS (default 120; --tiny: 5), PORT (default 8093),
#            SERVE_ARGS (more `serve` flags, e.g. "--max-queue 64").
#   Peers:   the model's own greedy answers, asked one at a time first (serve-load.py).
#   Outputs: $OUT/load.out (a summary line and one JSON line), serve.err, $OUT.tar.xz.
#   Run:     bash bench/scenarios/serve.sh [--dry-run | --tiny]   (DEVICE=cuda serves on the GPU)
. "$(dirname "$0")/lib.sh"
setup
if [ -n "${MODEL:-}" ]; then m=$MODEL
else
    g=$([ $DRY = 1 ] && echo SMOLLM2.gguf || "$REPO/scripts/fetch-smollm2" | tail -1); m=$W/smollm2-container
    [ $DRY = 0 ] && [ -f "$m/entrollm.json" ] || run compress "$B" compress "$g" -o "$m" --overwrite
fi
port=${PORT:-8093}; clients=${CLIENTS:-$([ $TINY = 1 ] && echo 4 || echo 64)}; secs=${LOAD_SECONDS:-$([ $TINY = 1 ] && echo 5 || echo 120)}
if [ $DRY = 1 ]; then
    x "$B" serve "$m" --device "$DEVICE" --port "$port" ${SERVE_ARGS:-}
    x python3 "$REPO/bench/serve-load.py" "http://127.0.0.1:$port" --clients "$clients" --seconds "$secs" --pid PID
    finish; exit 0
fi
"$B" serve "$m" --device "$DEVICE" --port "$port" ${SERVE_ARGS:-} > "$OUT/serve.out" 2> "$OUT/serve.err" &
pid=$!
trap 'kill $pid 2>/dev/null' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
run load python3 "$REPO/bench/serve-load.py" "http://127.0.0.1:$port" --clients "$clients" --seconds "$secs" --pid "$pid"
el "$(head -1 "$OUT/load.out")"
finish
