-- Pins moonbox.local.engine: real local sandboxes (an idmapped overlay root in user, mount,
-- PID, IPC, UTS, network and cgroup namespaces, cgroups) — exec, isolation between sandboxes,
-- suspend, snapshots as layers, file operations run inside the sandbox, teardown that leaves
-- nothing behind, recovery after a crash. Needs root, the default image (`moonbox image build`,
-- which ./dev test runs), slirp4netns, overlayfs and cgroups (CI has them); the first spec fails
-- with eng:check()'s sentences when something is missing. The attacker's view is
-- spec/local_isolation_spec.lua.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local proc = require "moonbox.proc"
local httpd = require "moonbox.httpd"
local Engine = require "moonbox.local.engine"
local image = require "moonbox.local.image"
local files = require "spec.support.files"
local L = require "spec.support.local_backend"

local STATE = "/tmp/moonbox-engine-spec-" .. files.run_tag()
local IMAGE = image.path()
local eng = Engine.new { state_dir = STATE, image = IMAGE }
local created = {} -- every id a spec created, terminated again in teardown

local function new_id(name)
  local id = "sbx-" .. name
  created[#created + 1] = { eng = eng, id = id }
  return id
end

-- new_id of each name, each created in eng and so running (no options): -> the ids, in order. [yields]
local function running(...)
  local ids = {}
  for i, name in ipairs({ ... }) do
    ids[i] = new_id(name)
    eng:create(ids[i])
  end
  return table.unpack(ids)
end

-- Runs command in sandbox id and returns its stdout; fails the spec on a non-zero exit.
local function sh(e, id, command)
  local r = e:run(id, command)
  assert.are.equal(0, r.code, "`" .. command .. "` in " .. id .. " exited " .. tostring(r.code) ..
    ": " .. r.stderr)
  return r.stdout
end

local errors_with = T.errors_with

local function host_file(name, content)
  local path = STATE .. "-" .. name
  files.write(path, content)
  return path
end

local read_all = files.drain
local exists = files.exists

local function mounted_under(prefix)
  return files.must_read("/proc/self/mountinfo"):find(prefix, 1, true) ~= nil
end

local function gone(pid)
  local stat = files.read("/proc/" .. pid .. "/stat")
  if not stat then return true end
  local state = stat:match("^%d+ %b() (%a)")
  return state == "Z" or state == "X"
end

local async = T.async

-- A background counter that replaces /tmp/count atomically (a reader never sees it empty).
local COUNTER = [[setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/count; ]] ..
  [[sleep 0.005; done' >/dev/null 2>&1 &]]

-- Reads h's stdout until it holds `want` (or ends); returns what was read.
local function read_until(h, want)
  local got = ""
  repeat
    local chunk = h:read("stdout")
    got = got .. (chunk or "")
  until not chunk or got:find(want, 1, true)
  return got
end

local function wait_for(fn, seconds)
  local deadline = task.now() + (seconds or 5)
  while task.now() < deadline do
    if fn() then return true end
    task.sleep(0.01)
  end
  return fn()
end

describe("moonbox.local.engine", function()
  teardown(async(function()
    for _, c in ipairs(created) do pcall(c.eng.terminate, c.eng, c.id) end
    pcall(eng.close, eng)
    L.remove_trees(STATE)
  end))

  it("passes its own check on this machine", async(function()
    local c = eng:check()
    assert.is_true(c.ok, table.concat(c.problems, "\n"))
  end))

  it("runs `echo hi` in /root as root with the create env and the sandbox id as hostname",
    async(function()
      local id = new_id("echo")
      local info = eng:create(id, { env = { GREETING = "hello world", LD_LIBRARY_PATH = "/opt/x" } })
      assert.are.equal("running", info.state)
      assert.is_true(eng:alive(id))
      local r = eng:run(id, 'echo hi; pwd; id -u; echo "$GREETING|$HOME|$LD_LIBRARY_PATH"; hostname; ' ..
        'echo err >&2; exit 3')
      assert.are.equal(3, r.code)
      assert.are.equal("hi\n/root\n0\nhello world|/root|/opt/x\n" .. id .. "\n", r.stdout)
      assert.are.equal("err\n", r.stderr)
      eng:terminate(id)
    end))

  it("runs each command as the leader of its own session and process group", async(function()
    local id = running("session")
    local out = sh(eng, id, "ps -o pid=,pgid=,sid= -p $$")
    local pid, pgid, sid = out:match("(%d+)%s+(%d+)%s+(%d+)")
    assert.are.equal(pid, pgid)
    assert.are.equal(pid, sid)
    eng:terminate(id)
  end))

  it("keeps both network policies off the host's loopback; allow-all has a way out, deny-all none",
    async(function()
      local srv <close> = httpd.listen { port = 0 }
      srv:route("GET", "/", function() return 200, "ok" end)
      local closed, open = new_id("deny"), new_id("allow")
      task.all({
        function() eng:create(closed, { network = "deny-all" }) end,
        function() eng:create(open, { network = "allow-all" }) end,
      })
      local probe = "exec 3<>/dev/tcp/127.0.0.1/" .. srv.port ..
        " && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3"
      for _, id in ipairs({ closed, open }) do
        local r = eng:run(id, probe)
        assert.are_not.equal(0, r.code, id .. " reached the host's loopback")
        assert.matches("refused", r.stderr) -- its own loopback is up, and nothing listens there
      end
      -- deny-all: loopback is the only interface; allow-all: loopback and slirp4netns's tap0
      -- with a default route (spec/local_isolation_spec.lua reaches a test host through it)
      assert.are.equal("lo\n", sh(eng, closed, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '"))
      assert.are.equal("lo\ntap0\n", sh(eng, open,
        "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort"))
      assert.matches("^tap0%s+00000000", sh(eng, open, "tail -n +2 /proc/net/route"))
      eng:terminate(closed)
      eng:terminate(open)
    end))

  it("runs as root of its own user namespace, an unprivileged id range on the host", async(function()
    local a, b = running("userns-a", "userns-b")
    local map_a = sh(eng, a, "cat /proc/self/uid_map")
    local base_a = tonumber(map_a:match("^%s*0%s+(%d+)%s+65536"))
    local base_b = tonumber(sh(eng, b, "cat /proc/self/uid_map"):match("^%s*0%s+(%d+)%s+65536"))
    assert.is_number(base_a, map_a)
    assert.are.equal(eng:info(a).uid_base, base_a)
    assert.is_true(base_a >= Engine.ID_BASE and base_b >= Engine.ID_BASE)
    assert.are_not.equal(base_a, base_b) -- each sandbox its own range
    assert.are.equal("0\n", sh(eng, a, "id -u"))
    -- on the host, the sandbox's processes belong to that range, never to root
    for _, pid in ipairs(eng:processes(a)) do
      local st = files.read("/proc/" .. pid .. "/status") or ""
      local uid = tonumber(st:match("\nUid:%s+(%d+)"))
      if uid then assert.is_true(uid >= base_a and uid < base_a + 65536, "pid " .. pid
        .. " runs as host uid " .. uid) end
    end
    -- / and what root inside creates belong to root inside; the image's files too
    assert.are.equal("root root\nroot root\nroot root\n",
      sh(eng, a, "mkdir /app && stat -c '%U %G' / /app /etc/passwd"))
    eng:terminate(a)
    eng:terminate(b)
  end))

  it("hides one sandbox's files and processes from another, and the state dir from both",
    async(function()
      local a, b = running("iso-a", "iso-b")
      local marker = "moonbox-secret-" .. math.random(1e9)
      sh(eng, a, "echo classified > /root/" .. marker .. "; setsid sleep 4242 >/dev/null 2>&1 &")
      -- B: not at the same path, not through the host-root base layer (A's upper and the whole
      -- state dir live on the host's root filesystem), not anywhere on B's filesystem.
      local upper_path = eng:info(a).upper .. "/root/" .. marker
      assert.is_true(exists(upper_path)) -- it is there on the host...
      local r = eng:run(b, "cat /root/" .. marker .. "; cat " .. upper_path .. "; ls -A " .. STATE ..
        "; find / -xdev -name '" .. marker .. "*' 2>/dev/null; exit 0")
      assert.are.equal("", r.stdout)                -- ...and nowhere in B
      assert.matches("No such file", r.stderr)
      local ps = sh(eng, b, "ps -e -o pid=,args=")
      assert.is_nil(ps:find("4242", 1, true), ps)
      local visible = tonumber(sh(eng, b, "ls /proc | grep -c '^[0-9][0-9]*$'"))
      assert.is_true(visible <= 4, visible .. " processes visible in B") -- init, bash, ls, grep
      assert.matches("sleep 4242", sh(eng, a, "ps -e -o args="))
      eng:terminate(a)
      eng:terminate(b)
    end))

  it("shows a process started by one exec to the next exec of the same sandbox", async(function()
    local id = running("shared-pid")
    sh(eng, id, "setsid nohup sleep 1000 >/dev/null 2>&1 &")
    assert.matches("^%d+\n$", sh(eng, id, "pgrep -f 'sleep 1000'"))
    -- one that keeps the exec's pipes open does not hold eng:run either: it returns while that
    -- process still runs (it would end in 2000 s)
    assert.are.equal("started\n", sh(eng, id, "sleep 2000 & echo started"))
    assert.matches("^%d+\n$", sh(eng, id, "pgrep -f 'sleep 2000'"))
    eng:terminate(id)
  end))

  it("survives a user killing every process inside it", async(function()
    local id = running("killall")
    sh(eng, id, "setsid sleep 1000 >/dev/null 2>&1 &")
    eng:run(id, "kill -9 -1; kill -9 1; kill -TERM 1")
    assert.is_true(eng:alive(id))
    assert.are.equal("", sh(eng, id, "pgrep -f '^sleep 1000'; true"))
    -- orphans are reaped by the init: no zombie is left behind
    sh(eng, id, "for i in 1 2 3; do sh -c 'sleep 0.02 &'; done")
    local left
    assert.is_true(wait_for(function()
      left = sh(eng, id, "ps -eo stat=,comm= | grep -E '^ *Z| sleep$'; true")
      return left == ""
    end, 10), "orphans not reaped: " .. tostring(left))
    eng:terminate(id)
  end))

  it("terminates every process of the sandbox, unmounts it and removes its upper dir",
    async(function()
      local id = new_id("term")
      local info = eng:create(id)
      sh(eng, id, "setsid sleep 1000 >/dev/null 2>&1 & (sleep 2000 &) ; nohup sleep 3000 >/dev/null 2>&1 &")
      local h = eng:exec(id, "sleep 4000") -- still running when terminate comes
      local pids = eng:processes(id)
      assert.is_true(#pids >= 5, "expected the init, the sleeps and the exec, got " .. #pids)
      eng:terminate(id)
      assert.are.same({}, eng:processes(id))
      for _, pid in ipairs(pids) do assert.is_true(gone(pid), "pid " .. pid .. " survived") end
      assert.are_not.equal(0, (h:wait())) -- killed with the sandbox (or refused entry)
      assert.is_false(exists(info.upper))
      assert.is_false(exists(STATE .. "/sandboxes/" .. id))
      assert.is_false(mounted_under(STATE .. "/sandboxes/" .. id))
      assert.is_false(eng:alive(id))
      eng:terminate(id) -- idempotent
      errors_with("not_found", eng.exec, eng, id, "true")
    end))

  it("stops progress while frozen and resumes it on thaw", async(function()
    local id = running("freeze")
    sh(eng, id, COUNTER)
    local function count()
      -- reading works on a frozen sandbox: file helpers live in a leaf of its cgroup that is
      -- never frozen
      return tonumber(read_all((eng.files:read(id, "/tmp/count"))))
    end
    assert.is_true(wait_for(function() local ok, n = pcall(count) return ok and n and n > 3 end))
    eng:freeze(id)
    assert.is_true(eng:frozen(id))
    local c1 = count()
    task.sleep(0.2)
    assert.are.equal(c1, count())
    errors_with("frozen", eng.exec, eng, id, "true")
    eng:thaw(id)
    assert.is_false(eng:frozen(id))
    assert.is_true(wait_for(function() return count() > c1 + 5 end))
    eng:terminate(id) -- also from frozen:
    local id2 = running("freeze-term")
    sh(eng, id2, "setsid sleep 1000 >/dev/null 2>&1 &")
    eng:freeze(id2)
    eng:terminate(id2)
    assert.are.same({}, eng:processes(id2))
  end))

  it("freezes and thaws through cgroup v2 too", async(function()
    -- These machines run cgroup v1 with the unified hierarchy mounted beside it (no
    -- controllers, but its freezer works): CI must have it, so its absence fails the spec.
    assert.is_true(exists("/sys/fs/cgroup/unified/cgroup.controllers"),
      "no cgroup v2 hierarchy at /sys/fs/cgroup/unified")
    local e2 = Engine.new { state_dir = STATE .. "-v2", image = IMAGE,
      cgroup_root = "/sys/fs/cgroup/unified" }
    local id = "sbx-v2"
    created[#created + 1] = { eng = e2, id = id }
    e2:create(id)
    sh(e2, id, COUNTER)
    local function count() return tonumber(read_all((e2.files:read(id, "/tmp/count")))) end
    assert.is_true(wait_for(function() local ok, n = pcall(count) return ok and n and n > 3 end))
    e2:freeze(id)
    local c1 = count()
    task.sleep(0.2)
    assert.are.equal(c1, count())
    e2:thaw(id)
    assert.is_true(wait_for(function() return count() > c1 + 5 end))
    e2:terminate(id)
    assert.is_true(e2:close())
  end))

  it("restores a filesystem snapshot, without what /dev held", async(function()
    local src, dst = new_id("snap-src"), new_id("snap-dst")
    eng:create(src)
    sh(eng, src, "mkdir -p /app && echo v1 > /app/data.txt && echo in-dev > /dev/mine && " ..
      "echo in-shm > /dev/shm/seg && rm /etc/hostname && echo t > /tmp/t")
    local layer = STATE .. "/layers/fs1"
    local snap = eng:capture(src, layer, { kind = "filesystem" })
    assert.is_true(snap.size > 0)
    assert.is_nil(snap.dev_records)
    assert.are.same({ layer }, snap.layers)
    assert.is_true(eng:alive(src))
    assert.is_false(eng:frozen(src))
    sh(eng, src, "echo v2 > /app/data.txt") -- the source goes on; the layer does not change
    eng:create(dst, { lowers = snap.layers })
    assert.are.equal("v1\n", sh(eng, dst, "cat /app/data.txt"))
    assert.are.equal("t\n", sh(eng, dst, "cat /tmp/t"))
    assert.are.equal("gone\n", sh(eng, dst, "test -e /etc/hostname || echo gone")) -- whiteout kept
    assert.are.equal("absent\n", sh(eng, dst, "test -e /dev/mine || test -e /dev/shm/seg || echo absent"))
    eng:terminate(src)
    eng:terminate(dst)
  end))

  it("keeps hard links within a captured layer as hard links", async(function()
    local src = running("snap-links")
    sh(eng, src, "mkdir -p /app && echo linked > /app/a && ln /app/a /app/b && ln /app/a /app/c")
    local layer = STATE .. "/layers/links1"
    eng:capture(src, layer, { kind = "filesystem" })
    local function inode(path)
      return proc.run({ "stat", "-c", "%i %h", layer .. path }).stdout
    end
    local a = inode("/app/a")
    assert.matches("^%d+ 3\n$", a)
    assert.are.equal(a, inode("/app/b"))
    assert.are.equal(a, inode("/app/c"))
    eng:terminate(src)
  end))

  it("restores /dev from a runtime snapshot", async(function()
    local src, dst = new_id("rt-src"), new_id("rt-dst")
    eng:create(src)
    sh(eng, src, "echo in-dev > /dev/mine && echo in-shm > /dev/shm/seg && echo f > /root/f")
    local snap = eng:capture(src, STATE .. "/layers/rt1", { kind = "runtime" })
    assert.are.equal(STATE .. "/layers/rt1.dev", snap.dev_records)
    assert.is_true(exists(snap.dev_records))
    eng:create(dst, { lowers = snap.layers, dev_records = snap.dev_records })
    assert.are.equal("in-dev\nin-shm\nf\n", sh(eng, dst, "cat /dev/mine /dev/shm/seg /root/f"))
    assert.are.equal("ok\n", sh(eng, dst,
      "echo ok > /dev/null && head -c 4 /dev/urandom | wc -c >/dev/null && echo ok"))
    eng:terminate(src)
    eng:terminate(dst)
  end))

  it("restores a chain of three snapshots (a restored sandbox of a restored sandbox)", async(function()
    local a, b, c, d = new_id("chain-a"), new_id("chain-b"), new_id("chain-c"), new_id("chain-d")
    eng:create(a)
    sh(eng, a,
      "mkdir -p /data && echo a > /data/a && echo doomed > /data/doomed && mkdir -p /data/dir && touch /data/dir/old")
    local s1 = eng:capture(a, STATE .. "/layers/c1")
    eng:create(b, { lowers = s1.layers })
    sh(eng, b,
      "echo b > /data/b && rm /data/doomed && rm -rf /data/dir && mkdir /data/dir && touch /data/dir/new")
    local s2 = eng:capture(b, STATE .. "/layers/c2")
    assert.are.same({ STATE .. "/layers/c2", STATE .. "/layers/c1" }, s2.layers)
    eng:create(c, { lowers = s2.layers })
    sh(eng, c, "echo c > /data/c && echo a2 > /data/a")
    local s3 = eng:capture(c, STATE .. "/layers/c3")
    assert.are.equal(3, #s3.layers)
    eng:create(d, { lowers = s3.layers })
    assert.are.equal("a2\nb\nc\n", sh(eng, d, "cat /data/a /data/b /data/c"))
    assert.are.equal("dir\n", sh(eng, d, "test -e /data/doomed || ls /data | grep -v '^[abc]$'"))
    assert.are.equal("new\n", sh(eng, d, "ls /data/dir")) -- opaque directory kept through the chain
    for _, id in ipairs({ a, b, c, d }) do eng:terminate(id) end
  end))

  it("writes, reads, stats, lists and tars files inside the sandbox", async(function()
    local id, other = running("files", "files-2")
    local body = string.rep("0123456789", 10000) .. "\n\0binary\255"
    local src = host_file("upload", body)
    eng.files:write(id, "/srv/app/data.bin", src)
    assert.are.equal(body, read_all((eng.files:read(id, "/srv/app/data.bin"))))
    local st = eng.files:stat(id, "/srv/app/data.bin")
    assert.are.equal("file", st.type)
    assert.are.equal(#body, st.size)
    assert.are.equal(tonumber("600", 8), st.mode)
    assert.is_true(math.abs(st.modifiedAt - os.time()) < 60)
    eng.files:write(id, "/root/notes.txt", host_file("notes", "n\n"), { mode = tonumber("644", 8) })
    assert.are.equal("644 root n\n", sh(eng, id,
      "stat -c '%a %U' /root/notes.txt | tr '\\n' ' '; cat /root/notes.txt"))
    assert.is_nil(eng.files:stat(id, "/srv/missing"))
    errors_with("not_found", eng.files.read, eng.files, id, "/srv/missing")
    errors_with("is_directory", eng.files.read, eng.files, id, "/srv/app")
    errors_with("is_directory", eng.files.write, eng.files, id, "/srv/app", src)
    errors_with("not_directory", eng.files.write, eng.files, id, "/srv/app/data.bin/x", src)

    sh(eng, id, "mkdir -p /srv/app/sub/deep && echo x > /srv/app/sub/deep/f && ln -s sub /srv/app/cur")
    assert.are.equal("directory", eng.files:stat(id, "/srv/app/cur", { follow = true }).type)
    local top = eng.files:list(id, "/srv/app", 1)
    local names = {}
    for _, e in ipairs(top) do names[#names + 1] = e.name .. ":" .. e.type end
    assert.are.same({ "cur:symlink", "data.bin:file", "sub:directory" }, names)
    assert.are.equal("sub", top[1].target)
    assert.are.equal(0, top[3].size)
    local deep = eng.files:list(id, "/srv/app", 3)
    names = {}
    for _, e in ipairs(deep) do names[#names + 1] = e.name end
    assert.are.same({ "cur", "data.bin", "sub", "sub/deep", "sub/deep/f" }, names)
    local self_entry = eng.files:list(id, "/srv/app", 0)
    assert.are.equal(1, #self_entry)
    assert.are.equal("app", self_entry[1].name)
    assert.are.equal("directory", self_entry[1].type)
    assert.is_nil(eng.files:list(id, "/srv/nothing", 1))
    errors_with("not_directory", eng.files.list, eng.files, id, "/srv/app/data.bin", 1)

    -- tar out of one sandbox, into another: names relative, the symlink kept as a link
    local tgz = eng.files:tar_out(id, "/srv/app")
    local members = {}
    for name in proc.run({ "tar", "-tzf", tgz }).stdout:gmatch("[^\n]+") do members[name] = true end
    assert.are.same({ cur = true, ["data.bin"] = true, ["sub/"] = true, ["sub/deep/"] = true,
      ["sub/deep/f"] = true }, members)
    eng.files:tar_in(other, "/restore", tgz)
    assert.are.equal(body, read_all((eng.files:read(other, "/restore/data.bin"))))
    assert.are.equal("sub\nx\n", sh(eng, other, "readlink /restore/cur; cat /restore/cur/deep/f"))
    errors_with("not_found", eng.files.tar_out, eng.files, id, "/srv/none")
    errors_with("not_directory", eng.files.tar_out, eng.files, id, "/srv/app/data.bin")
    os.remove(tgz)
    -- devices, fifos and /proc read without a hang or a host-side effect
    sh(eng, id, "mkfifo /root/fifo")
    errors_with("not_regular", eng.files.read, eng.files, id, "/root/fifo")
    errors_with("not_regular", eng.files.read, eng.files, id, "/dev/null")
    assert.matches("^Name:%s+moonbox%-sandbox", read_all((eng.files:read(id, "/proc/self/status"))))
    eng:terminate(id)
    eng:terminate(other)
  end))

  it("resolves a symlink to a host path inside the sandbox, never on the host", async(function()
    local id, victim = running("link", "link-victim")
    local secret = host_file("host-secret", "host only\n")   -- exists on the host
    sh(eng, victim, "echo victim-data > /root/v")
    local victim_file = eng:info(victim).upper .. "/root/v"   -- another sandbox's layer
    sh(eng, id, "ln -s " .. secret .. " /root/a && ln -s " .. victim_file .. " /root/b && " ..
      "ln -s /etc/hostname /root/c")
    errors_with("not_found", eng.files.read, eng.files, id, "/root/a")
    errors_with("not_found", eng.files.read, eng.files, id, "/root/b")
    local st = eng.files:stat(id, "/root/a")
    assert.are.equal("symlink", st.type)
    assert.are.equal(secret, st.target)
    -- writing through the path replaces the link inside the sandbox; the host file is untouched
    eng.files:write(id, "/root/a", host_file("overwrite", "mine\n"))
    assert.are.equal("host only\n", files.must_read(secret))
    assert.are.equal("file", eng.files:stat(id, "/root/a").type)
    -- a link to a base-image file reads the sandbox's view of it
    assert.are.equal(sh(eng, id, "cat /etc/hostname"), read_all((eng.files:read(id, "/root/c"))))
    -- an archive that plants a link and writes through it stays inside the sandbox too
    local tgz = STATE .. "-evil.tgz"
    assert.are.equal(0, proc.run { "sh", "-c", 'd=$(mktemp -d) && ln -s "$2" "$d/esc" && ' ..
      'tar -czf "$1" -C "$d" esc && rm -rf "$d"', "sh", tgz, STATE }.code)
    errors_with("unsafe_archive", eng.files.tar_in, eng.files, id, "/root/x", tgz)
    assert.are.equal("", sh(eng, id, "ls -A /root/x 2>/dev/null; true"))
    eng:terminate(id)
    eng:terminate(victim)
  end))

  it("delivers 50 MB of exec output completely", async(function()
    local id = running("big")
    local h = eng:exec(id, "head -c 52428800 /dev/zero | tr '\\0' x; echo; echo done >&2")
    local n, last, errs = 0, "", {}
    task.all({
      function()
        for chunk in function() return h:read("stdout") end do
          n = n + #chunk
          last = (last .. chunk):sub(-2)
        end
      end,
      function() for chunk in function() return h:read("stderr") end do errs[#errs + 1] = chunk end end,
    })
    assert.are.equal(0, (h:wait()))
    assert.are.equal(52428801, n)
    assert.are.equal("x\n", last:sub(-2))
    assert.are.equal("done\n", table.concat(errs))
    eng:terminate(id)
  end))

  it("keeps a command running after its handle is detached or dropped, and kills on request",
    async(function()
      local id = running("detach")
      local h = eng:exec(id, "seq 1 300000; echo finished > /root/done")
      h:detach() -- the caller left; 2 MB of output are drained by the engine
      eng:exec(id, "seq 1 300000; echo finished > /root/done2") -- dropped without a word
      collectgarbage()
      collectgarbage()
      assert.is_true(wait_for(function()
        local ok, a = pcall(eng.files.stat, eng.files, id, "/root/done")
        return ok and a and eng.files:stat(id, "/root/done2")
      end, 10), "a detached or dropped command did not finish")
      local k = eng:exec(id, "trap 'exit 42' TERM; echo trapped; sleep 100 & wait")
      assert.are.equal("trapped\n", read_until(k, "\n")) -- the trap is set
      assert.is_true(k:kill("TERM"))
      assert.are.equal(42, (k:wait()))
      local k2 = eng:exec(id, "echo started; exec sleep 100")
      assert.are.equal("started\n", read_until(k2, "\n"))
      k2:kill("KILL")
      local code, sig = k2:wait()
      assert.are.equal(137, code)
      assert.are.equal("KILL", sig)
      assert.is_false(k2:kill())
      eng:terminate(id)
    end))

  it("starts 20 sandboxes concurrently, all of which work", async(function()
    local ids = {}
    for i = 1, 20 do ids[i] = new_id("many-" .. i) end
    task.map(ids, function(id) eng:create(id, { network = (#id % 2 == 0) and "deny-all" or "allow-all" }) end,
      { concurrency = 20 })
    local outs = task.map(ids, function(id) return sh(eng, id, "hostname") end, { concurrency = 20 })
    for i, id in ipairs(ids) do assert.are.equal(id .. "\n", outs[i]) end
    task.map(ids, function(id) eng:terminate(id) end, { concurrency = 20 })
    for _, id in ipairs(ids) do assert.are.same({}, eng:processes(id)) end
  end))

  it("dies with its keeper, frozen or not, leaving no process or mount; a new engine recovers",
    async(function()
      local id, cold = running("recover", "recover-frozen")
      sh(eng, id, "echo survived > /root/keep; setsid sleep 1000 >/dev/null 2>&1 &")
      sh(eng, cold, "setsid sleep 1000 >/dev/null 2>&1 &")
      eng:freeze(cold)
      local pids = {}
      for _, p in ipairs(eng:processes(id)) do pids[#pids + 1] = p end
      for _, p in ipairs(eng:processes(cold)) do pids[#pids + 1] = p end
      -- What a crash of the backend does to a keeper: it gets its parent-death signal
      -- (SIGTERM), thaws the sandbox and kills the init; a SIGKILLed keeper takes the init with
      -- it through the init's own parent-death signal.
      eng.sandboxes[id].keeper:kill("KILL")
      eng.sandboxes[cold].keeper:kill("TERM")
      assert.is_true(wait_for(function()
        for _, p in ipairs(pids) do if not gone(p) then return false end end
        return true
      end), "a sandbox process outlived its keeper")
      assert.is_false(mounted_under(STATE .. "/sandboxes/"))
      local fresh = Engine.new { state_dir = STATE, image = IMAGE }
      local report, seen = fresh:recover(), {}
      for _, r in ipairs(report) do seen[r.id] = r end
      assert.is_table(seen[id], "recover() did not report " .. id)
      assert.is_table(seen[cold], "recover() did not report " .. cold)
      assert.are.same({}, fresh:processes(id))
      assert.is_false(exists(eng.cg:path(id) .. "/cgroup.procs"))
      assert.is_true(exists(seen[id].upper .. "/root/keep")) -- the caller decides about the disk
      fresh:terminate(id)
      fresh:terminate(cold)
      eng.sandboxes[id], eng.sandboxes[cold] = nil, nil -- the old engine's records are stale
      assert.is_false(exists(STATE .. "/sandboxes/" .. id))
    end))

  it("raises structured errors naming the sandbox", async(function()
    local id = new_id("errors")
    local err = errors_with("not_found", eng.exec, eng, "sbx-none", "true")
    assert.are.equal("local.engine.exec", err.op)
    assert.are.equal("sbx-none", err.sandbox_id)
    assert.matches("sbx%-none", err.message)
    eng:create(id)
    errors_with("exists", eng.create, eng, id)
    errors_with("layer_missing", eng.create, eng, "sbx-nolayer", { lowers = { STATE .. "/layers/none" } })
    assert.is_false(exists(STATE .. "/sandboxes/sbx-nolayer"))
    errors_with("invalid_env", eng.create, eng, "sbx-badenv", { env = { UID = "0" } })
    errors_with("exists", eng.capture, eng, id, STATE .. "/sandboxes") -- an existing directory
    assert.has_error(function() eng:create("../escape") end)
    eng:terminate(id)
  end))

  it("leaves no mount, cgroup or process behind once everything is terminated", async(function()
    assert.is_true(eng:close())
    assert.is_false(mounted_under(STATE))
    assert.is_false(exists(eng.cg.dir .. "/cgroup.procs"))
    for _, c in ipairs(created) do assert.are.same({}, c.eng:processes(c.id)) end
  end))
end)
