#!/usr/bin/env bash
# llama.cpp's llama-server, built from the llama.cpp that the PyPI package llama-cpp-python vendors, and the
# embedded tiny port as an f32 GGUF written by the converter it vendors: the peer of bench/peers.py.
# Everything goes into DIR (outside the repository; nothing of it is committed). The build is long on a
# small machine: it runs under nice, on JOBS cores (default 2).
#
#   bench/build_llama_server.sh DIR [PYTHON]
#   python -m bench.peers --llama-server DIR/build/bin/llama-server --gguf DIR/tiny-gemma4-moe.gguf
set -euo pipefail

dir=${1:?usage: bench/build_llama_server.sh DIR [PYTHON]}
python=${2:-.venv/bin/python}
version=0.3.36
jobs=${JOBS:-2}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

if [ ! -f "$dir/llama_cpp_python-$version.tar.gz" ]; then
    "$python" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dir"
fi
src="$dir/llama_cpp_python-$version/vendor/llama.cpp"
[ -d "$src" ] || tar xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"

cmake -S "$src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 19 cmake --build "$dir/build" --config Release --target llama-server -j "$jobs"

"$python" -m bench.peers --write-gguf "$dir/tiny-gemma4-moe.gguf" --llama-cpp-src "$src"
echo "llama-server: $dir/build/bin/llama-server"
echo "GGUF:         $dir/tiny-gemma4-moe.gguf"
