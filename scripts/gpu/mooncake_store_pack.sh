#!/usr/bin/env bash
# CPU machine, once: pack the Mooncake *store* for the H200 into .mcstore/mooncake_store.tar.xz
# (~18 MB), for scripts/gpu/hicache_mooncake.sh. The `.gpu` pd layer (../shared/gpu/build.sh PD=1)
# carries only the transfer engine (engine.so); HiCache L3 on Mooncake also needs the store module
# (mooncake/_store*.so), the `mooncake_master` and `mooncake_client` binaries and the bundled
# libraries they link (mooncake_transfer_engine_cuda13.libs/), all from the same wheel
# (mooncake-transfer-engine-cuda13 0.3.14, cp312, the one build.sh uses). Together with `.gpu`
# (~59 MB) they exceed one call's 64 MiB, so hicache_mooncake.sh stages them in a first call.
#
#   bash scripts/gpu/mooncake_store_pack.sh      # from the checkout root; .mcstore/ is git-ignored
#
# The wheel comes from build.sh's cache (~/.cache/sglang-dsv41-gpu/wheels), else `pip download`.
set -euo pipefail
WHEEL_NAME=mooncake_transfer_engine_cuda13-0.3.14-cp312-cp312-manylinux_2_28_x86_64.whl
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/sglang-dsv41-gpu/wheels
OUTDIR=.mcstore
[ -f pyproject.toml ] || { echo "run from the checkout root"; exit 2; }
W=$CACHE/$WHEEL_NAME
if [ ! -f "$W" ]; then
  mkdir -p "$CACHE"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$CACHE" mooncake-transfer-engine-cuda13==0.3.14
fi
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
L=mooncake_transfer_engine_cuda13.libs
unzip -q "$W" -d "$T/w" 'mooncake/_store*.so' mooncake/mooncake_master mooncake/mooncake_client "$L/*"
mkdir -p "$T/s/mooncake" "$T/s/$L"
cp "$T"/w/mooncake/_store*.so "$T/w/mooncake/mooncake_master" "$T/w/mooncake/mooncake_client" "$T/s/mooncake/"
# the bundled libraries the three need, directly or through libzmq (the rest are in the pd layer)
for lib in libetcd_wrapper libasio libcrypto libzstd libxxhash libzmq liburing libunwind libsodium libpgm; do
  cp "$T"/w/$L/$lib-*.so* "$T/s/$L/"
done
for f in "$T"/s/mooncake/* "$T"/s/$L/*; do strip --strip-unneeded "$f" 2>/dev/null || true; done
mkdir -p "$OUTDIR"
tar -C "$T/s" -cf - . | xz -6 -T0 > "$OUTDIR/mooncake_store.tar.xz"
ls -la "$OUTDIR/mooncake_store.tar.xz"
echo "now: call 1 carries .mcstore (bash scripts/gpu/hicache_mooncake.sh stage), call 2 within 30 s carries .gpu"
