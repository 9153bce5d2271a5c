-- `moonbox local` against a hostile client: what a sandbox's output, an unauthenticated
-- client, thousands of idle connections and malformed input cost the server, measured on a
-- real backend process. Memory is the server's own: VmRSS and the peak (VmHWM, reset through
-- /proc/<pid>/clear_refs before each measurement) of the `moonbox local` process. These are
-- bounds of memory and disk, never of time. Needs root (clear_refs of another process, raising
-- the open-file limit) and the default image; both are there in CI, and the first spec says so
-- loudly when they are not.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local http = require "moonbox.http"
local json = require "moonbox.json"
local proc = require "moonbox.proc"
local sys = require "moonbox.sys"
local image = require "moonbox.local.image"
local L = require "spec.support.local_backend"
local ustar = require "spec.support.ustar"
local files = require "spec.support.files"

local MiB = 1024 * 1024
local RSS_BOUND = 64 * 1000 * 1000 -- "under 64 MB"

-- ASan keeps freed blocks in a quarantine (256 MB by default) before reusing them: that is the
-- instrumentation's memory, not the server's. A small quarantine keeps the bound meaningful
-- in the sanitizer run; it changes nothing in a normal build.
local BACKEND_ENV = { ASAN_OPTIONS = (os.getenv("ASAN_OPTIONS") or "") .. ":quarantine_size_mb=4" ..
  ":thread_local_quarantine_size_kb=64" }

local B  -- the backend most specs share
local SB -- a running deny-all sandbox in it

local read_file = files.read

-- A field of /proc/<pid>/status in bytes (VmRSS, VmHWM).
local function vm(pid, name)
  local s = assert(read_file("/proc/" .. pid .. "/status"), "no process " .. pid)
  return assert(tonumber(s:match(name .. ":%s*(%d+) kB")), name .. " missing") * 1024
end

