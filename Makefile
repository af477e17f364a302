# The two commands of the README. Both create .venv on first use (pip, not uv or poetry:
# pip takes the local torch build instead of downloading several GB). `make report` installs
# what the pipeline needs; `make test` adds the dev extra (pytest, linters, the cluster extra).
# Each install has its stamp, newer than pyproject.toml once done.
VENV          := .venv
BIN           := $(VENV)/bin
INSTALLED     := $(VENV)/.installed
DEV_INSTALLED := $(VENV)/.installed-dev
CORES         ?= 1

.PHONY: report test lint setup clean

setup: $(INSTALLED)

$(BIN)/python:
	python3 -m venv $(VENV)

$(INSTALLED): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e .
	touch $@

# ".[dev]" holds everything "." does, so it renews both stamps: one pip run, not two.
$(DEV_INSTALLED): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e ".[dev]"
	touch $(INSTALLED) $@

report: $(INSTALLED)
	$(BIN)/snakemake --cores $(CORES) results/report.html

lint: $(DEV_INSTALLED)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/snakefmt --check workflow/
	PIPELINE_CACHE_DIR=$(CURDIR)/$(VENV)/cache $(BIN)/snakemake --lint

test: lint
	$(BIN)/pytest

clean:
	rm -rf results logs .snakemake
