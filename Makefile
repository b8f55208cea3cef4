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
	$(VENV)/bin/fusedserve serve --host $(HOST) --port $(PORT)

# the suite on TEST_WORKERS processes, each computing on its share of the cores (tests/conftest.py; every test starts
# its own servers on free ports), and the slowest tests listed at the end. Without a GPU the tests marked gpu are
# deselected and counted in one summary line; each skip that remains names a missing tool
TEST_WORKERS ?= auto

test: $(VENV)/.installed
	$(PY) -m pytest -n $(TEST_WORKERS) --durations=20

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
