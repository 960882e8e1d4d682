# specrl on one GPU node: learner and actors share this image (see docker-compose.yml).
# Base: CUDA runtime + Python 3.11. The CUDA build of torch is installed first, then specrl with
# the vLLM extra (engine=vllm); the torch engine needs nothing more.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pip redis-tools \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY pyproject.toml README.md ./
COPY actors actors
COPY learner learner
COPY common common
COPY ops ops
COPY configs configs
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG EXTRAS=vllm
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX} \
    && pip install -e ".[${EXTRAS}]"
# Actor replicas start through docker/actor.sh (an identity per container; see docker-compose.yml).
COPY docker docker

# Checkpoints and metrics live on a volume (docker-compose.yml mounts one at /runs).
ENV SPECRL_CONFIG_DIR=/app/configs
WORKDIR /runs
CMD ["specrl", "--help"]
