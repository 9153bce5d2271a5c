#!/usr/bin/env bash
# tests/deploy/systemd.sh — systemd accepts deploy/systemd's units as they would be installed.
#
#   systemd.sh SOURCE_DIR BUILD_DIR
#
# Installs BUILD_DIR into a temp root with `cmake --install` (so ExecStart's /usr/bin/moonbox
# exists there), adds the machine's own systemd units (the targets ours name), the units and the
# example env file, and runs `systemd-analyze verify --root=`. verify exits 0 even for unknown
# keys and bad values (it only warns), so any output at all fails the check; a deliberately
# broken copy proves that warnings are caught.
. "$(dirname "$0")/lib.sh"
SRC=$(cd "$1" && pwd) BUILD=$2
need systemd-analyze systemd
ROOT=$WORK/root
DESTDIR=$ROOT cmake --install "$BUILD" --prefix /usr >/dev/null
mkdir -p "$ROOT/usr/lib/systemd" "$ROOT/etc/systemd/system" "$ROOT/etc/moonbox"
cp -a /usr/lib/systemd/system "$ROOT/usr/lib/systemd/"
cp "$SRC"/deploy/systemd/*.service "$ROOT/etc/systemd/system/"
install -m 0600 "$SRC/deploy/systemd/schedule.env.example" "$ROOT/etc/moonbox/schedule.env"
: >"$ROOT/etc/moonbox/schedule.lua"

verify() { # verify UNIT...: systemd-analyze's whole output (empty when it accepts them)
  local units=() u
  for u in "$@"; do units+=("/etc/systemd/system/$u"); done
  systemd-analyze verify --root="$ROOT" "${units[@]}" 2>&1 || echo "(exit status $?)"
}

mapfile -t names < <(cd "$SRC/deploy/systemd" && ls -- *.service)
[ ${#names[@]} -ge 2 ] || die "expected the schedule and local units in deploy/systemd"
out=$(verify "${names[@]}")
[ -z "$out" ] || die "systemd-analyze verify does not accept ${names[*]}: $out"
say "accepted: ${names[*]}"

sed -e 's/^Restart=on-failure/Restart=sometimes/' \
  "$ROOT/etc/systemd/system/moonbox-schedule.service" >"$ROOT/etc/systemd/system/broken.service"
out=$(verify broken.service)
grep -q 'sometimes' <<<"$out" || die "a broken unit passed systemd-analyze verify unnoticed: '$out'"
say "ok"
