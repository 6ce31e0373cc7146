#!/usr/bin/env bash
# Build llama.cpp's llama-server as the peer for `pagoda bench serve --peer-url`.
#
# The sources are the llama.cpp tree vendored in the llama-cpp-python sdist on PyPI, so the build needs
# only pip's index (no git clone, no curl at run time). The binary lands in .peers/llama.cpp/bin/ at the
# repository's root (ignored by git). It took 47 minutes here, on 2 cores shared with other work; not part
# of `make test`.
#
#   nice -n 19 pagoda/bench/build_llama_server.sh   # JOBS=2 by default
#   JOBS=4 pagoda/bench/build_llama_server.sh
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
root="$repo/.peers/llama.cpp"
python="${PYTHON:-$repo/.venv/bin/python}"
jobs="${JOBS:-2}"
mkdir -p "$root/src" "$root/bin"

# The sdist only (never a wheel) for llama-cpp-python; its build tools may come as wheels
# (`--no-binary :all:` would compile every one of them from source first).
if ! ls "$root"/src/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  "$python" -m pip download --no-binary llama-cpp-python --no-deps --dest "$root/src" llama-cpp-python
fi
sdist="$(ls "$root"/src/llama_cpp_python-*.tar.gz | sort | tail -n1)"
tar -xzf "$sdist" -C "$root/src"
tree="$(ls -d "$root"/src/llama_cpp_python-*/vendor/llama.cpp | sort | tail -n1)"
echo "llama.cpp sources: $tree"

# GGML_NATIVE: tune for this CPU (the benchmark machine); LLAMA_CURL off: no network model download.
cmake -S "$tree" -B "$root/build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON \
  -DBUILD_SHARED_LIBS=OFF
cmake --build "$root/build" --target llama-server -j "$jobs"
install -m 0755 "$root/build/bin/llama-server" "$root/bin/llama-server"
"$root/bin/llama-server" --version || true
echo "installed $root/bin/llama-server"
