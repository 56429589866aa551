# The two set-up commands of the README live here: `make test` builds everything it needs in
# .venv and runs the whole suite (CI runs exactly this).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: test build lint clean

$(VENV)/.deps: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[worker,dev]'
	touch $@

build: $(VENV)/.deps
	$(PIP) install -q --no-deps --no-build-isolation -e .

test: build
	$(PY) -m ruff check memsvc worker tests bench
	$(PY) -m pytest

clean:
	rm -rf build $(VENV) worker/*.so *.egg-info