-- Runs fn() and returns how far the server's resident set rose above where it was when fn
-- started (the kernel's own peak, so nothing between samples is missed), then fn's results.
local function rss_growth(b, fn)
  local pid = b.p.pid
  local f = assert(io.open("/proc/" .. pid .. "/clear_refs", "w"))
  f:write("5")
  f:close()
  local before = vm(pid, "VmRSS")
  local results = table.pack(fn())
  return vm(pid, "VmHWM") - before, table.unpack(results, 1, results.n)
end

-- Calls one(i) for i = 1..total from n concurrent tasks; counts in tally[key] how often one
-- returned each key. [yields]
local function tally_in_workers(n, total, tally, one)
  local next_i = 0
  local workers = {}
  for w = 1, n do
    workers[w] = function()
      while next_i < total do
        next_i = next_i + 1
        local key = one(next_i)
        tally[key] = (tally[key] or 0) + 1
      end
    end
  end
  task.all(workers)
end

local function mb(bytes) return string.format("%.1f MB", bytes / 1e6) end

-- Fragments that would say where on the host the backend keeps things, or which of our source
-- files failed: none may appear in an answer. (/root itself may: it is the sandbox's home, and
-- answers name paths inside the sandbox; the host's /root shows as its hidden directories, the
-- image cache under /root/.cache for one.)
local function host_leak(b, text)
  local frags = { b.state, image.dir(), "/tmp/", "/.cache/", "/root/.", ".lua:", ".c:", "/work/",
    sys.getcwd(), "/run/moonbox", "/sys/fs/cgroup", "stack traceback", "moonbox-sandbox" }
  for _, frag in ipairs(frags) do
    if text:find(frag, 1, true) then return frag end
  end
  return nil
end

-- Asserts a 4xx whose body names no host path; what says which input it was.
local function assert_clean_4xx(b, what, status, body)
  body = body or ""
  assert(status >= 400 and status < 500, what .. ": expected a 4xx, got " .. status .. " " .. body)
  local leak = host_leak(b, body)
  assert(leak == nil, what .. ": the answer names " .. tostring(leak) .. ": " .. body)
end

-- Mints a token and runs command through /proxy/<id>/runs/sync. -> status, decoded body, raw.
local function run_sync(b, id, command, timeout)
  local s, tok = b:req("POST", "/v1/sandboxes/" .. id .. "/runs/sync/token", { body = { command = command } })
  assert(s == 201, "sync token: " .. s .. " " .. json.encode(tok))
  local r = http.request { method = "POST", url = tok.uri, body = json.encode({ command = command }),
    headers = { Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/json" },
    timeout = timeout or 120 }
  local ok, decoded = pcall(json.decode, r.body)
  return r.status, ok and decoded or nil, r.body
end

-- stdout of a command that must succeed.
local function sh(b, id, command)
  local s, r, raw = run_sync(b, id, command)
  assert(s == 200 and r.exit_code == 0, "`" .. command .. "` in " .. id .. ": " .. s .. " " .. raw)
  return r.stdout
end

-- The host processes of sandbox id: the members of its freezer cgroup (v1) or unified one.
local function sandbox_pids(id)
  local r = proc.run { "sh", "-c", 'cat /sys/fs/cgroup/freezer/moonbox/*/"$1"/*/cgroup.procs ' ..
    '/sys/fs/cgroup/moonbox/*/"$1"/*/cgroup.procs 2>/dev/null; true', "sh", id }
  local pids = {}
  for pid in r.stdout:gmatch("%d+") do pids[#pids + 1] = tonumber(pid) end
  return pids
end

local wait_until = require("spec.support.poll").wait

-- Runs fn(b, sb) with a backend of its own and a running deny-all sandbox in it, so that what
-- one spec measures is not hidden by memory an earlier one left resident; destroys the backend
-- whatever happens.
local function with_backend(fn)
  local b = L.start { env = BACKEND_ENV }
  local ok, err = pcall(function()
    local sb = b:create { networkPolicy = { default = "deny-all" } }
    -- Warm the paths the specs measure, so they measure output, not first-use allocations.
    sh(b, sb.id, "echo warm")
    fn(b, sb)
  end)
  b:destroy()
  if not ok then error(err, 0) end
end

setup(T.async(function()
  assert(proc.run({ "id", "-u" }).stdout == "0\n", "these specs need root")
  B = L.start { env = BACKEND_ENV }
  SB = B:create { networkPolicy = { default = "deny-all" } }
  -- clear_refs of another process needs root: say so here rather than in every spec.
  local f = assert(io.open("/proc/" .. B.p.pid .. "/clear_refs", "w"),
    "cannot write /proc/<pid>/clear_refs of the backend: these specs must run as root")
  f:close()
end))
teardown(T.async(function() if B then B:destroy() end end))

describe("runs/sync of a command printing 1 GiB", function()
  it("answers with the first 1 MiB of each stream and truncated, growing server RSS by under 64 MB",
    T.async(function() with_backend(function(b, sb)
      local growth, status, r, raw = rss_growth(b, function()
        return run_sync(b, sb.id, "head -c 1073741824 /dev/zero; echo done >&2", 600)
      end)
      assert(status == 200, "sync run: " .. status .. " " .. raw:sub(1, 300))
      assert.are.equal(0, r.exit_code)
      assert.are.equal(MiB, #r.stdout)
      assert.are.equal(("\0"):rep(MiB), r.stdout)
      assert.are.equal("done\n", r.stderr)
      assert.is_true(r.truncated)
      print(string.format("\n  1 GiB sync run: server RSS grew %s", mb(growth)))
      assert(growth < RSS_BOUND, "the server's RSS grew by " .. mb(growth) .. " (bound 64 MB)")
    end) end))

  it("leaves truncated out when nothing was dropped", T.async(function()
    local s, r = run_sync(B, SB.id, "head -c 1048576 /dev/zero")
    assert.are.equal(200, s)
    assert.are.equal(MiB, #r.stdout)
    assert.is_nil(r.truncated)
  end))
end)

describe("runs/stream whose client stops reading", function()
  -- The writer records how much it has written (in a file) after every 64 KiB, so the spec can
  -- see from outside whether the command is held back.
  local WRITER = [[
cat > /tmp/moonbox-writer.py <<'EOF'
import os
block, total, n = b"w" * 65536, 1 << 30, 0
with open("/tmp/writer.pid", "w") as f:
    f.write(str(os.getpid()))
while n < total:
    view = memoryview(block)
    while view:
        view = view[os.write(1, view):]
    n += len(block)
    with open("/tmp/produced.new", "w") as f:
        f.write(str(n))
    os.replace("/tmp/produced.new", "/tmp/produced")
EOF
]]

  it("holds the command back instead of buffering its output: server RSS grows by under 64 MB",
    T.async(function() with_backend(function(b, sb)
      sh(b, sb.id, WRITER)
      local command = "python3 /tmp/moonbox-writer.py"
      local _, tok = b:req("POST", "/v1/sandboxes/" .. sb.id .. "/runs/stream/token",
        { body = { command = command } })
      local produced = function()
        return tonumber(sh(b, sb.id, "cat /tmp/produced 2>/dev/null || echo 0"):match("%d+")) or 0
      end
      -- The writer's host process: is it asleep writing to a full pipe? (The exec helper's
      -- command line names the script too; the writer is the python3 process.)
      local function writer_blocked()
        for _, pid in ipairs(sandbox_pids(sb.id)) do
          local cmd = read_file("/proc/" .. pid .. "/cmdline") or ""
          if read_file("/proc/" .. pid .. "/comm") == "python3\n" and cmd:find("moonbox-writer", 1, true) then
            return (read_file("/proc/" .. pid .. "/wchan") or ""):find("pipe_write", 1, true) ~= nil
          end
        end
        return false
      end
      local resp
      local plateau
      local growth = rss_growth(b, function()
        -- A client that reads the headers and the first event, then nothing: its transfer
        -- pauses once 16 KiB are buffered, and the kernel's socket buffers fill behind it.
        resp = http.stream { method = "POST", url = tok.uri, body = json.encode({ command = command }),
          headers = { Authorization = "Bearer " .. tok.token, Accept = "text/event-stream",
            ["Content-Type"] = "application/json" }, timeout = 600, buffer = 16 * 1024 }
        assert.are.equal(200, resp.status)
        assert.are.equal("output", resp:read_event().event)
        -- Held back: the writer sleeps on a full pipe, and what it has written stays the same
        -- over consecutive looks (ten, a tenth of a second apart). This has to be seen before
        -- the server's idle timeout (30 s) gives up on the silent client.
        local last, same = -1, 0
        plateau = wait_until(25, function()
          local n = produced()
          if n == last and writer_blocked() then same = same + 1 else same = 0 end
          last = n
          if same >= 10 then return n end
          task.sleep(0.1)
        end, function() return "the writer to be held back (it wrote " .. last .. " bytes)" end)
      end)
      print(string.format("\n  stream not read: the command was held at %s written; server RSS grew %s",
        mb(plateau), mb(growth)))
      assert(growth < RSS_BOUND, "the server's RSS grew by " .. mb(growth) .. " (bound 64 MB)")
      -- What the command could write while nobody read: pipe, server queue and socket buffers,
      -- a few megabytes each; nowhere near the gigabyte it wanted to write.
      assert(plateau < 128 * MiB, "the command wrote " .. mb(plateau) .. " with nobody reading")
      -- Throttled, not dropped: once the client reads again, the command goes on.
      local got = 0
      while got < 64 * MiB do
        local ev = assert(resp:read_event(), "the stream ended early")
        assert.are.equal("output", ev.event)
        got = got + #json.decode(ev.data).data
      end
      wait_until(60, function() return produced() > plateau + 32 * MiB end,
        function() return "the writer to go on once the client read again" end)
      resp:close()
    end) end))
end)

describe("a log follower that stops reading", function()
  it("costs the server bounded memory while an exec streams 256 MiB to another client", T.async(function()
    with_backend(function(b, sb)
      local growth, got = rss_growth(b, function()
        -- The follower reads the headers, then nothing; the sandbox's log is bounded, and what
        -- the follower has not read waits in its own bounded stream.
        local follower <close> = http.stream { url = b.url .. "/v1/sandboxes/" .. sb.id .. "/logs",
          headers = { Authorization = "Bearer " .. b.key, Accept = "text/event-stream" }, timeout = 600,
          buffer = 16 * 1024 }
        assert.are.equal(200, follower.status)
        local command = "head -c 268435456 /dev/zero | tr '\\0' x"
        local _, tok = b:req("POST", "/v1/sandboxes/" .. sb.id .. "/runs/stream/token", { body = { command = command } })
        local resp <close> = http.stream { method = "POST", url = tok.uri, body = json.encode({ command = command }),
          headers = { Authorization = "Bearer " .. tok.token, Accept = "text/event-stream",
            ["Content-Type"] = "application/json" }, timeout = 600 }
        local n, code = 0, nil
        while true do
          local ev = resp:read_event()
          if not ev then break end
          local d = json.decode(ev.data)
          if ev.event == "output" then n = n + #d.data elseif ev.event == "exit" then code = d.exit_code end
        end
        assert.are.equal(0, code)
        return n
      end)
      print(string.format("\n  256 MiB streamed with a stalled log follower: server RSS grew %s", mb(growth)))
      assert.are.equal(256 * MiB, got)
      assert(growth < RSS_BOUND, "the server's RSS grew by " .. mb(growth) .. " (bound 64 MB)")
    end)
  end))
end)

describe("unauthenticated bodies", function()
  it("answer 2,000 bodies of 1 MiB with 401 without journaling, buffering or writing them",
    T.async(function() with_backend(function(b, sb)
      local body = ("u"):rep(MiB)
      local du = function()
        return tonumber(proc.run({ "du", "-sb", b.state }).stdout:match("^(%d+)"))
      end
      local tmp = b.state .. "/tmp"
      assert.are.same({}, sys.listdir(tmp))
      local _, journal = b:req("GET", "/_moonbox/journal")
      local seq = journal[#journal] and journal[#journal].seq or 0
      local disk_before = du()
      local statuses, seen_in_tmp = {}, {}
      local targets = {
        { method = "POST", url = b.url .. "/v1/sandboxes",
          headers = { ["Content-Type"] = "application/json" } },
        { method = "POST", url = b.url .. "/v1/sandboxes", headers = { Authorization = "Bearer rnd_wrong",
          ["Content-Type"] = "application/json" } },
        { method = "PUT", url = b.url .. "/proxy/" .. sb.id .. "/files/upload", headers = {
          ["Content-Type"] = "application/octet-stream" } },
        { method = "PUT", url = b.url .. "/proxy/" .. sb.id .. "/files/upload", headers = {
          Authorization = "Bearer not-a-token", ["Content-Type"] = "application/x-tar" } },
      }
      local growth = rss_growth(b, function()
        local done = false
        -- Watches the upload directory while the bodies arrive: a body stored and removed
        -- again before the 401 would not show in a listing taken only at the end.
        local watcher = task.spawn(function()
          while not done do
            for _, name in ipairs(sys.listdir(tmp)) do seen_in_tmp[#seen_in_tmp + 1] = name end
            task.sleep(0.01)
          end
        end)
        tally_in_workers(8, 2000, statuses, function(i)
          local t = targets[i % #targets + 1]
          local ok, r = pcall(http.request, { method = t.method, url = t.url, headers = t.headers,
            body = body, timeout = 60 })
          return ok and tostring(r.status) or ("error: " .. tostring(r))
        end)
        done = true
        task.join(watcher)
      end)
      print(string.format("\n  2,000 unauthenticated 1 MiB bodies: %s; server RSS grew %s",
        json.encode(statuses), mb(growth)))
      assert.are.same({ ["401"] = 2000 }, statuses)
      assert(growth < RSS_BOUND, "the server's RSS grew by " .. mb(growth) .. " (bound 64 MB)")
      assert.are.same({}, seen_in_tmp)
      assert.are.same({}, sys.listdir(tmp))
      local disk_after = du()
      assert(disk_after - disk_before < 64 * 1024, "the state dir grew from " .. disk_before .. " to " ..
        disk_after .. " bytes")
      local _, later = b:req("GET", "/_moonbox/journal", { query = { since = seq } })
      for _, e in ipairs(later) do
        assert(not (e.path == "/v1/sandboxes" and e.method == "POST") and not e.path:find("/files/upload",
          1, true),
          "an unauthenticated request was journaled: " .. json.encode(e))
      end
    end) end))

  it("answers 401 to malformed bodies before reading them, naming no host path", T.async(function()
    for _, body in ipairs({ '{"ownerId":"x","timeoutSeconds":NaN}', '{"timeoutSeconds":1e999}',
      ("["):rep(200) .. ("]"):rep(200), '{"timeoutSeconds":9223372036854775808}' }) do
      local s, _, _, raw = B:req("POST", "/v1/sandboxes", { body = body, auth = false,
        headers = { ["Content-Type"] = "application/json" } })
      assert.are.equal(401, s, body)
      assert_clean_4xx(B, "unauthenticated " .. body:sub(1, 40), s, raw)
    end
  end))
end)

describe("the request journal", function()
  it("stays bounded in bytes however authenticated requests fill it: server RSS grows by under 64 MB",
    T.async(function() with_backend(function(b)
      -- Each request as large as the journal keeps (a 16 KB JSON body of small numbers, which
      -- decodes into a far larger table) and a query string of 24 KB, 3,000 times over: kept as
      -- they came, 120 MB of text and several times that in tables.
      local body = '{"ownerId":"tea-00000000000000000000","pad":[' .. ("0,"):rep(8000) .. '0]}'
      local query = { pad = ("q"):rep(24 * 1024) }
      local statuses = {}
      local growth = rss_growth(b, function()
        tally_in_workers(4, 3000, statuses, function()
          return tostring((b:req("POST", "/v1/sandboxes", { body = body, query = query,
            headers = { ["Content-Type"] = "application/json" } })))
        end)
      end)
      print(string.format("\n  3,000 journaled requests of 40 KB: %s; server RSS grew %s",
        json.encode(statuses), mb(growth)))
      assert.are.same({ ["404"] = 3000 }, statuses) -- another workspace: nothing is created
      assert(growth < RSS_BOUND, "the server's RSS grew by " .. mb(growth) .. " (bound 64 MB)")
      local _, entries = b:req("GET", "/_moonbox/journal", { query = { since = 0 } })
      local last = entries[#entries - 1] -- the newest before the GET that reads them
      assert(last and last.method == "POST", "the journal lost the newest requests")
      assert.are.equal(8001, #last.body.pad, "the newest entry lost its body")
      assert.are.equal(24 * 1024 + 4, #last.query)
    end) end))
end)

describe("idle connections", function()
  it("answers a normal request while 4,200 half-sent requests hold connections open", T.async(function()
    local port = B.url:match(":(%d+)$")
    -- One bash holds every connection (its /dev/tcp): each gets a request line and half a
    -- header, never the rest. It waits on its stdin and closes them all when that ends.
    local idle = proc.spawn { "bash", "-c", [[
      ulimit -n 12000 || exit 3
      for i in $(seq 1 4200); do
        exec {fd}<>"/dev/tcp/127.0.0.1/$1" || exit 4
        printf 'GET /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Half: ' >&"$fd" || exit 5
      done
      echo opened
      read -r _ || true
    ]], "bash", port, stdin = "pipe" }
    local line = idle:lines("stdout")()
    assert(line == "opened", "the idle client could not open its connections (exit " ..
      tostring(line == nil and idle:wait()) .. ")")
    local function server_sockets()
      local r = proc.run { "sh", "-c", 'ls -l "/proc/$1/fd" | grep -c "socket:"', "sh", tostring(B.p.pid) }
      return tonumber(r.stdout:match("%d+")) or 0
    end
    -- Every one of them accepted (the backlog holds at most 1,024 of them otherwise).
    wait_until(60, function() return server_sockets() >= 4200 end,
      function() return "the server to accept 4,200 connections (it holds " .. server_sockets() .. ")" end)
    local s, page = B:req("GET", "/v1/sandboxes", { timeout = 20, fresh_connect = true })
    assert.are.equal(200, s)
    assert.is_table(page)
    local r = B:exec(SB.id, "echo still-serving", { timeout = 60 })
    assert.are.equal("still-serving\n", r.stdout)
    -- ...and the idle ones were still open when it was answered.
    local held = server_sockets()
    print(string.format("\n  idle connections: answered while the server held %d sockets", held))
    assert(held >= 4200, "only " .. held .. " connections were still open")
    idle:close_stdin()
    idle:wait()
  end))
end)

describe("bad input", function()
  setup(T.async(function()
    sh(B, SB.id, "ln -sf /nowhere /root/dangling; ln -sf /dev/zero /root/to-zero; mkfifo /root/fifo")
  end))

  local function download(path)
    local s, tok, _, raw = B:req("POST", "/v1/sandboxes/" .. SB.id .. "/files/download/token",
      { query = { path = path } })
    if s ~= 201 then return s, raw end
    local r = http.request { url = tok.uri, headers = { Authorization = "Bearer " .. tok.token },
      timeout = 30 }
    return r.status, r.body
  end

  for _, case in ipairs({
    { "a dangling symlink", "/root/dangling" },
    { "/dev/null", "/dev/null" },
    { "a character device (/dev/zero)", "/dev/zero" },
    { "a symlink to a device", "/root/to-zero" },
    { "a device that cannot be opened (/dev/tty)", "/dev/tty" },
    { "a fifo", "/root/fifo" },
    { "a /proc file the sandbox may not open (/proc/self/mem)", "/proc/self/mem" },
    { "a masked /proc file (/proc/kcore)", "/proc/kcore" },
  }) do
    it("answers a download of " .. case[1] .. " with a 4xx naming no host path", T.async(function()
      local s, body = download(case[2])
      assert_clean_4xx(B, "download " .. case[2], s, body)
    end))
  end

  it("lists /proc two levels deep while processes come and go, without a 5xx or a host path",
    T.async(function()
      local churn = task.spawn(function()
        run_sync(B, SB.id, "for i in $(seq 1 400); do (sleep 0.01 &); done; wait")
      end)
      local answers = {}
      for i = 1, 5 do
        local s, _, _, raw = B:req("GET", "/v1/sandboxes/" .. SB.id .. "/files/list",
          { query = { path = "/proc", depth = 2 } })
        answers[i] = { s, raw }
      end
      task.join(churn)
      for _, a in ipairs(answers) do
        local s, raw = a[1], a[2]
        assert(s < 500, "files/list of /proc: " .. s .. " " .. raw:sub(1, 300))
        local leak = host_leak(B, raw)
        if leak then
          error("files/list of /proc names " .. leak .. ": " .. (raw:match('[^{}]*' .. leak:gsub("%p",
            "%%%0") ..
            '[^{}]*') or ""))
        end
      end
    end))

  it("answers a list path holding a NUL with 400 naming no host path", T.async(function()
    local s, _, _, raw = B:req("GET", "/v1/sandboxes/" .. SB.id .. "/files/list",
      { query = { path = "/root\0/etc" } })
    assert.are.equal(400, s)
    assert_clean_4xx(B, "list path with a NUL", s, raw)
  end))

  for _, case in ipairs({
    { "NaN", '{"ownerId":"%s","timeoutSeconds":NaN}' },
    { "1e999", '{"ownerId":"%s","timeoutSeconds":1e999}' },
    { "-Infinity", '{"ownerId":"%s","timeoutSeconds":-Infinity}' },
    { "nesting 200 deep", '{"ownerId":"%s","name":' .. ("["):rep(200) .. ("]"):rep(200) .. "}" },
    { "nesting 100,000 deep", '{"ownerId":"%s","name":' .. ("["):rep(100000) .. "}" },
    { "timeoutSeconds 2^63", '{"ownerId":"%s","timeoutSeconds":9223372036854775808}' },
    { "timeoutSeconds 2^63-1", '{"ownerId":"%s","timeoutSeconds":9223372036854775807}' },
    { "timeoutSeconds -2^63", '{"ownerId":"%s","timeoutSeconds":-9223372036854775808}' },
    { "timeoutSeconds 1e20", '{"ownerId":"%s","timeoutSeconds":1e20}' },
    { "timeoutSeconds 1.5", '{"ownerId":"%s","timeoutSeconds":1.5}' },
    { "idleTimeoutSeconds 2^64", '{"ownerId":"%s","idleTimeoutSeconds":18446744073709551616}' },
  }) do
    it("answers a create body with " .. case[1] .. " with 400 naming no host path", T.async(function()
      local before = B:live()
      local s, _, _, raw = B:req("POST", "/v1/sandboxes", { body = case[2]:format(B.workspace),
        headers = { ["Content-Type"] = "application/json" } })
      assert.are.equal(400, s, raw)
      assert_clean_4xx(B, case[1], s, raw)
      assert.are.equal(before, B:live(), "a sandbox was created anyway")
    end))
  end

  it("refuses out-of-range integers elsewhere with 400, never a silent replacement", T.async(function()
    local _, g = B:req("GET", "/v1/sandbox-groups", { query = { ownerId = B.workspace } })
    local cases = {
      { "POST", "/v1/sandbox-groups", { body = { ownerId = B.workspace, name = "g",
        concurrencyLimit = 2 ^ 63 } } },
      { "GET", "/v1/sandboxes", { query = { limit = "9223372036854775808" } } },
      { "GET", "/v1/sandboxes", { query = { limit = "-1" } } },
      { "GET", "/v1/sandboxes/" .. SB.id .. "/files/list", { query = { path = "/",
        depth = "9223372036854775808" } } },
      { "GET", "/v1/sandboxes/" .. SB.id .. "/files/list", { query = { path = "/", depth = "1e999" } } },
      { "GET", "/v1/sandbox-groups/" .. g[1].sandboxGroup.id .. "/snapshots",
        { query = { ownerId = B.workspace, limit = "18446744073709551617" } } },
      { "GET", "/_moonbox/journal", { query = { since = "9223372036854775808" } } },
    }
    for _, c in ipairs(cases) do
      local s, _, _, raw = B:req(c[1], c[2], c[3])
      assert.are.equal(400, s, c[1] .. " " .. c[2] .. " " .. json.encode(c[3]) .. ": " .. raw)
      assert_clean_4xx(B, c[2], s, raw)
    end
    local _, list = B:req("GET", "/v1/sandboxes/" .. SB.id .. "/execs")
    local s, _, _, raw = B:req("POST", "/v1/sandboxes/" .. SB.id .. "/execs/" .. list[1].execution.id
      .. "/status",
      { body = '{"exitCode":9223372036854775808}', headers = { ["Content-Type"] = "application/json" } })
    assert.are.equal(400, s, raw)
    assert_clean_4xx(B, "exitCode 2^63", s, raw)
  end))

  -- Archives no honest client makes, each refused as a whole before anything is extracted.
  local ARCHIVES = {
    { "an absolute member name", { { name = "/root/escaped", data = "pwned" } } },
    { "a '..' member name", { { name = "../../../../root/escaped", data = "pwned" } } },
    { "a symlink to an absolute path", { { name = "l", type = "2", link = "/etc" } } },
    { "a symlink climbing out", { { name = "l", type = "2", link = "../../../../etc" } } },
    { "a hard link giving a symlink a directory it escapes from", { { name = "a/", type = "5",
      mode = ustar.O755 }, { name = "a/l", type = "2", link = "../top" }, { name = "h", type = "1",
      link = "a/l" } } },
    { "a hard link to /etc/passwd", { { name = "h", type = "1", link = "/etc/passwd" } } },
    { "a character device", { { name = "null", type = "3", major = 1, minor = 3 } } },
    { "a block device", { { name = "disk", type = "4", major = 8, minor = 0 } } },
    { "a fifo", { { name = "p", type = "6" } } },
  }
  for i, case in ipairs(ARCHIVES) do
    it("refuses an archive with " .. case[1] .. " as 400 unsafe_archive naming no host path",
      T.async(function()
        local target = "hostile-" .. i
        local _, tok = B:req("POST", "/v1/sandboxes/" .. SB.id .. "/files/upload/token",
          { query = { path = target } })
        local up = http.request { method = "PUT", url = tok.uri, body = ustar.archive(case[2]), headers = {
          Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/x-tar" } }
        assert.are.equal(400, up.status, up.body)
        assert.are.equal("unsafe_archive", json.decode(up.body).code, up.body)
        assert_clean_4xx(B, case[1], up.status, up.body)
        assert.are.equal("absent\n", sh(B, SB.id, "test -e /root/" .. target
          .. " || test -e /root/escaped || " ..
          "echo absent"))
      end))
  end

  for _, case in ipairs({
    { "a corrupt gzip archive", "application/x-tar", "gzip", "\31\139\8\0\0\0\0\0" .. ("\255"):rep(4000) },
    { "a gzip archive cut short", "application/gzip", nil, "\31\139\8\0\0\0\0\0\0\3\75\76\74\6\0" },
    { "bytes that are no archive", "application/x-tar", nil, ("not a tar "):rep(100) },
  }) do
    it("refuses " .. case[1] .. " as 400 invalid_archive naming no host path", T.async(function()
      local _, tok = B:req("POST", "/v1/sandboxes/" .. SB.id .. "/files/upload/token",
        { query = { path = "corrupt" } })
      local up = http.request { method = "PUT", url = tok.uri, body = case[4], headers = {
        Authorization = "Bearer " .. tok.token, ["Content-Type"] = case[2], ["Content-Encoding"] = case[3] } }
      assert.are.equal(400, up.status, up.body)
      assert.are.equal("invalid_archive", json.decode(up.body).code, up.body)
      assert_clean_4xx(B, case[1], up.status, up.body)
    end))
  end

  it("refuses a plain upload that says gzip but is not with 400 naming no host path", T.async(function()
    local _, tok = B:req("POST", "/v1/sandboxes/" .. SB.id .. "/files/upload/token",
      { query = { path = "f" } })
    local up = http.request { method = "PUT", url = tok.uri, body = ("\255"):rep(5000), headers = {
      Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/octet-stream",
      ["Content-Encoding"] = "gzip" } }
    assert.are.equal(400, up.status, up.body)
    assert_clean_4xx(B, "fake gzip upload", up.status, up.body)
    assert.are.same({}, sys.listdir(B.state .. "/tmp"))
  end))
end)

describe("the control endpoint", function()
  it("answers GET, PUT and DELETE /_moonbox/faults while a * latency rule delays everything else",
    T.async(function()
      local s = B:req("PUT", "/_moonbox/faults", { body = "*=latency:5000" })
      assert.are.equal(200, s)
      -- The rule is in force: an API request does not come back within a second...
      local ok = pcall(B.req, B, "GET", "/v1/sandbox-groups", { query = { ownerId = B.workspace },
        timeout = 1 })
      assert.is_false(ok, "the latency rule did not delay /v1")
      -- ...while the control endpoint answers well within the rule's 5 s, the request that removes
      -- the rule included.
      local gs, rules = B:req("GET", "/_moonbox/faults", { timeout = 3 })
      assert.are.equal(200, gs)
      assert.is_truthy(json.encode(rules):find("5000", 1, true))
      assert.are.equal(200, (B:req("GET", "/_moonbox/journal", { timeout = 3 })))
      assert.are.equal(200, (B:req("GET", "/_moonbox/health", { timeout = 3 })))
      assert.are.equal(200, (B:req("PUT", "/_moonbox/faults", { body = "*=latency:5000", timeout = 3 })))
      assert.are.equal(204, (B:req("DELETE", "/_moonbox/faults", { timeout = 3 })))
      assert.are.equal(200, (B:req("GET", "/v1/sandbox-groups", { query = { ownerId = B.workspace },
        timeout = 10 })))
    end))
end)

describe("create env values", function()
  it("are nowhere under the state dir once the sandbox is terminated, the database included",
    T.async(function()
      local state = proc.run({ "mktemp", "-d", "/tmp/moonbox-local-spec.XXXXXX" }).stdout:gsub("%s+$", "")
      local log = state .. "-backend.log"
      -- A small sandbox disk: grep reads its image (sparse) whole, freed blocks included.
      local b = L.start { state = state, env = BACKEND_ENV, stderr = { file = log }, args = { "--disk-size", "512M" } }
      local ok, err = pcall(function()
        local secret = "mbx-secret-" .. tostring(math.random(1e9)) .. "-" .. tostring(os.time())
        local sb = b:create { networkPolicy = { default = "deny-all" }, env = { PLANTED = secret } }
        -- The value reached the sandbox (else the rest would prove nothing)...
        assert.are.equal(secret .. "\n", b:exec(sb.id, "echo $PLANTED").stdout)
        local _, j = b:req("GET", "/_moonbox/journal")
        assert.is_nil(json.encode(j):find(secret, 1, true), "the journal holds the env value")
        assert.are.equal(204, (b:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")))
        b:wait_status(sb.id, "terminated")
        b:stop() -- the database is closed, its WAL folded in: every byte it keeps is on disk now
        local r = proc.run { "grep", "-rlaF", "--", secret, state, log }
        assert.are.equal(1, r.code, "the env value is in plain text in: " .. r.stdout .. r.stderr)
      end)
      b:destroy()
      os.remove(log)
      if not ok then error(err, 0) end
    end))
end)
