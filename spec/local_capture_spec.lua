-- What a capture costs the host and what it keeps (issue 22, item 1), against a real `moonbox
-- local`, every tree made from inside a sandbox:
-- - 200,000 hard-linked files (100,000 inodes of two names each, under directories whose paths
--   are about 1,500 bytes long: the capture helper's link table holds one path per linked inode)
--   are captured with the helper's peak memory at most 64 MiB (its getrusage maxrss, which the
--   backend logs after each capture), and restore with the same inode groups;
-- - file capabilities, user.* xattrs, owners and modes (setuid, setgid and sticky bits too)
--   survive capture and restore;
-- - a capture that outlasts limits.capture_timeout (MOONBOX_LOCAL_CAPTURE_TIMEOUT) is cut: the
--   snapshot is failed saying so, the sandbox is thawed and keeps running, nothing is left in
--   layers/.
-- On older trees: the helper that kept a strdup'd path per linked inode (before d5deb15) peaked
-- at 154 MiB on this tree (17 MiB now); the one that set xattrs before the chown dropped the
-- capabilities; a file name longer than ~45 bytes failed every capture (the xattr path buffer);
-- and nothing set the freeze bound from outside, so the cut capture came back available.
-- Needs root; CI has it.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local json = require "moonbox.json"
local sys = require "moonbox.sys"
local L = require "spec.support.local_backend"
local files = require "spec.support.files"

local MEMORY_MAX_KIB = 64 * 1024 -- the issue's bound on what a capture may grow the host's memory by
local LOG = os.tmpname()

local B
-- A capture of 200,000 names takes a minute or more on a loaded 2-core CI machine: the freeze
-- bound is raised here so that this spec measures memory, not speed.
setup(T.async(function() B = L.start { stderr = { file = LOG }, env = { MOONBOX_LOCAL_CAPTURE_TIMEOUT = "600" } } end))
teardown(T.async(function()
  if B then B:destroy() end
  os.remove(LOG)
end))

local DENY = { default = "deny-all" }

local function create(b, body)
  body = body or {}
  body.ownerId = b.workspace
  body.networkPolicy = DENY
  local s, sb = b:req("POST", "/v1/sandboxes", { body = body })
  assert(s == 201, "create: " .. s .. " " .. json.encode(sb))
  return b:wait_status(sb.id, "running")
end

local function run(b, id, command)
  local r = b:exec(id, command, { timeout = 300 })
  assert(r.code == 0, "in " .. id .. ": `" .. command:sub(1, 200) .. "` exited " .. tostring(r.code) .. ": " ..
    tostring(r.stderr) .. tostring(r.body))
  return r.stdout
end

local function terminate(b, id) b:req("POST", "/v1/sandboxes/" .. id .. "/terminate") end

-- Captures sandbox id and waits until the snapshot is no longer creating (five minutes at most).
local function capture(b, id) return b:settled(b:snapshot(id), 300) end

local function restore(b, snap)
  local sb = create(b, { snapshotId = snap.id })
  return sb
end

describe("a capture of 200,000 hard-linked files", function()
  it("peaks below 64 MiB on the host and restores the same inode groups", T.async(function()
    local src = create(B)
    -- 100 directories of 1,000 files, each file with a second name beside it, under six
    -- levels of 250-byte names: every inode the link table records has a ~1,560-byte path.
    run(B, src.id, [[python3 - <<'EOF'
import os
os.makedirs("/root/h")
os.chdir("/root/h")
for i in range(6):
    n = ("L%d" % i) * 125
    os.mkdir(n)
    os.chdir(n)
for d in range(100):
    os.mkdir("d%03d" % d)
    for f in range(1000):
        a = "d%03d/f%04d" % (d, f)
        open(a, "w").close()
        os.link(a, "d%03d/g%04d" % (d, f))
EOF]])
    -- The inode groups as names: for each inode, its names sorted; then the groups sorted and
    -- counted (how many names, how many groups, a sha256 of them).
    local GROUPS = "cd /root/h && find . -type f -printf '%i %h %n %P\\n' | LC_ALL=C sort -k1,1n -k4 | " ..
      "awk '$1 != i { if (g) print g; g = $3; i = $1 } { g = g \" \" $4 } END { print g }' | LC_ALL=C sort > " ..
      "/tmp/groups && echo $(find . -type f | wc -l) $(wc -l < /tmp/groups) $(awk '$1 != 2' /tmp/groups | wc -l) " ..
      "$(sha256sum < /tmp/groups | cut -c1-64)"
    local want = run(B, src.id, GROUPS)
    local names, groups, odd = want:match("^(%d+) (%d+) (%d+) ")
    assert.are.same({ "200000", "100000", "0" }, { names, groups, odd }, "the tree made: " .. want)

    local snap = capture(B, src.id)
    assert(snap.status == "available", "the capture of " .. snap.id .. ": " .. tostring(snap.error))
    local peak
    for _ = 1, 50 do
      peak = (files.read(LOG) or ""):match("snapshot " .. snap.id:gsub("%p", "%%%0") ..
        " of %S+ captured: [^\n]*peaked at (%d+) KiB")
      if peak then break end
      task.sleep(0.1)
    end
    assert(peak, "the backend did not log the capture helper's peak memory for " .. snap.id)
    io.stderr:write(string.format("local_capture_spec: the capture of 200,000 linked files peaked at %d KiB\n",
      tonumber(peak)))
    assert(tonumber(peak) <= MEMORY_MAX_KIB, string.format("the capture helper peaked at %d KiB, more than %d KiB",
      tonumber(peak), MEMORY_MAX_KIB))
    terminate(B, src.id)

    local sb = restore(B, snap)
    assert.are.equal(want, run(B, sb.id, GROUPS), "the restored tree's inode groups (names, groups, odd, sha256)")
    terminate(B, sb.id)
  end))
end)

