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
#   ISA=explicit pagoda/bench/build_llama_server.sh  # skip the native build
#
# ISA=native (the default) builds with GGML_NATIVE=ON, the peer at its best. Where that binary dies with an
# invalid opcode (seen on a KVM Xeon with AMX: -march=native emits instructions the VM does not run), the
# script rebuilds with explicit ISA flags read from /proc/cpuinfo (AVX2, FMA, F16C, BMI2, AVX-512, AVX512-VNNI,
# AVX512-BF16, AVX512-VBMI, AVX-VNNI; AMX off) and says which flags it used, in bin/llama-server.isa too.
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

# LLAMA_CURL off: no network model download.
configure() {  # $@: extra cmake flags
  cmake -S "$tree" -B "$root/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF "$@"
  cmake --build "$root/build" --target llama-server -j "$jobs"
}

explicit_flags() {  # the GGML ISA options this CPU's /proc/cpuinfo flags allow, AMX off
  local flags
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  has() { [[ "$flags" == *" $1 "* ]] && echo ON || echo OFF; }
  echo -DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) \
    -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX512=$(has avx512f) \
    -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni) \
    -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AVX_VNNI=$(has avx_vnni) \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
}

isa="${ISA:-native}"
if [[ "$isa" == native ]]; then
  configure -DGGML_NATIVE=ON
  if "$root/build/bin/llama-server" --version >/dev/null 2>&1; then
    echo "GGML_NATIVE=ON" >"$root/bin/llama-server.isa"
  else
    echo "the native build does not run on this CPU (invalid opcode?): rebuilding with explicit ISA flags" >&2
    isa=explicit
  fi
fi
if [[ "$isa" == explicit ]]; then
  read -r -a flags <<<"$(explicit_flags)"
  echo "explicit ISA flags: ${flags[*]}"
  rm -rf "$root/build"
  configure "${flags[@]}"
  echo "${flags[*]}" >"$root/bin/llama-server.isa"
fi
install -m 0755 "$root/build/bin/llama-server" "$root/bin/llama-server"
"$root/bin/llama-server" --version || true
