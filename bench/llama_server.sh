#!/usr/bin/env bash
# Build llama.cpp's llama-server for the multi-turn comparison (bench/multiturn, system
# "llama"): from the llama.cpp sources vendored in the llama-cpp-python sdist on PyPI (the
# one registry these machines reach), CPU only, for this machine's CPU. Prints the binary's
# path; run the benchmark with LLAMA_SERVER=<that path>. Not part of the suite.
#   bash bench/llama_server.sh [build dir, default ~/.cache/chatsvc/llama.cpp]
set -euo pipefail
dest="${1:-$HOME/.cache/chatsvc/llama.cpp}"
version="0.3.36"
mkdir -p "$dest"
if [ ! -x "$dest/build/bin/llama-server" ]; then
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dest" >&2
  tar -xzf "$dest/llama_cpp_python-$version.tar.gz" -C "$dest"
  src="$dest/llama_cpp_python-$version/vendor/llama.cpp"
  cmake -S "$src" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
  cmake --build "$dest/build" --target llama-server -j "$(nproc)" >&2
fi
echo "$dest/build/bin/llama-server"