describe("a capture", function()
  it("keeps file capabilities, xattrs, owners and modes", T.async(function()
    local src = create(B)
    run(B, src.id, [[set -e
mkdir -p /root/a/sticky /root/a/sgid
cp /bin/true /root/a/cap && setcap cap_net_raw+ep /root/a/cap
cp /bin/true /root/a/suid && chown 1000:1000 /root/a/suid && chmod 4755 /root/a/suid
cp /bin/true /root/a/both && chown 0:50 /root/a/both && chmod 6711 /root/a/both
chmod 1777 /root/a/sticky && chown 1234:4321 /root/a/sgid && chmod 2770 /root/a/sgid
echo data > /root/a/sgid/owned && chown 1234:4321 /root/a/sgid/owned && chmod 0640 /root/a/sgid/owned
ln -s cap /root/a/link && chown -h 77:88 /root/a/link
long=$(printf 'n%.0s' $(seq 255)) && echo long > /root/a/$long && chmod 0604 /root/a/$long
python3 -c '
import os
os.setxattr("/root/a/sgid/owned", "user.note", b"kept")
os.setxattr("/root/a/sgid/owned", "user.bin", bytes(range(256)))
os.setxattr("/root/a/sgid", "user.dir", b"a directory too")
os.setxattr("/root/a/suid", "user.empty", b"")
os.setxattr("/root/a/" + "n" * 255, "user.long", b"a name of 255 bytes")
'
setcap cap_sys_time,cap_chown=eip /root/a/both]])
    -- Every entry's type, mode, owner and xattrs (names and values in hex; security.capability
    -- decoded by getcap, as a user of the sandbox sees it).
    local ATTRS = [[cd /root/a && python3 -c '
import os, stat, subprocess
for root, dirs, fs in os.walk("."):
    for n in sorted(dirs + fs):
        p = os.path.join(root, n)
        st = os.lstat(p)
        xs = sorted((k, os.getxattr(p, k, follow_symlinks=False).hex())
                    for k in os.listxattr(p, follow_symlinks=False) if k != "security.capability")
        print(p, oct(st.st_mode), st.st_uid, st.st_gid, xs)
' | LC_ALL=C sort && getcap -r /root/a | LC_ALL=C sort]]
    local want = run(B, src.id, ATTRS)
    assert.matches("/root/a/cap cap_net_raw=ep", want, nil, true)
    assert.matches("/root/a/both cap_chown,cap_sys_time=eip", want, nil, true)
    assert.matches("./suid 0o104755 1000 1000 [('user.empty', '')]", want, nil, true)
    local snap = capture(B, src.id)
    assert(snap.status == "available", "the capture of " .. snap.id .. ": " .. tostring(snap.error))
    terminate(B, src.id)
    local sb = restore(B, snap)
    assert.are.equal(want, run(B, sb.id, ATTRS), "the restored tree's modes, owners, xattrs and capabilities")
    -- And a restore of the restore: the second capture stacks on the first layer.
    run(B, sb.id, "touch /root/a/second")
    local snap2 = capture(B, sb.id)
    assert(snap2.status == "available", "the capture of " .. snap2.id .. ": " .. tostring(snap2.error))
    local sb2 = restore(B, snap2)
    assert.are.equal(want, run(B, sb2.id, ATTRS:gsub("&& getcap", "| grep -v second && getcap", 1)),
      "the twice-restored tree's attributes")
    terminate(B, sb.id)
    terminate(B, sb2.id)
  end))
end)

describe("a capture longer than limits.capture_timeout", function()
  it("is cut: the snapshot failed, the sandbox thawed and running, nothing left in layers/", T.async(function()
    local b = L.start { env = { MOONBOX_LOCAL_CAPTURE_TIMEOUT = "0.3" } }
    local ok, err = pcall(function()
      local sb = create(b)
      -- 40,000 files and 200 MB: far more than 0.3 s of copying (and syncing, and reading back).
      run(b, sb.id, [[python3 - <<'EOF'
import os
for d in range(40):
    os.makedirs("/root/big/d%02d" % d)
    for f in range(1000):
        with open("/root/big/d%02d/f%04d" % (d, f), "wb") as o:
            o.write(os.urandom(5000))
EOF
nohup setsid sh -c 'while :; do echo tick >> /tmp/ticks; sleep 0.05; done' > /dev/null 2>&1 &]])
      local snap = capture(b, sb.id)
      assert.are.equal("failed", snap.status, "the cut capture " .. snap.id)
      assert.matches("did not finish within 0.3 s", tostring(snap.error), nil, true)
      assert.matches(sb.id, tostring(snap.error), nil, true)
      assert.is_nil(tostring(snap.error):find(b.state, 1, true), "the error names a host path: " .. snap.error)
      -- Thawed: its processes run on (the ticker's file grows) and it answers execs.
      local before = tonumber(run(b, sb.id, "wc -l < /tmp/ticks"))
      task.sleep(1)
      local after = tonumber(run(b, sb.id, "wc -l < /tmp/ticks"))
      assert(after > before, "the sandbox's processes did not run on after the cut capture (" .. before .. " ticks, " ..
        "then " .. after .. ")")
      local _, rec = b:req("GET", "/v1/sandboxes/" .. sb.id)
      assert.are.equal("running", rec.status)
      local left = {}
      for _, n in ipairs((select(2, pcall(sys.listdir, b.state .. "/layers"))) or {}) do
        if n:find(snap.id, 1, true) then left[#left + 1] = n end
      end
      assert.are.same({}, left, "what the cut capture left in layers/")
      terminate(b, sb.id)
    end)
    b:destroy()
    if not ok then error(err, 0) end
  end))
end)
