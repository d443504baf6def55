# Two commands do everything: `make demo` and `make test`. Both build .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.sealfl-installed

.PHONY: demo test install bench clean

# torch is pinned to a range (>=2.4,<2.14) that pip resolves to the local CPU wheel;
# an open upper bound would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/sealfl demo --out demo-out

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) demo-out .pytest_cache
