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
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  for t in llama-bench llama-server; do [ -x "build/llama.cpp-noamx/bin/$t" ] || built=0; done
fi
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
# Where the CPU has AMX, the native build's AMX path dies with SIGSEGV in prefill (llama-bench -p 512) and at
# llama-server's start, so a second build without it (-mno-amx-*: GCC's explicit ISA flags win over -march=native)
# is the baseline for prefill and the server (benchmarks/llama_builds.py); decode keeps the native build, whose
# AMX buffers carry its fastest batch-1 kernels on such a CPU.
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  NO_AMX=build/llama.cpp-noamx
  FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake -S "$SRC" -B "$NO_AMX" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
        "-DCMAKE_C_FLAGS=$FLAGS" "-DCMAKE_CXX_FLAGS=$FLAGS" >/dev/null
  cmake --build "$NO_AMX" --target llama-bench llama-server -j "$(nproc)"
  echo "$NO_AMX/bin: llama-bench llama-server (without AMX)"
fi
