# trl-exreplay on a GPU machine: the library with ALFWorld and DeepSpeed, and the ALFWorld recipe as the entry.
#
#   docker build -t trl-exreplay .                              # add --build-arg WITH_VLLM=true for vLLM generation
#   docker run --gpus all --rm -v "$PWD/data:/workspace/trl-exreplay/data" trl-exreplay \
#       --config_file recipes/accelerate/single_gpu.yaml recipes/alfworld.py \
#       --config recipes/configs/alfworld_qwen2.5-1.5b.yaml
#
# The arguments after the image name are `accelerate launch`'s: its options, the script, then the script's options.
# With none, the image runs `accelerate launch recipes/alfworld.py` (the tiny CPU default config).
# This image is not built in this project's CI (no container engine there); CI lints this file with hadolint and
# checks its contract in tests/test_dockerfile.py.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

# ---- build: a virtual environment with torch (CUDA wheels bring their own CUDA libraries) and the package
FROM ${CUDA_IMAGE} AS build
# ALFWorld's planner (fast-downward) and jericho are built from source: a compiler and cmake are needed here only.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv "$VIRTUAL_ENV"
ENV PATH="$VIRTUAL_ENV/bin:$PATH"
RUN pip install --no-cache-dir "torch==2.13.0"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY trl_exreplay ./trl_exreplay
# DL3013: the package from this folder; pyproject.toml pins its dependencies' ranges (trl to one minor release).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[alfworld,deepspeed]"
ARG WITH_VLLM=false
# DL3013: the vLLM release pip resolves against the torch installed above.
# hadolint ignore=DL3013
RUN if [ "$WITH_VLLM" = "true" ]; then pip install --no-cache-dir vllm; fi

# ---- run: the environment and the recipes, as a non-root user
FROM ${CUDA_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1001 exreplay && useradd --create-home --uid 1001 --gid 1001 exreplay
ENV VIRTUAL_ENV=/opt/venv
# DL3064 reads TOKENIZERS_PARALLELISM as a token: it only silences the tokenizers' fork warning.
# hadolint ignore=DL3064
ENV PATH="$VIRTUAL_ENV/bin:$PATH" HF_HOME=/workspace/cache OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
COPY --from=build /opt/venv /opt/venv
WORKDIR /workspace/trl-exreplay
COPY --chown=1001:1001 recipes ./recipes
RUN mkdir -p /workspace/cache data outputs && chown -R 1001:1001 /workspace
USER 1001:1001
ENTRYPOINT ["accelerate", "launch"]
CMD ["recipes/alfworld.py"]
