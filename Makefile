# Two commands a new user needs: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Every distribution the venv holds, each at one version: `make lock` writes it from requirements/lock.in,
# requirements/overrides.txt and pyproject.toml.
LOCK := requirements/lock.txt
# Where pip finds the CPU build of torch on this machine (pip's config); `make lock` shows uv the same wheels.
FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)

.PHONY: serve test install lock chromium clean

$(STAMP): pyproject.toml Makefile $(LOCK) examples/ollama_plugin/pyproject.toml examples/olmo2_plugin/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Exactly the lock: each distribution at its pin, wheels only, nothing it does not name. Its torch is the
	# CPU build (2.13.0+cpu, from local disk): a plain `torch` would pull a multi-GB CUDA build.
	$(PIP) install --quiet --no-deps --only-binary :all: -r $(LOCK)
	# pagoda with its test dependencies and the two example third-party plugins (a protocol, and OLMo 2), each
	# installed through its entry point like any other, built by the lock's setuptools. No index is asked: a
	# dependency that the lock lacks fails here, and `make lock` adds it.
	$(PIP) install --quiet --no-index --no-build-isolation -e '.[dev]' -e examples/ollama_plugin -e examples/olmo2_plugin
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PY) -m pagoda serve --host 127.0.0.1 --port 8000

test: $(STAMP) chromium
	$(PY) -m pytest -q

# Re-resolve the lock to the newest releases that fit (torch stays at its pin in requirements/lock.in). A refresh
# lands only with a green `make test` on it.
lock: $(STAMP)
	$(VENV)/bin/uv pip compile --quiet --upgrade pyproject.toml --extra dev requirements/lock.in \
		--override requirements/overrides.txt $(if $(FIND_LINKS),--find-links $(FIND_LINKS)) \
		--python $(PY) --only-binary :all: --custom-compile-command 'make lock' -o $(LOCK)
	@! grep -iE '^(nvidia|cuda)' $(LOCK) || { echo "$(LOCK) pulls a CUDA toolchain: torch must stay the CPU build"; exit 1; }

# The chat page's browser test drives Debian's chromium (playwright never downloads one). Installed when
# missing, as root with apt-get; otherwise, or if the install fails, that test skips and the build goes on.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
		echo "chromium is not installed: tests/plugins/test_chat_page.py will skip"

clean:
	rm -rf $(VENV)
