#!/usr/bin/env bash
# Builds llama.cpp's `llama-bench` for benchmarks/bench_decode.py --llama-cpp (optional; never part of make test).
# No wheel exists here: the llama-cpp-python source package carries vendor/llama.cpp, built with cmake
# (~10 minutes on 2 cores). Output: build/llama.cpp/bin/llama-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
OUT=build/llama.cpp
PY="${PYTHON:-.venv/bin/python}"
[ -x "$OUT/bin/llama-bench" ] && { echo "$OUT/bin/llama-bench (already built)"; exit 0; }
command -v cmake >/dev/null || { echo "need cmake (apt-get install cmake)" >&2; exit 2; }
mkdir -p build/src
"$PY" -m pip download -q --no-deps --no-binary :all: -d build/src "llama-cpp-python==$VERSION"
rm -rf build/src/llama_cpp_python-"$VERSION"
tar -xzf build/src/llama_cpp_python-"$VERSION".tar.gz -C build/src
SRC=build/src/llama_cpp_python-"$VERSION"/vendor/llama.cpp
cmake -S "$SRC" -B "$OUT" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF >/dev/null
cmake --build "$OUT" --target llama-bench -j "$(nproc)"
echo "$OUT/bin/llama-bench"
