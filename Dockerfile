# syntax=docker/dockerfile:1
# Runtime image of shopsimrl: the `shopsimrl` CLI (worker, wait-ready, reduce, status, testbed)
# plus the repository's configs/ at /app/configs.
#   docker build -t shopsimrl:dev .        (or: make image)
# Both stages use the same base so the venv's interpreter symlinks stay valid.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/venv
# Metadata first, so a source-only change reuses nothing it should not, and nothing more.
COPY pyproject.toml README.md ./
COPY shopsimrl ./shopsimrl
RUN /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/pip install --no-cache-dir . \
 && /opt/venv/bin/pip uninstall --yes pip \
 && find /opt/venv -name '__pycache__' -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="shopsimrl" \
      org.opencontainers.image.description="Deterministic, resumable evaluation of LLM shopping agents on ShopSimulator" \
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
# Testbed ports (`shopsimrl testbed shop` / `policy`); the worker itself listens on nothing.
EXPOSE 5700 8000
ENTRYPOINT ["shopsimrl"]
CMD ["--help"]
