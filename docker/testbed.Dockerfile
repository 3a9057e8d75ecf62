# syntax=docker/dockerfile:1
# Testbed services for smoke runs and demos: the ShopSimulator stand-in and the heuristic
# policy are subcommands of the runtime image, so this image only adds a default command.
# One image, two commands:
#   docker build -t shopsimrl:dev . && \
#   docker build -f docker/testbed.Dockerfile --build-arg RUNTIME_IMAGE=shopsimrl:dev -t shopsimrl-testbed:dev .
#   docker run -p 5700:5700 shopsimrl-testbed:dev                                            # shop
#   docker run -p 8000:8000 shopsimrl-testbed:dev testbed policy --host 0.0.0.0 --port 8000  # policy
# The Helm chart needs neither: its testbed mode runs these commands from the runtime image.
ARG RUNTIME_IMAGE=shopsimrl:dev
FROM ${RUNTIME_IMAGE}
ENV SHOPSIMRL_LOG_FORMAT=console
EXPOSE 5700 8000
# Healthy when whichever service runs answers: the shop's /healthz or the policy's /health.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 CMD ["python", "-c", "import sys, urllib.request as u\nfor url in ('http://127.0.0.1:5700/healthz', 'http://127.0.0.1:8000/health'):\n    try:\n        u.urlopen(url, timeout=2)\n        sys.exit(0)\n    except OSError:\n        pass\nsys.exit(1)"]
CMD ["testbed", "shop", "--host", "0.0.0.0", "--port", "5700"]
