#!/usr/bin/env bash
# The real backend for tests/realbackend: llama.cpp's llama-server, built from the llama.cpp tree vendored in the
# llama-cpp-python sdist, and a tiny random-weight model generated with the gguf writer. Both are cached outside the
# checkout (a build takes minutes on two cores; a fresh machine or CI pays it once), and each step is skipped when the
# cache already holds its result. Prints the binary's and the model's paths on its last two lines.
#   scripts/real-backend.sh [python]    python: the interpreter with the gguf package (default .venv/bin/python)
set -euo pipefail

version=0.3.36
cache="${STATESTORE_REAL_BACKEND_CACHE:-$HOME/.cache/statestore/llama/$version}"
python="${1:-.venv/bin/python}"
here="$(cd "$(dirname "$0")/.." && pwd)"
binary="$cache/llama-server"
# Named for the generator's contents, so a change to it makes a new model and an unchanged one is reused.
model="$cache/tiny-qwen2-$(sha256sum "$here/tests/realbackend/make_model.py" | cut -c1-12).gguf"
say() { echo "real-backend: $*" >&2; }
fail() { echo "real-backend: FAILED: $*" >&2; exit 1; }

mkdir -p "$cache"
for tool in cmake g++ make; do
  command -v "$tool" >/dev/null 2>&1 || fail "$tool is not installed (scripts/ensure-system-packages.sh installs it)"
done

source_dir="$cache/src/llama_cpp_python-$version/vendor/llama.cpp"
if [ -x "$binary" ]; then
  say "llama-server cached at $binary"
else
  if [ ! -d "$source_dir" ]; then
    sdist="$cache/llama_cpp_python-$version.tar.gz"
    if [ ! -s "$sdist" ]; then
      say "downloading the llama-cpp-python==$version sdist from PyPI"
      tmp="$(mktemp -d)"
      "$python" -m pip download --quiet --no-binary :all: --no-deps --dest "$tmp" "llama-cpp-python==$version" \
        || fail "pip could not download llama-cpp-python==$version"
      mv "$tmp"/llama_cpp_python-"$version".tar.gz "$sdist" || fail "the download did not produce the sdist"
      rm -rf "$tmp"
    fi
    say "unpacking the vendored llama.cpp"
    mkdir -p "$cache/src"
    tar -xzf "$sdist" -C "$cache/src" || fail "could not unpack $sdist"
    [ -d "$source_dir" ] || fail "the sdist holds no vendor/llama.cpp"
  fi
  say "building llama-server (about nine minutes on two cores; log in $cache/build.log)"
  build_dir="$cache/build"
  {
    cmake -S "$source_dir" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DBUILD_SHARED_LIBS=OFF &&
      cmake --build "$build_dir" --config Release --target llama-server -j2
  } >"$cache/build.log" 2>&1 || { tail -n 40 "$cache/build.log" >&2; fail "the llama-server build failed (log: $cache/build.log)"; }
  built="$(find "$build_dir" -type f -name llama-server -perm -u+x | head -n 1)"
  [ -n "$built" ] || fail "the build finished without a llama-server binary"
  cp "$built" "$binary.tmp" && mv "$binary.tmp" "$binary"
  say "llama-server built: $binary"
fi

if [ -s "$model" ]; then
  say "model cached at $model"
else
  [ -d "$source_dir" ] || fail "the llama.cpp tree is gone from $cache/src (remove $binary to rebuild it)"
  say "generating the tiny model"
  "$python" "$here/tests/realbackend/make_model.py" --tree "$source_dir" --out "$model.tmp" \
    || fail "the model could not be generated"
  mv "$model.tmp" "$model"
  say "model generated: $model"
fi

echo "$binary"
echo "$model"
