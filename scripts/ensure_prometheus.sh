#!/usr/bin/env bash
# Make a `prometheus` binary available for tests/observability (the dashboard test runs a
# real Prometheus against real services). Debian's package is enough: the dashboards use
# only PromQL that 2.x evaluates. Idempotent; needs root only when it has to install.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1; then
  prometheus --version 2>&1 | head -n 1
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "prometheus is not installed and this is not root: run 'apt-get install prometheus'" >&2
  exit 1
fi
# The package's postinst would start a daemon on :9090 where an init system runs; a
# policy-rc.d that answers 101 forbids that (CI needs only the binary, not a server).
policy=/usr/sbin/policy-rc.d
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod +x "$policy"
  trap 'rm -f "$policy"' EXIT
fi
apt-get update -qq
# --no-install-recommends: no node-exporter, no web console extras.
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
prometheus --version 2>&1 | head -n 1
