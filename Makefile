# kubetrain — the two commands a newcomer types: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-install
PYTEST_ARGS ?=

.PHONY: all venv run test test-unit lint crds clean help prebuild prebuild-status

all: venv

help:
	@echo "make run         set everything up and train examples/quickstart.yaml locally"
	@echo "make test        set everything up and run the whole test suite (starts make prebuild first)"
	@echo "make prebuild    build what the suite needs (Go parts, images) in the background; prebuild-status says where it is"
	@echo "make lint        ruff and the type checker (mypy)"
	@echo "make crds        regenerate crds/ (and the chart copy) from the API models"
	@echo "make cluster-up  start the local test control plane (see docs/testing.md)"
	@echo "make images      build the operator and trainer images into the test node (see docs/testing.md)"

venv: $(STAMP)

$(STAMP): requirements-dev.txt requirements-s3.txt core/pyproject.toml operator/pyproject.toml trainer-image/pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "kubetrain needs Python >= 3.11"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -r requirements-dev.txt -e core -e operator -e trainer-image
	$(BIN)/python -m pip install --no-deps -r requirements-s3.txt
	touch $@

run: $(STAMP)
	$(BIN)/kubetrain run examples/quickstart.yaml --fresh --summary-json runs/quickstart/summary.json

# The background build goes first (KUBETRAIN_PREBUILD=0: not); then the unit and e2e tiers in one lane beside
# the integration tier's lanes (hack/test-lanes.sh), mypy beside them; its verdict counts as the tests' does.
test: prebuild $(STAMP)
	$(BIN)/ruff check .
	BIN=$(BIN) bash hack/test-lanes.sh $(PYTEST_ARGS)

prebuild:
	@if [ "$${KUBETRAIN_PREBUILD:-1}" != 0 ]; then bash hack/prebuild.sh start; fi

prebuild-status:
	@bash hack/prebuild.sh status

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy core/src operator/src trainer-image/src

crds: $(STAMP)
	$(BIN)/kubetrain crd -o crds/kubetrain.io_trainingjobs.yaml
	$(BIN)/kubetrain crd --kind TrainingSweep -o crds/kubetrain.io_trainingsweeps.yaml
	$(BIN)/kubetrain crd --kind TrainingRuntime -o crds/kubetrain.io_trainingruntimes.yaml
	$(BIN)/kubetrain crd --kind ClusterTrainingRuntime -o crds/kubetrain.io_clustertrainingruntimes.yaml
	cp crds/kubetrain.io_*.yaml charts/kubetrain/crds/

clean:
	rm -rf $(VENV) runs

-include hack/cluster.mk
