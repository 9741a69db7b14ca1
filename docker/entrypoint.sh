#!/bin/sh
# Entry point of the edge-gateway and cloud-verifier images: prepare the embedded model pair,
# then exec the service. The image already holds it in /models, but /models is normally a
# named volume that outlives images: re-running prepare (a no-op in well under a second
# when its stamps match the sources) rebuilds a pair that a newer image ships differently.
# Skipped when the service is given its own model (a path or a Hugging Face id).
set -eu
case "${ASYMSPEC_EDGE_DRAFT_MODEL:-}${ASYMSPEC_CLOUD_TARGET_MODEL:-}" in
  "" | embedded:*) python -m asymspec_engine.prepare ;;
esac
exec "$@"
