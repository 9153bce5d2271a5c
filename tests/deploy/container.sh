#!/usr/bin/env bash
# tests/deploy/container.sh — the Dockerfile builds for real and its images run moonbox.
#
#   container.sh SOURCE_DIR MOONBOX_BIN
#
# In the checks' container store (lib.sh: debian:12 imported from the cached mmdebstrap base),
# builds SOURCE_DIR's Dockerfile with buildah (no registry is ever asked: --pull=never), then
# with podman:
#   - the default image runs as the user moonbox, every library its files link is present and
#     `moonbox version` says what MOONBOX_BIN (the build tree's binary) says;
#   - its default command is the schedule daemon on Render's backend, and its recipe loads;
#   - `moonbox schedule --trigger` runs a schedule with no sandboxes, its state in a temp volume,
#     and a second container reads the run back (`moonbox runs --json`) from that volume;
#   - the local image has the host tools moonbox local needs.
# Removes its tags, containers and volume; keeps only the base and the package layers, tagged
# moonbox-deploy-cache:*.
. "$(dirname "$0")/lib.sh"
SRC=$(cd "$1" && pwd) BIN=$2
container_store
TAG=localhost/moonbox-check:$$ LTAG=localhost/moonbox-check-local:$$ VOL=moonbox-check-$$

on_exit '"${PODMAN[@]}" volume rm -f "$VOL" >/dev/null 2>&1'
on_exit '"${BUILDAH[@]}" rmi "$TAG" "$LTAG" >/dev/null 2>&1; "${BUILDAH[@]}" rmi --prune >/dev/null 2>&1'
build() { # build LOG TAG [bud args...]: a real build of SOURCE_DIR's Dockerfile
  local log=$1 tag=$2
  shift 2
  if ! "${BUILDAH[@]}" bud --pull=never --layers --network=host --runtime=runc "${LIMITS[@]}" \
    --isolation=oci -t "$tag" "$@" "$SRC" >"$log" 2>&1; then
    tail -40 "$log" >&2
    die "buildah bud failed (log above)"
  fi
}
say "buildah bud (default target: schedule)"
build "$WORK/bud.log" "$TAG"
build "$WORK/bud-local.log" "$LTAG" --target local

# Keep each stage's steps up to its package installation (the slow part) under tags, so that
# pruning what this build left dangling keeps the cache: a step line's image is the next "-->".
awk '/^\[[0-9]+\/[0-9]+\] STEP [0-9]+\/[0-9]+: / { split($1, s, /[\[\/\]]/); stage = s[2]
       if (!(stage in done)) { want = 1; step = $3; sub(/\/.*/, "", step) } else want = 0
       if ($4 == "RUN") done[stage] = 1; next }
     want && /^--> / { id = $NF; print stage "-" step, id; want = 0 }' "$WORK/bud.log" "$WORK/bud-local.log" |
  sort -u | while read -r name id; do
    "${BUILDAH[@]}" tag "$id" "localhost/moonbox-deploy-cache:stage$name" >/dev/null
  done

user=$("${PODMAN[@]}" image inspect --format '{{.Config.User}}' "$TAG")
[ "$user" = moonbox ] || die "the schedule image runs as '$user', not moonbox"
cmd=$("${PODMAN[@]}" image inspect --format '{{json .Config.Cmd}}' "$TAG")
[ "$cmd" = '["schedule","/etc/moonbox/schedule.lua","--backend","render"]' ] ||
  die "the schedule image's default command is $cmd"
say "the image: libraries, user, version"
missing=$("${RUN[@]}" --entrypoint sh "$TAG" -c \
  'ldd /usr/bin/moonbox $(find /usr/lib -path "*moonbox*" -name "*.so") 2>&1 | grep "not found" || true')
[ -z "$missing" ] || die "the image lacks libraries: $missing"
"${RUN[@]}" --entrypoint id "$TAG" -u | grep -qx 10001 || die "the image's user is not uid 10001"
want=$("$BIN" version)
got=$("${RUN[@]}" "$TAG" version)
[ "$got" = "$want" ] || die "the image says '$got', the build tree's binary '$want'"

say "the image: moonbox schedule --trigger with its state in a volume"
mkdir -p "$WORK/recipes"
cat >"$WORK/recipes/check.lua" <<'LUA'
local schedule = require "moonbox.schedule"
local json = require "moonbox.json"
schedule.every("deploy-check", "1h", function(run)
  print("deploy-check: " .. json.encode { trigger = run.trigger })
end)
LUA
chmod -R a+rX "$WORK"
"${PODMAN[@]}" volume create "$VOL" >/dev/null
# As the Blueprint's worker runs it: Render's backend, the key from the environment (a key
# that is never used: the schedule makes no API call, and the container has no network).
printf 'RENDER_API_KEY=rnd_deploy_check_unused\n' >"$WORK/env"
out=$("${RUN[@]}" --env-file "$WORK/env" -v "$WORK/recipes:/recipes:ro" -v "$VOL:/var/lib/moonbox" \
  "$TAG" schedule /recipes/check.lua --backend render --trigger deploy-check 2>&1) ||
  die "schedule --trigger failed: $out"
grep -q 'deploy-check: {"trigger":"manual"' <<<"$out" || die "the run printed nothing: $out"
grep -q 'deploy-check: run 1 ok' <<<"$out" || die "the run was not recorded ok: $out"
runs=$("${RUN[@]}" -v "$VOL:/var/lib/moonbox" "$TAG" runs --json)
# The recipe the image fires by default loads and lists its schedules.
list=$("${RUN[@]}" --env-file "$WORK/env" -v "$VOL:/var/lib/moonbox" "$TAG" \
  schedule /etc/moonbox/schedule.lua --backend render --list 2>&1) ||
  die "the image's own recipe does not load: $list"
grep -q 'rebuild-base' <<<"$list" || die "schedule --list of the image's recipe shows no schedule: $list"
grep -q '"outcome":"ok"' <<<"$runs" && grep -q '"trigger":"manual"' <<<"$runs" ||
  die "moonbox runs in a second container does not show the run from the volume: $runs"

say "the local image: moonbox and the host tools of moonbox local"
"${RUN[@]}" --entrypoint sh "$LTAG" -c \
  'moonbox version && command -v slirp4netns nft mmdebstrap flock >/dev/null' >/dev/null ||
  die "the local image lacks moonbox local's tools (slirp4netns, nft, mmdebstrap, flock)"
say "ok"
