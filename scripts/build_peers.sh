#!/usr/bin/env bash
# Build the peers of `densa bench peers` into .peers/ (opt-in: `scripts/setup.sh peers` calls this).
#
# llama.cpp's own OpenAI-compatible `llama-server` (continuous batching over parallel slots), from
# the llama.cpp sources vendored in the llama-cpp-python sdist, so the version is pinned by a
# package registry like every other dependency. ~15 minutes on 2 cores; tuned for this CPU
# (GGML_NATIVE), so the stamp records the CPU flags and a different machine rebuilds.
# DENSA_PEERS_ISA=avx2 builds an AVX2-only server instead (into .peers/avx2/), to compare AVX2 code
# paths on an AVX-512 machine: `densa bench peers --llama-server .peers/avx2/bin/llama-server`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="0.3.36"
isa="${DENSA_PEERS_ISA:-native}"
case "$isa" in
  native) isa_flags="-DGGML_NATIVE=ON"; default_dest="$root/.peers" ;;
  avx2) isa_flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
        default_dest="$root/.peers/avx2" ;;
  *) echo "DENSA_PEERS_ISA must be native or avx2, not $isa" >&2; exit 2 ;;
esac
dest="${DENSA_PEERS_DIR:-$default_dest}"
python="${PYTHON:-$root/.venv/bin/python}"
cpu_digest="$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)"
stamp="$dest/.llama-server-$version-$isa-$cpu_digest"
if [ -x "$dest/bin/llama-server" ] && [ -f "$stamp" ]; then
  echo "[densa] llama-server $version already built: $dest/bin/llama-server"
  exit 0
fi
mkdir -p "$dest/src" "$dest/bin"
sdist="$dest/src/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
  echo "[densa] downloading the llama-cpp-python $version sdist (llama.cpp sources)"
  "$python" -m pip download -q "llama-cpp-python==$version" --no-deps --no-binary :all: -d "$dest/src"
fi
src="$dest/src/llama_cpp_python-$version"
[ -d "$src" ] || tar xzf "$sdist" -C "$dest/src"
echo "[densa] building llama-server (cmake, Release, $isa CPU; takes ~15 minutes on 2 cores)"
# shellcheck disable=SC2086  # isa_flags is a list of flags
cmake -S "$src/vendor/llama.cpp" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF $isa_flags \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
  $(command -v ninja >/dev/null && echo -G Ninja) >"$dest/cmake-configure.log"
cmake --build "$dest/build" --target llama-server -j "$(nproc)" >"$dest/cmake-build.log"
cp "$dest/build/bin/llama-server" "$dest/bin/llama-server"
rm -f "$dest"/.llama-server-*
touch "$stamp"
echo "[densa] built $dest/bin/llama-server"
