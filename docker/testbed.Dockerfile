# syntax=docker/dockerfile:1
# Testbed image: the local stand-ins for smoke runs and demos, the ShopSimulator-compatible shop
# (with its synthetic catalog) and the heuristic policy: the core and shopsimrl-testbed
# (shopsimrl/testbed/, a distribution of its own), not the research tools.
# The chart's testbed mode runs it (testbed.image); workers never do.
#   docker build -f docker/testbed.Dockerfile -t shopsimrl-testbed:dev .     (or: make image-testbed)
#   docker run -p 5700:5700 shopsimrl-testbed:dev                                            # shop
#   docker run -p 8000:8000 shopsimrl-testbed:dev testbed policy --host 0.0.0.0 --port 8000  # policy
# The same pinned base, and the same build, as ./Dockerfile (see there).
ARG PYTHON_IMAGE=python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/venv \
 && python -m venv /opt/build
# Hashed dependencies first (docker/requirements/testbed.txt: the core's and the testbed's), then
# the source.
COPY docker/requirements/ ./requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/build/bin/pip install --require-hashes --only-binary=:all: --no-compile -r requirements/build.txt \
 && /opt/venv/bin/pip install --require-hashes --only-binary=:all: --no-compile -r requirements/testbed.txt
COPY pyproject.toml README.md ./
COPY shopsimrl ./shopsimrl
# Two wheels: the core and the testbed (its pyproject.toml in shopsimrl/testbed/); setuptools
# leaves shopsimrl/research out of the core's.
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --no-index --wheel-dir /tmp/dist . ./shopsimrl/testbed \
 && /opt/venv/bin/pip install --no-deps --no-index --no-compile /tmp/dist/shopsimrl-*.whl /tmp/dist/shopsimrl_testbed-*.whl \
 && /opt/venv/bin/pip check \
 && /opt/venv/bin/pip uninstall --yes pip setuptools \
 && find /opt/venv -name '__pycache__' -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="shopsimrl-testbed" \
      org.opencontainers.image.description="Local stand-ins for shopsimrl smoke runs: a ShopSimulator-compatible shop and a heuristic policy" \
      org.opencontainers.image.licenses="Apache-2.0"
# The same non-root user as the worker image (the chart's podSecurity applies to both).
RUN groupadd --system --gid 10001 shopsimrl \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin shopsimrl \
 && python -m pip uninstall --yes pip setuptools wheel
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    SHOPSIMRL_LOG_FORMAT=console
WORKDIR /app
USER 10001:10001
EXPOSE 5700 8000
# Healthy when whichever service runs answers: the shop's /healthz or the policy's /health.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 CMD ["python", "-c", "import sys, urllib.request as u\nfor url in ('http://127.0.0.1:5700/healthz', 'http://127.0.0.1:8000/health'):\n    try:\n        u.urlopen(url, timeout=2)\n        sys.exit(0)\n    except OSError:\n        pass\nsys.exit(1)"]
ENTRYPOINT ["shopsimrl"]
CMD ["testbed", "shop", "--host", "0.0.0.0", "--port", "5700"]
