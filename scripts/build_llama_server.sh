#!/usr/bin/env bash
# Build llama.cpp's llama-server from the llama-cpp-python sdist the project pins (the same
# llama.cpp source as the engine), for this CPU. Usage: scripts/build_llama_server.sh DIR
set -euo pipefail
cd "$(dirname "$0")/.."
dir="$1"
version=$(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')
mkdir -p "$dir"
if [ ! -d "$dir/src" ]; then
  .venv/bin/pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dir"
  mkdir -p "$dir/src"
  tar -xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir/src" --strip-components=1
fi
cmake -S "$dir/src/vendor/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON > "$dir/cmake.log"
cmake --build "$dir/build" --target llama-server -j "$(nproc)" > "$dir/build.log"
echo "built $dir/build/bin/llama-server"
