# The two commands of the README. Both create .venv on first use (pip, not uv or poetry:
# pip takes the local torch build instead of downloading several GB).
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
CORES   ?= 1

.PHONY: report test lint setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -e ".[dev]"
	touch $(STAMP)

report: $(STAMP)
	$(BIN)/snakemake --cores $(CORES) results/report.html

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/snakefmt --check workflow/
	$(BIN)/snakemake --lint

test: lint
	$(BIN)/pytest

clean:
	rm -rf results logs .snakemake
