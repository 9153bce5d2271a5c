# tests/deploy/lib.sh — what the packaging checks share: the Debian 12 base root filesystem made
# with mmdebstrap (cached once per machine), temp dirs that are always removed, and logging.
# Sourced by the check scripts beside it (container.sh, deb.sh, systemd.sh); never run alone.

set -euo pipefail
export LC_ALL=C PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

say() { printf '[%s %s] %s\n' "$(date -u +%H:%M:%S)" "${0##*/}" "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }
need() { command -v "$1" >/dev/null || die "$1 is missing (./dev setup installs it: Debian package $2)"; }

[ "$(id -u)" -eq 0 ] || die "the packaging checks need root (chroots, mounts, containers)"

# Where the base tarball is cached: machine-wide, beside the sandbox images, so that only the
# first run on a machine pays for mmdebstrap.
DEPLOY_CACHE=${MOONBOX_DEPLOY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/moonbox/deploy}
BASE_TAR=$DEPLOY_CACHE/debian-12-minbase.tar
mkdir -p "$DEPLOY_CACHE"

# The machine's apt sources that name Debian's archive (other vendors' lists are left out: the
# images must hold Debian's packages only).
debian_sources() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    grep -qE '^[^#]*(deb\.debian\.org|security\.debian\.org|debian-archive-keyring)' "$f" && printf '%s\n' "$f"
  done
  return 0
}

# base_tar: makes $BASE_TAR (Debian 12 minbase, the machine's Debian mirrors in its apt sources)
# unless it exists. Concurrent callers wait on one lock and build it once.
base_tar() {
  need mmdebstrap mmdebstrap
  mkdir -p "$DEPLOY_CACHE"
  (
    flock 9
    [ -s "$BASE_TAR" ] && exit 0
    mapfile -t sources < <(debian_sources)
    [ ${#sources[@]} -gt 0 ] || die "no apt sources naming Debian's archive in /etc/apt"
    say "making the Debian 12 base with mmdebstrap (once per machine) into $BASE_TAR"
    # Without inherited descriptors (our locks, ctest's): mmdebstrap hands apt its pipe's fd
    # number in a `cat >&N` hook that dash cannot parse when N has two digits.
    if ! mmdebstrap --variant=minbase --format=tar \
      --dpkgopt=path-exclude=/usr/share/man/* --dpkgopt=path-exclude=/usr/share/doc/* \
      --dpkgopt=path-include=/usr/share/doc/*/copyright --dpkgopt=path-exclude=/usr/share/locale/* \
      bookworm "$BASE_TAR.partial" "${sources[@]}" </dev/null >"$DEPLOY_CACHE/mmdebstrap.log" 2>&1 \
      3>&- 4>&- 5>&- 6>&- 7>&- 8>&- 9>&-; then
      tail -40 "$DEPLOY_CACHE/mmdebstrap.log" >&2
      rm -f "$BASE_TAR.partial"
      die "mmdebstrap failed (log above, whole in $DEPLOY_CACHE/mmdebstrap.log)"
    fi
    mv -f "$BASE_TAR.partial" "$BASE_TAR"
  ) 9>"$DEPLOY_CACHE/.lock"
}

# container_store: the checks' own container store beside the base (its layer cache survives
# between runs and never mixes with the machine's other images), one check at a time on it,
# with debian:12 imported from the base. Sets BUILDAH, PODMAN (runc: crun refuses this
# kernel's hybrid cgroup hierarchy), LIMITS (rlimits no higher than ours: root here may not
# raise them) and RUN (podman run, no network, no registry).
container_store() {
  need buildah buildah
  need podman podman
  need runc runc
  STORE=$DEPLOY_CACHE/containers
  exec 8>"$DEPLOY_CACHE/.containers.lock"
  flock 8
  local g=(--root "$STORE/storage" --runroot /run/moonbox-deploy/containers --storage-driver overlay)
  BUILDAH=(buildah "${g[@]}")
  PODMAN=(podman "${g[@]}" --runtime runc)
  LIMITS=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=4096:4096)
  RUN=("${PODMAN[@]}" run --rm --pull=never --network=none "${LIMITS[@]}")
  # Holding the lock, anything named moonbox-check* is what a killed check left: remove it.
  local left
  left=$("${PODMAN[@]}" ps -a --filter name=moonbox-check -q)
  [ -z "$left" ] || "${PODMAN[@]}" rm -f $left >/dev/null
  left=$("${PODMAN[@]}" volume ls -q --filter name=moonbox-check)
  [ -z "$left" ] || "${PODMAN[@]}" volume rm -f $left >/dev/null
  left=$("${BUILDAH[@]}" containers -q)
  [ -z "$left" ] || "${BUILDAH[@]}" rm $left >/dev/null
  left=$("${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/moonbox-check' || true)
  [ -z "$left" ] || "${BUILDAH[@]}" rmi $left >/dev/null
  base_tar
  if ! "${PODMAN[@]}" image exists docker.io/library/debian:12 || [ "$BASE_TAR" -nt "$STORE/.imported" ]; then
    say "importing the base as debian:12"
    "${PODMAN[@]}" import --quiet "$BASE_TAR" docker.io/library/debian:12 >/dev/null
    touch "$STORE/.imported"
  fi
}

# A temp dir removed on exit (after the script's own cleanup, registered with on_exit).
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moonbox-deploy.XXXXXX")
CLEANUPS=()
on_exit() { CLEANUPS+=("$1"); }
run_cleanups() {
  local i
  for ((i = ${#CLEANUPS[@]} - 1; i >= 0; i--)); do eval "${CLEANUPS[$i]}" || true; done
  rm -rf --one-file-system "$WORK"
}
trap run_cleanups EXIT
