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

build: $(VENV)/.deps
	$(PIP) install -q --no-deps --no-build-isolation -e .

# One program out of a Debian package, unpacked and not installed (no service, no maintainer scripts),
# for the tests only (`make up` needs neither): $(call deb-program,PACKAGE,PROGRAM,TARGET)
define deb-program
	rm -rf .deb-$(1) && mkdir .deb-$(1)
	cd .deb-$(1) && (apt-get download -q $(1) || (apt-get update -qq && apt-get download -q $(1)))
	dpkg -x .deb-$(1)/$(1)_*.deb .deb-$(1)/x
	cp .deb-$(1)/x/usr/bin/$(2) $(3)
	rm -rf .deb-$(1)
endef

# promtool checks deploy/prometheus and deploy/grafana (tests/test_operator_kit.py)
$(VENV)/bin/promtool: $(VENV)/.deps
	$(call deb-program,prometheus,promtool,$@)

# kubectl's built-in kustomize renders deploy/kubernetes (tests/test_kubernetes.py)
$(VENV)/bin/kubectl: $(VENV)/.deps
	$(call deb-program,kubernetes-client,kubectl,$@)

# a PostgreSQL server for the manager's PostgreSQL store and its replicas (tests/pgserver.py): the
# whole package unpacked, since initdb and postgres find their share directory relative to themselves
$(VENV)/postgresql: $(VENV)/.deps
	rm -rf .deb-postgresql $@ && mkdir .deb-postgresql
	cd .deb-postgresql && (apt-get download -q postgresql-15 || (apt-get update -qq && apt-get download -q postgresql-15))
	dpkg -x .deb-postgresql/postgresql-15_*.deb $@
	rm -rf .deb-postgresql
	touch $@  # dpkg -x dates it as the package was built, before .deps: else every make unpacks it again

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

test: build wheel $(VENV)/bin/promtool $(VENV)/bin/kubectl $(VENV)/postgresql
	$(PY) -m ruff check memsvc worker tests bench examples build_support api
	$(PY) -m ruff format --check memsvc worker tests bench examples build_support api
	$(PY) -m mypy
	$(VENV)/bin/buf lint
	$(VENV)/bin/buf format --diff --exit-code
	$(PY) -m pytest

clean:
	rm -rf build dist $(VENV) .venv-build worker/*.so *.egg-info api/build api/*.egg-info memsvc/v1/*_pb2* .memsvc
