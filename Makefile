# The two set-up commands of the README: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: run test gpu-test bench clean

$(VENV)/.installed: pyproject.toml
	@echo ">> creating $(VENV) and installing fusedserve with the dev and reference extras (first run: a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e ".[dev,reference]"
	@touch $@

HOST ?= 127.0.0.1
PORT ?= 8000

run: $(VENV)/.installed
	$(PY) -m server --host $(HOST) --port $(PORT)

test: $(VENV)/.installed
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
