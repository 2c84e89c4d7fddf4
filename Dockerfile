# prefixpool image: router, worker, etcd launcher and Ray deployment in one.
#   docker build -t prefixpool:0.1.0 .                                   # CUDA torch (GPU nodes)
#   docker build -t prefixpool:0.1.0-cpu --build-arg TORCH_SPEC=torch==2.13.0 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .  # CPU-only clusters
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libxxhash-dev libnuma1 \
 && rm -rf /var/lib/apt/lists/*

ARG TORCH_SPEC=torch
ARG TORCH_INDEX=
RUN pip install --no-cache-dir ${TORCH_INDEX:+--index-url $TORCH_INDEX} "$TORCH_SPEC"

WORKDIR /opt/prefixpool
COPY pyproject.toml setup.py README.md ./
COPY prefixpool prefixpool
RUN pip install --no-cache-dir ".[ucx,ray]"

RUN useradd --create-home --uid 1000 prefixpool
USER prefixpool
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["prefixpool"]
CMD ["--help"]
