# The two set-up commands of the README live here: `make test` builds everything it needs in
# .venv and runs the whole suite (CI runs exactly this).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: test build wheel up clean

$(VENV)/.deps: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[worker,gateway,dev]'
	touch $@

build: $(VENV)/.deps $(VENV)/bin/promtool $(VENV)/bin/kubectl
	$(PIP) install -q --no-deps --no-build-isolation -e .

# Debian's promtool (the prometheus package's binary alone, not the service), for the checks of
# deploy/prometheus and deploy/grafana in tests/test_operator_kit.py.
$(VENV)/bin/promtool: $(VENV)/.deps
	rm -rf .promtool && mkdir .promtool
	cd .promtool && (apt-get download -q prometheus || (apt-get update -qq && apt-get download -q prometheus))
	dpkg -x .promtool/prometheus_*.deb .promtool/x
	cp .promtool/x/usr/bin/promtool $@
	rm -rf .promtool

# Debian's kubectl (kubernetes-client), for its built-in kustomize: tests/test_kubernetes.py renders
# deploy/kubernetes with it.
$(VENV)/bin/kubectl: $(VENV)/.deps
	rm -rf .kubectl && mkdir .kubectl
	cd .kubectl && (apt-get download -q kubernetes-client || (apt-get update -qq && apt-get download -q kubernetes-client))
	dpkg -x .kubectl/kubernetes-client_*.deb .kubectl/x
	cp .kubectl/x/usr/bin/kubectl $@
	rm -rf .kubectl

# The image's build stage runs this same target. Two wheels: memsvc (services, client, native
# extension) and memsvc-api (api/: the generated stubs alone, pure Python), which memsvc depends on.
wheel:
	python3 -m venv .venv-build
	.venv-build/bin/pip install -q --upgrade pip build
	rm -rf build dist api/build *.egg-info api/*.egg-info
	.venv-build/bin/python -m build --wheel --outdir dist .
	.venv-build/bin/python -m build --wheel --outdir dist api
	rm -rf *.egg-info api/*.egg-info  # the wheels' metadata, not the editable install's

up: build
	$(VENV)/bin/memsvc up

test: build wheel
	$(PY) -m ruff check memsvc worker tests bench examples build_support api
	$(PY) -m ruff format --check memsvc worker tests bench examples build_support api
	$(PY) -m mypy
	$(VENV)/bin/buf lint
	$(VENV)/bin/buf format --diff --exit-code
	$(PY) -m pytest

clean:
	rm -rf build dist $(VENV) .venv-build worker/*.so *.egg-info api/build api/*.egg-info memsvc/v1/*_pb2* .memsvc
