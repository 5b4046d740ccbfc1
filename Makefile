# The two commands of the quick start. Both create the venv when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/asyncrawl: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
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
