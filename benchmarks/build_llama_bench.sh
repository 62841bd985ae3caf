#!/usr/bin/env bash
# Builds llama.cpp's tools for the benchmarks' baselines (optional; never part of make test): llama-bench
# (bench_decode.py, bench_load.py), llama-quantize (the requantised files), llama-server (bench_server.py,
# bench_structured.py) and llama-cli. No wheel exists here: the llama-cpp-python source package carries
# vendor/llama.cpp, built with cmake. Output: build/llama.cpp/bin/.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
OUT=build/llama.cpp
PY="${PYTHON:-.venv/bin/python}"
TOOLS=(llama-bench llama-quantize llama-server llama-cli)
built=1
for t in "${TOOLS[@]}"; do [ -x "$OUT/bin/$t" ] || built=0; done
[ "$built" = 1 ] && { echo "$OUT/bin: ${TOOLS[*]} (already built)"; exit 0; }
command -v cmake >/dev/null || { echo "need cmake (apt-get install cmake)" >&2; exit 2; }
mkdir -p build/src
[ -f build/src/llama_cpp_python-"$VERSION".tar.gz ] || "$PY" -m pip download -q --no-deps --no-binary :all: -d build/src "llama-cpp-python==$VERSION"
rm -rf build/src/llama_cpp_python-"$VERSION"
tar -xzf build/src/llama_cpp_python-"$VERSION".tar.gz -C build/src
SRC=build/src/llama_cpp_python-"$VERSION"/vendor/llama.cpp
cmake -S "$SRC" -B "$OUT" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$OUT" --target "${TOOLS[@]}" -j "$(nproc)"
echo "$OUT/bin: ${TOOLS[*]}"
