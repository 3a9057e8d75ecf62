# syntax=docker/dockerfile:1
# Worker image of shopsimrl: the `shopsimrl` CLI as a worker pod runs it (worker, wait-ready,
# reduce, status) plus the repository's configs/ at /app/configs. Nothing else: the testbed has
# its own image (docker/testbed.Dockerfile), and the Kubernetes client comes only with
# EXTRAS=kube, the reducer's image when it watches its worker Job (docs/kubernetes.md).
#   docker build -t shopsimrl:dev .                                    (or: make image)
#   docker build --build-arg EXTRAS=kube -t shopsimrl-kube:dev .       (or: make image-kube)
# Both stages use the same base so the venv's interpreter symlinks stay valid.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
# Extras of the project to install (pyproject.toml), e.g. "kube"; empty: the bare worker.
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml README.md constraints.txt ./
COPY shopsimrl ./shopsimrl
# Without shopsimrl/testbed (its servers and a 2.6 MB catalog) setuptools packages none of it;
# `shopsimrl testbed ...` then says which image has it. Every version pinned by constraints.txt.
RUN rm -rf shopsimrl/testbed \
 && /opt/venv/bin/pip install --no-cache-dir --constraint constraints.txt ".${EXTRAS:+[$EXTRAS]}" \
 && /opt/venv/bin/pip uninstall --yes pip \
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
