#!/usr/bin/env bash
# Make a `prometheus` binary available for tests/observability (the dashboard tests run a
# real Prometheus against real services). Debian's package is enough: the dashboards use
# only PromQL that 2.x evaluates. Idempotent. Installs as root, or through passwordless
# sudo; otherwise it says so and exits 0: those tests then skip and name the reason
# (ASYMSPEC_REQUIRE_PROMETHEUS=1, as .ci/run sets, makes a missing binary fail them).
set -euo pipefail

if command -v prometheus >/dev/null 2>&1; then
  prometheus --version 2>&1 | head -n 1
  exit 0
fi
if [[ $(id -u) -eq 0 ]]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "prometheus: not installed, and installing it needs root (apt-get install prometheus);" \
    "the tests that query a real Prometheus will be skipped" >&2
  exit 0
fi
# The package's postinst would start a daemon on :9090 where an init system runs; a
# policy-rc.d that answers 101 forbids that (CI needs only the binary, not a server).
policy=/usr/sbin/policy-rc.d
if [[ ! -e $policy ]]; then
  "${as_root[@]}" sh -c "printf '#!/bin/sh\nexit 101\n' >$policy && chmod +x $policy"
  trap '"${as_root[@]}" rm -f "$policy"' EXIT
fi
"${as_root[@]}" apt-get update -qq
# --no-install-recommends: no node-exporter, no web console extras.
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends prometheus
prometheus --version 2>&1 | head -n 1
