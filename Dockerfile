# specrl on a GPU node: the learner and the actors run this image (docker-compose.yml with
# docker-compose.override.yml, and docker-compose.gpu.yml from scripts/compose_gpu.py).
#
# One CUDA major throughout (13): this base image's CUDA runtime, torch 2.13.0 from PyPI (built
# for CUDA 13.0) and the vLLM 0.32.0 wheel that pins that torch (its extensions link
# libcudart.so.13), all installed from docker/requirements-gpu.txt, the lock that
# `bash docker/lock-gpu.sh` writes and tests/test_image_pins.py checks.
# The host needs an x86_64 CPU, NVIDIA driver 580 or newer (CUDA 13.0) and the NVIDIA container
# toolkit. The base image sets NVIDIA_REQUIRE_CUDA, so the toolkit refuses to start a container
# on an older driver and says so.
FROM nvidia/cuda:13.0.0-base-ubuntu24.04

# Ubuntu 24.04's Python; docker/lock-gpu.sh resolves the lock for this version.
ARG PYTHON_VERSION=3.12
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Triton (vLLM's sampler and model runner, torch.compile) compiles a small C launcher the first
# time it runs a kernel: it needs a C compiler, the C library's headers and Python.h at run time.
# redis-tools: the compose health checks. bubblewrap: the reward sandbox
# (task.reward_sandbox=true), which also needs a seccomp profile that allows user namespaces
# (docs/recipes.md).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python${PYTHON_VERSION} \
        python${PYTHON_VERSION}-venv python${PYTHON_VERSION}-dev gcc libc6-dev redis-tools \
        bubblewrap \
    && rm -rf /var/lib/apt/lists/*
RUN python${PYTHON_VERSION} -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# What Triton's compile step does, in miniature: a C file that includes Python.h must compile.
RUN printf '#include <Python.h>\nint main(void) { return 0; }\n' > /tmp/triton-check.c \
    && gcc -fsyntax-only -I"$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
        /tmp/triton-check.c \
    && rm /tmp/triton-check.c

# The dependencies, every one pinned with its hashes, in a layer of their own: a change to
# specrl's code does not reinstall them. Then torch's CUDA must be the base image's major.
COPY docker/requirements-gpu.txt /tmp/requirements-gpu.txt
RUN pip install --require-hashes -r /tmp/requirements-gpu.txt \
    && python -c 'import os, torch; cuda = os.environ["CUDA_VERSION"]; \
assert torch.version.cuda.split(".")[0] == cuda.split(".")[0], (torch.version.cuda, cuda)'

WORKDIR /app
COPY pyproject.toml README.md ./
COPY actors actors
COPY learner learner
COPY common common
COPY ops ops
COPY configs configs
# specrl itself, without dependencies (all are in the lock); pip check: nothing is missing or
# conflicting.
RUN pip install --no-deps --no-build-isolation -e . && pip check
# Actor replicas start through docker/actor.sh (an identity per container; see docker-compose.yml).
COPY docker docker

# Checkpoints and metrics live on a volume (docker-compose.yml mounts one at /runs).
ENV SPECRL_CONFIG_DIR=/app/configs
WORKDIR /runs
CMD ["specrl", "--help"]
