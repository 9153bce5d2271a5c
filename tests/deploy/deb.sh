#!/usr/bin/env bash
# tests/deploy/deb.sh — the CPack package installs on a clean Debian 12 and runs the quick start;
# `cmake --install` gives a prefix moonbox runs from.
#
#   deb.sh SOURCE_DIR BUILD_DIR
#
# Installs BUILD_DIR into a temp prefix and runs a recipe and the archive module from there.
# Packs BUILD_DIR with `cpack -G DEB` (into a temp dir, so the build dir stays as it was),
# unpacks the cached mmdebstrap base (lib.sh) into a temp root, and in a mount and pid
# namespace of its own (everything mounted there goes away with it, even on a kill) makes it
# the root (pivot_root) to `apt install ./moonbox_*.deb` (apt fetches the dependencies from the Debian mirror
# of this machine's sources) and then, as root in that root, runs the quick start recipe the
# package installs (/usr/share/moonbox/recipes/quickstart.lua): real
# sandboxes on the embedded local backend of the installed moonbox, the host's sandbox image
# bound read-only at its usual place so that nothing is rebuilt. The package is installed the
# way a user would (dependencies and recommends from the mirror); the root is deleted after.
. "$(dirname "$0")/lib.sh"
SRC=$(cd "$1" && pwd) BUILD=$(cd "$2" && pwd)
need cpack cmake
need unshare util-linux
IMAGES=${MOONBOX_IMAGES:-${XDG_CACHE_HOME:-$HOME/.cache}/moonbox/images}
[ -e "$IMAGES/debian-12/rootfs/bin/sh" ] ||
  die "the sandbox image is missing in $IMAGES (build/moonbox image build makes it)"

say "cpack -G DEB"
(cd "$BUILD" && cpack -G DEB -B "$WORK/pkg" >"$WORK/cpack.log" 2>&1) || {
  cat "$WORK/cpack.log" >&2
  die "cpack failed"
}
deb=$(ls "$WORK"/pkg/moonbox_*.deb)
depends=$(dpkg-deb -f "$deb" Depends) files=$(dpkg-deb -c "$deb")
grep -q 'lua-cjson' <<<"$depends" || die "the package does not depend on lua-cjson: $depends"
grep -q 'liblua5.4-0' <<<"$depends" || die "dpkg-shlibdeps found no libraries: $depends"
grep -q ' \./usr/bin/moonbox$' <<<"$files" || die "the package does not install /usr/bin/moonbox"

# `cmake --install` into a prefix of its own works from there: the version, a recipe, and the
# lazily loaded archive module found in the prefix (not in the build tree).
PREFIX=$WORK/prefix
cmake --install "$BUILD" --prefix "$PREFIX" >/dev/null
[ "$("$PREFIX/bin/moonbox" version)" = "$("$BUILD/moonbox" version)" ] || die "the installed moonbox says another version"
cat >"$WORK/archive_from_prefix.lua" <<'LUA'
local archive = require "moonbox.archive"
assert(type(archive.to_records) == "function", "moonbox.archive has no to_records")
local f = assert(io.open("/proc/self/maps"))
local maps = f:read("a")
f:close()
local prefix = assert(arg[1])
local n = 0
for path in maps:gmatch("(/%S+/archive%.so)") do
  assert(path:sub(1, #prefix + 1) == prefix .. "/", "moonbox.archive was loaded from " .. path)
  n = n + 1
end
assert(n > 0, "no archive.so is mapped: where did moonbox.archive come from?")
print("archive module from the prefix")
LUA
(cd "$WORK" && "$PREFIX/bin/moonbox" run "$PREFIX/share/moonbox/recipes/tasks_and_http.lua" >"$WORK/prefix.log" 2>&1 &&
  "$PREFIX/bin/moonbox" run archive_from_prefix.lua "$PREFIX" >>"$WORK/prefix.log" 2>&1) || {
  cat "$WORK/prefix.log" >&2
  die "moonbox does not work from its cmake --install prefix"
}
say "cmake --install: works from $PREFIX"

base_tar
ROOT=$WORK/root
mkdir -p "$ROOT"
tar -xf "$BASE_TAR" -C "$ROOT"
cp "$deb" "$ROOT/tmp/"
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
mkdir -p "$ROOT/images"
# apt's downloads and lists are kept once per machine (bound into the root), so that later runs
# fetch only what changed in the mirror; one deb check at a time uses them.
APT_CACHE=$DEPLOY_CACHE/apt
mkdir -p "$APT_CACHE/archives/partial" "$APT_CACHE/lists/partial"
exec 8>"$DEPLOY_CACHE/.apt.lock"
flock 8

# Inside the new namespaces: the root's mounts, then pivot_root into it (not chroot: the kernel
# refuses new user namespaces, which every sandbox needs, to a chrooted process), the install
# and the recipe.
cat >"$WORK/inside.sh" <<'SH'
set -eu
r=$1 images=$2 apt=$3
mount --make-rprivate /
mount --rbind "$r" "$r"
mount --bind "$apt/archives" "$r/var/cache/apt/archives"
mount --bind "$apt/lists" "$r/var/lib/apt/lists"
mount -t proc proc "$r/proc"
mount --rbind /dev "$r/dev"
mount --rbind /sys "$r/sys"
mount -t tmpfs tmpfs "$r/run"
mount --bind "$images" "$r/images"
mount -o remount,bind,ro "$r/images"
mkdir "$r/.oldroot"
cd "$r"
pivot_root . .oldroot
cd /
umount -l /.oldroot
rmdir /.oldroot
exec /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 /bin/sh -ec '
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq /tmp/moonbox_*.deb >/tmp/apt.log 2>&1 || { tail -30 /tmp/apt.log; exit 1; }
  dpkg -s moonbox | grep -q "^Status: install ok installed"
  test -x /usr/libexec/moonbox/moonbox-sandbox
  moonbox version
  cd /tmp
  MOONBOX_IMAGES=/images moonbox run --json /usr/share/moonbox/recipes/quickstart.lua'
SH
say "apt install ./$(basename "$deb") in a clean Debian 12 root, then the quick start"
if ! unshare --mount --pid --fork --kill-child sh "$WORK/inside.sh" "$ROOT" "$IMAGES" "$APT_CACHE" \
  >"$WORK/inside.log" 2>&1; then
  tail -40 "$WORK/inside.log" >&2
  die "the package did not install or the quick start failed in the clean root (log above)"
fi
grep -q '^moonbox [0-9]' "$WORK/inside.log" || die "moonbox version printed nothing"
summary=$(tail -1 "$WORK/inside.log")
grep -q '"outcome":"ok"' <<<"$summary" || die "the quick start did not end ok: $summary"
grep -qF '"kept":[],"leaked":[]' <<<"$summary" || die "the quick start leaked sandboxes: $summary"
say "ok: $(grep -m1 '^moonbox [0-9]' "$WORK/inside.log")"
