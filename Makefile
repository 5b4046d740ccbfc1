# The two commands of the quick start. Both create the venv when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

# (a venv of another Python, an older one, is made again: asyncrawl needs 3.11 or newer)
NEW_ENOUGH := -c 'import sys; sys.exit(sys.version_info < (3, 11))'

$(BIN)/asyncrawl: pyproject.toml
	@if ! { test -x $(BIN)/python && $(BIN)/python $(NEW_ENOUGH); }; then \
	  $(PY) $(NEW_ENOUGH) 2>/dev/null || { echo "asyncrawl needs Python 3.11 or newer, and \
	$(PY) is $$($(PY) -V 2>&1 || echo missing): run make $(MAKECMDGOALS) PY=python3.11" >&2; \
	  exit 1; }; \
	  echo "$(PY) -m venv $(VENV)"; rm -rf $(VENV) && $(PY) -m venv $(VENV); \
	fi
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(BIN)/asyncrawl

demo: $(BIN)/asyncrawl
	$(BIN)/asyncrawl demo

test: $(BIN)/asyncrawl
	$(BIN)/ruff check asyncrawl tests bench
	$(BIN)/mypy asyncrawl
	$(BIN)/python -m pytest -q

bench: $(BIN)/asyncrawl
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
