#!/usr/bin/env bash
# tests/deploy/systemd.sh — systemd accepts deploy/systemd's units as they would be installed.
#
#   systemd.sh SOURCE_DIR BUILD_DIR
#
# Installs BUILD_DIR into a temp root with `cmake --install` (so ExecStart's /usr/bin/moonbox
# exists there), adds the machine's own systemd units (the targets ours name), the units and the
# example env file, and runs `systemd-analyze verify --root=`. verify exits 0 even for unknown
# keys and bad values (it only warns), so any output at all fails the check; a deliberately
# broken copy proves that warnings are caught. Then the schedule unit runs for real (below).
. "$(dirname "$0")/lib.sh"
SRC=$(cd "$1" && pwd) BUILD=$2
need systemd-analyze systemd
BUILD=$(cd "$BUILD" && pwd)
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
say "systemd-analyze verify: ok, and it reports a broken unit"

# The schedule unit for real: systemd 252 as PID 1 in a container of the Debian 12 base with the
# CPack package installed, the unit started with all its hardening, a schedule on the test clock
# (a 10-minute slot every real second) firing runs that the state dir records, and a clean stop.
# (The local unit is only verified above: sandboxes cannot start inside a podman container on
# these machines, whatever the unit allows; docs/deploy.md.)
need cpack cmake
(cd "$BUILD" && cpack -G DEB -B "$WORK/pkg" >"$WORK/cpack.log" 2>&1) || {
  cat "$WORK/cpack.log" >&2
  die "cpack failed"
}
deb=$(ls "$WORK"/pkg/moonbox_*.deb)
container_store
IMG=localhost/moonbox-check-systemd:$$ CTR=moonbox-check-systemd-$$
on_exit '"${PODMAN[@]}" rm -f "$CTR" >/dev/null 2>&1; "${BUILDAH[@]}" rmi "$IMG" >/dev/null 2>&1'
c=$("${BUILDAH[@]}" from --pull=never docker.io/library/debian:12)
on_exit '"${BUILDAH[@]}" rm "$c" >/dev/null 2>&1'
"${BUILDAH[@]}" copy "$c" "$deb" /tmp/moonbox.deb >/dev/null
say "systemd and the package in a Debian 12 container"
"${BUILDAH[@]}" run --network=host --runtime=runc "$c" -- sh -ec '
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends systemd /tmp/moonbox.deb >/dev/null 2>&1
  rm -rf /var/lib/apt/lists/* /tmp/moonbox.deb' >"$WORK/apt.log" 2>&1 || {
  tail -20 "$WORK/apt.log" >&2
  die "installing systemd and the package failed"
}
"${BUILDAH[@]}" commit -q "$c" "$IMG" >/dev/null
"${PODMAN[@]}" run -d --name "$CTR" --pull=never --network=none "${LIMITS[@]}" --systemd=always \
  "$IMG" /lib/systemd/systemd >/dev/null
in_ctr() { "${PODMAN[@]}" exec "$CTR" sh -ec "$1"; }
for _ in $(seq 100); do
  state=$(in_ctr 'systemctl is-system-running 2>/dev/null || true')
  case $state in running | degraded) break ;; esac
  sleep 0.2
done
case $state in running | degraded) ;; *) die "systemd did not come up in the container: '$state'" ;; esac
say "moonbox-schedule.service under systemd"
in_ctr '
  mkdir -p /etc/moonbox /etc/systemd/system/moonbox-schedule.service.d
  cat > /etc/moonbox/schedule.lua <<LUA
local schedule = require "moonbox.schedule"
schedule.every("unit-check", "10m", function(run) print("unit-check ran " .. run.slot_text) end)
LUA
  printf "RENDER_API_KEY=rnd_unit_check_unused\n" > /etc/moonbox/schedule.env
  chmod 600 /etc/moonbox/schedule.env
  printf "[Service]\nEnvironment=MOONBOX_TEST_CLOCK=start=2026-03-01T00:00:00Z,scale=600\n" \
    > /etc/systemd/system/moonbox-schedule.service.d/test-clock.conf
  systemctl daemon-reload
  systemctl start moonbox-schedule'
ok=0
for _ in $(seq 150); do
  runs=$(in_ctr 'XDG_STATE_HOME=/var/lib moonbox runs --json 2>/dev/null || true')
  ok=$(grep -o '"outcome":"ok"' <<<"$runs" | wc -l || true)
  [ "$ok" -ge 2 ] && break
  sleep 0.2
done
journal=$(in_ctr 'journalctl -u moonbox-schedule --no-pager')
[ "$ok" -ge 2 ] || die "the hardened unit recorded $ok ok runs; its journal: $journal"
grep -q 'rnd_unit_check_unused' <<<"$journal" && die "the API key appears in the unit's journal"
owner=$(in_ctr 'stat -c %U /var/lib/private/moonbox/moonbox.db')
[ "$owner" != root ] || die "the state is owned by root, not by the unit's dynamic user"
in_ctr 'systemctl stop moonbox-schedule'
result=$(in_ctr 'systemctl show -p Result -p ExecMainStatus moonbox-schedule' | tr '\n' ' ')
[ "$result" = "Result=success ExecMainStatus=0 " ] || die "stopping the unit: $result"
say "ok: $ok runs recorded by the hardened unit, stopped with status 0"
