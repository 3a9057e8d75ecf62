# syntax=docker/dockerfile:1
# Worker image of shopsimrl: the `shopsimrl` CLI as a worker pod runs it (worker, wait-ready,
# reduce, status) plus the repository's configs/ at /app/configs: the core distribution alone.
# The testbed has its own image (docker/testbed.Dockerfile), the research tools stay on
# researchers' machines, and the Kubernetes client comes only with
# EXTRAS=kube, the reducer's image when it watches its worker Job (docs/kubernetes.md).
#   docker build -t shopsimrl:dev .                                    (or: make image)
#   docker build --build-arg EXTRAS=kube -t shopsimrl-kube:dev .       (or: make image-kube)
# The base is pinned by digest (the tag says which Python, the digest which exact image);
# scripts/pin-base-image.sh moves both Dockerfiles to the digest the tag points at now. Both
# stages use the same base so the venv's interpreter symlinks stay valid.
ARG PYTHON_IMAGE=python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

FROM ${PYTHON_IMAGE} AS builder
# Extras of the project to install: "" (the bare worker) or "kube", each with its hashed
# requirements file, docker/requirements/worker[-EXTRAS].txt.
ARG EXTRAS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/venv \
 && python -m venv /opt/build
# The dependencies first, in their own layer: a change of the source reinstalls none of them.
# Every file pip downloads must match a hash in docker/requirements/ (generated from
# constraints.txt by scripts/image-requirements.py), and only wheels are taken. pip's cache is a
# BuildKit cache mount: it serves the next build on this builder and never lands in a layer.
COPY docker/requirements/ ./requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/build/bin/pip install --require-hashes --only-binary=:all: --no-compile -r requirements/build.txt \
 && /opt/venv/bin/pip install --require-hashes --only-binary=:all: --no-compile -r "requirements/worker${EXTRAS:+-$EXTRAS}.txt"
COPY pyproject.toml README.md ./
COPY shopsimrl ./shopsimrl
# The core's wheel alone: setuptools packages neither shopsimrl/research nor shopsimrl/testbed
# (distributions of their own, pyproject.toml's packages.find), so neither the testbed's servers
# and 2.6 MB catalog nor the research tools reach the image; `shopsimrl testbed ...` and the
# research commands then say which image or distribution has them. The wheel is built by the
# hashed build backend without build isolation (nothing unhashed is downloaded) and installed
# without dependencies; pip check proves the hashed layer holds all it requires.
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --no-index --wheel-dir /tmp/dist . \
 && /opt/venv/bin/pip install --no-deps --no-index --no-compile /tmp/dist/shopsimrl-*.whl \
 && /opt/venv/bin/pip check \
 && /opt/venv/bin/pip uninstall --yes pip setuptools \
 && find /opt/venv -name '__pycache__' -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="shopsimrl" \
      org.opencontainers.image.description="Deterministic, resumable evaluation of LLM shopping agents on ShopSimulator: the shard worker" \
      org.opencontainers.image.licenses="Apache-2.0"
# Non-root user with a fixed UID/GID, matching the chart's podSecurity.runAsUser; no pip or
# setuptools left in the runtime image.
RUN groupadd --system --gid 10001 shopsimrl \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin shopsimrl \
 && python -m pip uninstall --yes pip setuptools wheel
COPY --from=builder /opt/venv /opt/venv
COPY configs /app/configs
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    SHOPSIMRL_LOG_FORMAT=json
WORKDIR /app
USER 10001:10001
# The worker listens on nothing: no EXPOSE.
ENTRYPOINT ["shopsimrl"]
CMD ["--help"]
