#!/usr/bin/env bash
# deb-check.sh: proves that the .deb made by `cpack -G DEB` installs on a fresh Debian 12 and that a
# separate CMake project then builds and runs against it with find_package(dtrain).
#   tools/packaging/deb-check.sh build-shared/dtrain_0.1.0_amd64.deb
# Uses the minimal Debian 12 root that ../shared/tools/fresh-machine-check caches
# (/var/tmp/dtrain-fresh-root.tar; run that first). Needs root and Debian's package mirror.
set -euo pipefail
deb=$(realpath "${1:?usage: $0 path/to/dtrain.deb}")
src=$(cd "$(dirname "$0")/../.." && pwd)
cache=/var/tmp/dtrain-fresh-root.tar
[ -f "$cache" ] || { echo "deb-check: no $cache; run ../shared/tools/fresh-machine-check build first" >&2; exit 2; }
root=$(mktemp -d /var/tmp/dtrain-deb.XXXXXX)
cleanup() {
  umount "$root/proc" 2>/dev/null || umount -l "$root/proc" 2>/dev/null || true
  umount "$root/dev" 2>/dev/null || umount -l "$root/dev" 2>/dev/null || true
  if grep -q " $root/" /proc/mounts; then echo "deb-check: mounts remain under $root; left in place" >&2; return; fi
  rm -rf --one-file-system "$root"
}
trap cleanup EXIT
tar -C "$root" -xf "$cache"
cp /etc/resolv.conf "$root/etc/resolv.conf"
mount -t proc proc "$root/proc"; mount --bind /dev "$root/dev"
cp "$deb" "$root/tmp/dtrain.deb"
cp -r "$src/tests/consumer" "$root/tmp/consumer"
start=$(date +%s)
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root bash -euo pipefail -c '
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends /tmp/dtrain.deb g++ make >/dev/null
  dpkg -s dtrain | grep -E "^(Version|Depends):"
  dtrain-run --help | head -1
  cmake -S /tmp/consumer -B /tmp/consumer-build -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build /tmp/consumer-build -j2 >/dev/null
  /tmp/consumer-build/consumer'
echo "deb-check: PASSED: $(basename "$deb") installed on a fresh Debian 12 root and the consumer project built and ran ($(( $(date +%s) - start )) s)"
