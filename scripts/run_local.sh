#!/usr/bin/env bash
# `make run`: serve the cloud verifier (:8001) and the edge gateway (:8000) on loopback with
# the embedded model pair. Settings come from the environment (see README); Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export ASYMSPEC_CLOUD_PORT="${ASYMSPEC_CLOUD_PORT:-8001}" ASYMSPEC_EDGE_PORT="${ASYMSPEC_EDGE_PORT:-8000}"
export ASYMSPEC_EDGE_CLOUD_URL="${ASYMSPEC_EDGE_CLOUD_URL:-ws://127.0.0.1:${ASYMSPEC_CLOUD_PORT}/v1/channel}"
# Both services share this host: split the cores between their torch threads (2 cores:
# 1 + 1) instead of both taking every core. ASYMSPEC_{CLOUD,EDGE}_THREADS override.
export ASYMSPEC_COLOCATED="${ASYMSPEC_COLOCATED:-true}"

# The edge<->cloud secret is required; a local run makes one up unless you set it.
secret="${ASYMSPEC_SHARED_SECRET:-$("$PY" -c 'import secrets; print(secrets.token_urlsafe(24))')}"
export ASYMSPEC_CLOUD_SHARED_SECRET="${ASYMSPEC_CLOUD_SHARED_SECRET:-$secret}"
export ASYMSPEC_EDGE_SHARED_SECRET="${ASYMSPEC_EDGE_SHARED_SECRET:-$secret}"

pids=()
stop() { trap - INT TERM EXIT; kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap stop INT TERM EXIT

wait_healthy() {  # name url
  "$PY" - "$1" "$2" <<'PYEOF'
import sys, time, httpx
name, url = sys.argv[1:]
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        r = httpx.get(url, timeout=2)
        if r.status_code == 200:
            print(f"{name} is ready: {url}")
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(f"{name} did not become healthy at {url}")
PYEOF
}

"$PY" -m cloud_verifier & pids+=($!)
wait_healthy "cloud verifier" "http://127.0.0.1:${ASYMSPEC_CLOUD_PORT}/health"
"$PY" -m edge_gateway & pids+=($!)
wait_healthy "edge gateway" "http://127.0.0.1:${ASYMSPEC_EDGE_PORT}/health"

cat <<MSG

asymspec is serving (mode: ${ASYMSPEC_MODE:-asymspec}). Try:

  curl -N http://127.0.0.1:${ASYMSPEC_EDGE_PORT}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "asymspec", "messages": [{"role": "user", "content": "Write a Python function that reverses a string."}], "max_tokens": 96, "temperature": 0, "stream": true}'

  curl http://127.0.0.1:${ASYMSPEC_EDGE_PORT}/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "asymspec", "prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0.7, "seed": 1}'

  curl http://127.0.0.1:${ASYMSPEC_EDGE_PORT}/metrics     # Prometheus metrics (edge); cloud: :${ASYMSPEC_CLOUD_PORT}/metrics

Ctrl-C stops both services.
MSG
wait -n "${pids[@]}"
