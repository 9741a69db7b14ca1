# Prometheus from Debian's package, for machines that cannot pull prom/prometheus (no image
# registry in reach): docker/compose.local.yaml swaps it in. Same flags and mounts as the
# compose service; wget for its healthcheck.
ARG PYTHON_IMAGE=debian:bookworm-slim
FROM ${PYTHON_IMAGE}

# The package's postinst would start a daemon where an init system runs: policy-rc.d forbids it.
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
    && apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d \
    && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
