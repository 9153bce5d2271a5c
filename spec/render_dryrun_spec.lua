-- `moonbox run --dry-run`: recipes run against the simulated backend of moonbox.render.dryrun
-- on its simulated clock. What it reports for recipes/quickstart.lua, that it starts no
-- process, opens no socket and makes no state dir, that hooks decide exec results and
-- downloads, that fan-outs and budgets work in it, and that simulated time is what it counts.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local http = require "moonbox.http"
local json = require "moonbox.json"
local sys = require "moonbox.sys"
local task = require "moonbox.task"
local ids = require "moonbox.ids"
local render = require "moonbox.render"
local dryrun = require "moonbox.dryrun"
local dryrun_hooks = require "moonbox.render.dryrun"
local L = require "spec.support.local_backend"
local files = require "spec.support.files"

local run = T.async

-- A temporary HOME for a `moonbox run` child, with no RENDER_* variable: were the dry run to
-- reach for a backend, it would start the embedded one under HOME's state dir.
local function temp_home()
  return (proc.run({ "mktemp", "-d", "/tmp/moonbox-dryrun-spec.XXXXXX" }).stdout:gsub("%s+$", ""))
end

local function moonbox(home, args)
  local argv = { L.BIN }
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  argv.env = { HOME = home, XDG_STATE_HOME = home .. "/state", PATH = os.getenv("PATH") }
  argv.env_mode = "replace"
  return proc.run(argv)
end

local write = files.write

-- Runs recipe text under a dry run in this process (print and io.write captured); returns the
-- report, the captured output and the recipe's error (nil when it succeeded). [yields]
local function dry(text)
  local out = {}
  local env = setmetatable({
    print = function(...)
      local parts = table.pack(...)
      for i = 1, parts.n do parts[i] = tostring(parts[i]) end
      out[#out + 1] = table.concat(parts, "\t") .. "\n"
    end,
  }, { __index = _G })
  env.io = setmetatable({ write = function(...) for _, s in ipairs({ ... }) do out[#out + 1] = tostring(s) end end },
    { __index = io })
  local chunk = assert(load(text, "=recipe", "t", env))
  dryrun.start()
  local ok, err = pcall(chunk)
  pcall(render.close)
  local rep = dryrun.stop()
  return rep, table.concat(out), not ok and err or nil
end

describe("moonbox run --dry-run", function()
  it("reports recipes/quickstart.lua's creates, snapshot, restores and execs, and makes no state dir",
    run(function()
      local home = temp_home()
      local ok, err = pcall(function()
        local r = moonbox(home, { "run", "--dry-run", "--json", "recipes/quickstart.lua" })
        assert.are.equal(0, r.code, r.stderr)
        local rep = json.decode(r.stdout:match("([^\n]+)\n?$"))
        assert.is_true(rep.dry_run)
        assert.are.equal("ok", rep.outcome)
        assert.are.equal(4, rep.creates)
        assert.are.same({ ["1c-2g"] = 4 }, rep.creates_by_plan)
        assert.are.equal(3, rep.restores)
        assert.are.equal(1, rep.snapshots)
        assert.are.equal(6, rep.execs)
        assert.are.same({ 1, 1 }, { rep.uploads, rep.downloads })
        assert.are.equal(4, rep.peak_live)
        assert.are.equal(0, rep.live_at_end)
        -- the client's calls under the key `moonbox run --json` uses; the simulated backend's
        -- requests (data plane included) are at least as many
        assert.is_true(math.type(rep.api_calls) == "integer" and rep.api_calls > 0, tostring(rep.api_calls))
        assert.is_true(rep.api_requests >= rep.api_calls, rep.api_requests .. " < " .. rep.api_calls)
        -- the sandbox-seconds at the default durations (moonbox local's): the first sandbox
        -- lives the whole run, the three restores at least their restore and one exec each
        local d = rep.durations
        assert.are.same(dryrun_hooks.DURATIONS, d)
        assert.is_true(rep.sandbox_seconds >= rep.simulated_s + 3 * (d.restore + d.exec) - 1e-6,
          tostring(rep.sandbox_seconds))
        assert.is_true(rep.simulated_s >= d.create + 3 * d.exec + d.snapshot + d.restore + d.exec - 1e-6,
          tostring(rep.simulated_s))
        local whats = {}
        for _, s in ipairs(rep.steps) do whats[#whats + 1] = s.what end
        assert.are.same({ "create", "exec", "upload", "exec", "download", "exec", "snapshot", "restore",
          "restore", "restore", "exec", "exec", "exec", "terminate", "terminate", "terminate", "delete snapshot",
          "terminate" }, whats)
        assert.are.equal("sort -n work/input.txt > work/sorted.txt", rep.steps[4].command)
        -- no embedded backend, no ledger: nothing under the state home at all
        assert.is_nil(io.open(home .. "/state/moonbox", "r"), "a dry run made " .. home .. "/state/moonbox")
        local t = moonbox(home, { "run", "--dry-run", "recipes/quickstart.lua" })
        assert.are.equal(0, t.code, t.stderr)
        assert.matches("creates: 4 %(1c%-2g: 4%); restores among them: 3", t.stdout)
        assert.matches("snapshots: 1; execs: 6; uploads: 1; downloads: 1", t.stdout)
        assert.matches("peak live sandboxes: 4; sandbox%-seconds: [%d.]+", t.stdout)
        assert.is_nil(io.open(home .. "/state/moonbox", "r"))
        -- under strace: the one execve is moonbox's own, and no socket is ever made
        local strace = proc.run { "sh", "-c", "command -v strace" }
        assert(strace.code == 0, "strace is missing (./dev setup installs it)")
        local log = home .. "/strace.log"
        local traced = proc.run { "strace", "-f", "-qq", "-o", log, "-e",
          "trace=execve,execveat,fork,vfork,socket,socketpair,connect", L.BIN, "run", "--dry-run",
          "recipes/quickstart.lua", env_mode = "replace", env = { HOME = home, XDG_STATE_HOME = home .. "/state",
            PATH = os.getenv("PATH"),
            -- an ASan build: LeakSanitizer cannot run under ptrace
            ASAN_OPTIONS = (os.getenv("ASAN_OPTIONS") and (os.getenv("ASAN_OPTIONS") .. ":") or "") ..
              "detect_leaks=0" } }
        assert.are.equal(0, traced.code, traced.stderr)
        local calls = {}
        for line in io.lines(log) do
          local name = line:match("^%d+%s+([%w_]+)%(")
          if name then calls[#calls + 1] = name end
        end
        assert.are.same({ "execve" }, calls)
      end)
      proc.run { "rm", "-rf", home }
      if not ok then error(err, 0) end
    end))

  it("starts no process and opens no socket, however many sandboxes the recipe fans out to", run(function()
    ids.token() -- the id source's file stays open once used: open it before counting
    local before = sys.listdir("/proc/self/fd")
    local calls = {}
    local real = { spawn = proc.spawn, run = proc.run, request = http.request, stream = http.stream }
    local function spy(mod, name)
      mod[name] = function(...)
        calls[#calls + 1] = name
        return real[name](...)
      end
    end
    spy(proc, "spawn"); spy(proc, "run"); spy(http, "request"); spy(http, "stream")
    local ok, rep = pcall(dry, [[
local render = require "moonbox.render"
local task = require "moonbox.task"
local base <close> = render.sandboxes.create { plan = "2c-4g" }
base:write("app/conf", "x=1\n")
local snap = base:snapshot { name = "fan" }
local items = {}
for i = 1, 100 do items[i] = i end
task.map(items, function(i)
  local c <close> = render.sandboxes.create { snapshot = snap }
  assert(c:read("app/conf") == "x=1\n")
  return c:exec("echo " .. i):check().code
end, { concurrency = 100 })
local fleet <close> = render.restore(snap, { count = 20 })
]])
    proc.spawn, proc.run, http.request, http.stream = real.spawn, real.run, real.request, real.stream
    assert(ok, rep)
    assert.are.same({}, calls)
    assert.are.same(before, sys.listdir("/proc/self/fd"))
    assert.are.equal(121, rep.creates)
    assert.are.same({ ["2c-4g"] = 121 }, rep.creates_by_plan)
    assert.are.equal(120, rep.restores)
    assert.is_true(rep.peak_live >= 101, "peak " .. rep.peak_live)
    assert.are.equal(0, rep.live_at_end)
  end))

  it("answers execs and downloads as the recipe's hooks say, and execs exit 0 with no output otherwise",
    run(function()
      local dir = temp_home()
      local rep, out, err = dry(("local LOCAL = %q\n"):format(dir) .. [[
local render = require "moonbox.render"
assert(render.dry_run.active())
render.dry_run.on_exec("^git rev%-parse", { stdout = "abc123\n" })
render.dry_run.on_exec("^make", function(cmd, id) return { code = 2, stderr = cmd .. " failed in " .. id, seconds = 30 } end)
render.dry_run.on_download("/out/report%.txt$", function(path) return "report of " .. path end)
local sb <close> = render.sandboxes.create {}
print(sb:exec("git rev-parse HEAD").stdout)
local m = sb:exec("make all")
print(m.code, m.stderr == "make all failed in " .. sb.id)
print(sb:run_sync("make test").code)
local plain = sb:exec({ "ls", "-l", "/" })
print(plain.code, plain.stdout == "", plain.stderr == "")
-- env travels as a file the command's wrapper sources and removes; the simulated engine,
-- told so by the structured command, removes it too
sb:exec("true", { env = { SECRET = "s3" } })
print(#sb:ls("/dev/.moonbox"))
print(sb:read("/out/report.txt"))
-- what nothing wrote and no hook gives is not there, as on moonbox local
print(select(2, pcall(sb.read, sb, "never/written")).code)
sb:write("d/a.txt", "aa")
sb:write("d/b.txt", "bbb")
local names = {}
for _, e in ipairs(sb:ls("d")) do names[#names + 1] = e.name .. "=" .. e.size end
for _, e in ipairs(sb:ls(".")) do names[#names + 1] = e.name .. ":" .. e.type end
print(table.concat(names, " "))
print(select(2, pcall(sb.copy_out, sb, "/nothing/here", LOCAL .. "/empty")).code)
sb:copy_out("d", LOCAL .. "/d")
]])
      assert.is_nil(err)
      assert.are.equal("abc123\n\n2\ttrue\n2\n0\ttrue\ttrue\n0\nreport of /out/report.txt\nnot_found\n" ..
        "a.txt=2 b.txt=3 d:directory\nnot_found\n", out)
      assert.are.same({ "a.txt", "b.txt" }, (function()
        local names = sys.listdir(dir .. "/d")
        table.sort(names)
        return names
      end)(), "a directory comes back as it was uploaded")
      assert.are.equal("bbb", files.read(dir .. "/d/b.txt"))
      assert.are.equal(5, rep.execs)
      local by_cmd = {}
      for _, s in ipairs(rep.steps) do if s.what == "exec" then by_cmd[s.command] = s end end
      assert.are.equal(30, by_cmd["make all"].seconds)
      assert.are.equal(2, by_cmd["make all"].code)
      assert.is_not_nil(by_cmd["ls -l /"], "an argv exec is reported as the recipe wrote it")
      assert.is_false(render.dry_run.active())
      proc.run { "rm", "-rf", dir }
    end))

  it("counts simulated time: `sleep 600` is 600 sandbox-seconds; task.sleep, task.now, timeouts follow it",
    run(function()
      local rep, out, err = dry([[
local render = require "moonbox.render"
local task = require "moonbox.task"
local t0 = task.now()
local sb <close> = render.sandboxes.create {}
sb:exec("sleep 600")
task.sleep(3600)
print(math.floor(task.now() - t0))
local ok, e = pcall(sb.exec, sb, "sleep 900", { timeout = 5 })
print(ok, e.code, math.floor(task.now() - t0))
local p = sb:spawn("sleep 100")
task.sleep(1)
print(p:kill("TERM"), p:wait().code)
-- the backend's records read the same clock: a create an hour and more later says so
local later <close> = render.sandboxes.create {}
local rfc = require "moonbox.rfc3339"
print(math.floor(rfc.parse(later.created_at) - rfc.parse(sb.created_at)))
]])
      assert.is_nil(err)
      local lines = {}
      for l in out:gmatch("[^\n]+") do lines[#lines + 1] = l end
      local elapsed = tonumber(lines[1])
      assert.is_true(elapsed >= 4200 and elapsed < 4210, out)
      assert.are.equal("false\ttimeout\t" .. (elapsed + 5), lines[2])
      assert.are.equal("signalled\t143", lines[3])
      local apart = tonumber(lines[4])
      assert.is_true(apart >= 4205 and apart <= 4207, out)
      assert.is_true(rep.sandbox_seconds >= 4206 and rep.sandbox_seconds < 4216, tostring(rep.sandbox_seconds))
      assert.is_true(rep.simulated_s >= 4206, tostring(rep.simulated_s))
      local killed = 0
      for _, s in ipairs(rep.steps) do if s.killed then killed = killed + 1 end end
      assert.are.equal(2, killed) -- the timed-out exec and the killed one
    end))

  it("makes at most twice the requests of the same recipe against moonbox local (create + sb:snapshot{})",
    run(function()
      -- The dry run's durations default to what moonbox local takes (render.dry_run's DURATIONS),
      -- so the client's waits poll a simulated boot and capture as often as they poll real ones:
      -- wait_running's doubling poll from 10 ms, the capture's adaptive poll whose first look is
      -- at 50 ms. At Render-like durations (a 5 s capture) the adaptive poll alone made ~94 looks
      -- against moonbox local's 1 or 2. Both summaries count under the same key, api_calls.
      local home = temp_home()
      local B = L.start()
      local ok, err = pcall(function()
        write(home .. "/r.lua", [[
local render = require "moonbox.render"
local sb <close> = render.sandboxes.create {}
sb:snapshot {}
]])
        local argv = { L.BIN, "run", "--json", "--backend", B.url, home .. "/r.lua" }
        argv.env = { HOME = home, XDG_STATE_HOME = home .. "/state", PATH = os.getenv("PATH"),
          RENDER_API_KEY = B.key, RENDER_WORKSPACE_ID = B.workspace }
        argv.env_mode = "replace"
        local real = proc.run(argv)
        assert.are.equal(0, real.code, real.stderr)
        local real_rep = json.decode(real.stdout:match("([^\n]+)\n?$"))
        local d = moonbox(home, { "run", "--dry-run", "--json", home .. "/r.lua" })
        assert.are.equal(0, d.code, d.stderr)
        local dry_rep = json.decode(d.stdout:match("([^\n]+)\n?$"))
        assert.is_true(math.type(real_rep.api_calls) == "integer" and real_rep.api_calls >= 4,
          tostring(real_rep.api_calls))
        assert.is_true(math.type(dry_rep.api_calls) == "integer" and dry_rep.api_calls >= 4,
          tostring(dry_rep.api_calls))
        assert.is_true(dry_rep.api_calls <= 2 * real_rep.api_calls, string.format("the dry run made %d " ..
          "API calls, moonbox local %d", dry_rep.api_calls, real_rep.api_calls))
        assert.are.equal(1, dry_rep.snapshots)
      end)
      B:destroy()
      proc.run { "rm", "-rf", home }
      if not ok then error(err, 0) end
    end))

  it("refuses what the old simulation let through exactly as moonbox local does (same status, same code)",
    run(function()
      -- The six ways the dry run's own re-implementation of Render's wire disagreed with moonbox
      -- local; it is moonbox local's service and routes now, so each request gets moonbox local's
      -- answer. Asked of a real moonbox local first, then of a dry run, and compared.
      local D = require "spec.support.dryrun_backend"
      local function probe(B)
        local sb = B:create()
        local function settled(snap)
          for _ = 1, 600 do
            local _, got = B:req("GET", L.snapshot_path(snap))
            if got.status ~= "creating" then return got end
            task.sleep(0.05)
          end
          error("snapshot " .. snap.id .. " still creating")
        end
        local rt = settled(B:snapshot(sb.id, "runtime"))
        local s, named = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/snapshots",
          { body = { kind = "filesystem", name = "six" } })
        assert(s == 202, s)
        settled(named)
        local other = "tea-aaaaaaaaaaaaaaaaaaaa"
        local asked = {
          { "snapshotId and snapshotName together", "POST", "/v1/sandboxes",
            { body = { ownerId = B.workspace, snapshotId = rt.id, snapshotName = "six" } } },
          { "a runtime snapshot restored onto another plan", "POST", "/v1/sandboxes",
            { body = { ownerId = B.workspace, snapshotId = rt.id, plan = "2c-4g" } } },
          { "a create without ownerId", "POST", "/v1/sandboxes", { body = { plan = "1c-2g" } } },
          { "a create for another workspace", "POST", "/v1/sandboxes", { body = { ownerId = other } } },
          { "groups of another workspace", "GET", "/v1/sandbox-groups", { query = { ownerId = other } } },
          { "snapshots without ownerId", "GET", "/v1/sandbox-groups/" .. rt.sandboxGroupId .. "/snapshots", {} },
          { "a plain-number cursor", "GET", "/v1/sandboxes", { query = { ownerId = B.workspace, cursor = "1" } } },
          { "limit 0", "GET", "/v1/sandboxes", { query = { ownerId = B.workspace, limit = "0" } } },
          { "limit 101", "GET", "/v1/sandboxes", { query = { ownerId = B.workspace, limit = "101" } } },
          { "an unclean path", "POST", "/v1/sandboxes/" .. sb.id .. "/files/upload/token",
            { query = { path = "/app/../etc/passwd" } } },
        }
        local out = {}
        for _, a in ipairs(asked) do
          local status, body = B:req(a[2], a[3], a[4])
          out[#out + 1] = { a[1], status, type(body) == "table" and body.code or nil }
        end
        B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
        return out
      end
      local real_b = L.start()
      local ok, real = pcall(probe, real_b)
      real_b:destroy()
      assert(ok, real)
      local dry_b = D.start()
      local dok, simulated = pcall(probe, dry_b)
      dry_b:destroy()
      assert(dok, simulated)
      for _, r in ipairs(real) do assert.is_true(r[2] >= 400, r[1] .. " was answered " .. r[2]) end
      assert.are.same(real, simulated)
      assert.are.same({ 409, "snapshot_plan_mismatch" }, { simulated[2][2], simulated[2][3] })
      assert.are.same({ 400, "invalid_cursor" }, { simulated[7][2], simulated[7][3] })
      assert.are.same({ 400, "invalid_limit" }, { simulated[9][2], simulated[9][3] })
    end))

  it("enforces budgets on the simulated backend: the sandbox count before sending, the seconds by terminating",
    run(function()
      local home = temp_home()
      local ok, err = pcall(function()
        write(home .. "/r.lua", [[
local render = require "moonbox.render"
local a <close> = render.sandboxes.create {}
local b <close> = render.sandboxes.create {}
a:exec("sleep 600")
local c <close> = render.sandboxes.create {}
]])
        local r = moonbox(home, { "run", "--dry-run", "--json", "--max-sandboxes", "2", home .. "/r.lua" })
        assert.are.equal(1, r.code)
        local rep = json.decode(r.stdout:match("([^\n]+)\n?$"))
        assert.are.same({ "budget_exceeded", "sandboxes" }, { rep.errors[1].code, rep.errors[1].budget })
        assert.are.same({ 2, 2 }, { rep.creates, rep.peak_live })
        assert.are.equal("sandboxes", rep.budget.exceeded)
        assert.are.equal(0, rep.live_at_end)
        -- 2 sandboxes for 600 s would be 1200 sandbox-seconds: the budget stops the run at 100
        r = moonbox(home, { "run", "--dry-run", "--json", "--max-sandbox-seconds", "100", home .. "/r.lua" })
        assert.are.equal(1, r.code)
        rep = json.decode(r.stdout:match("([^\n]+)\n?$"))
        assert.are.same({ "budget_exceeded", "sandbox_seconds" }, { rep.errors[1].code, rep.errors[1].budget })
        assert.is_true(rep.sandbox_seconds >= 100 and rep.sandbox_seconds < 101, tostring(rep.sandbox_seconds))
        assert.are.equal(0, rep.live_at_end)
      end)
      proc.run { "rm", "-rf", home }
      if not ok then error(err, 0) end
    end))

  it("refuses bad hooks and durations at the recipe's line, and --dry-run with --backend", run(function()
    local _, _, err = dry([[
local render = require "moonbox.render"
render.dry_run.on_exec(42, {})
]])
    assert.matches("recipe:2: render.dry_run.on_exec: the pattern must be a string", tostring(err))
    _, _, err = dry([[require("moonbox.render").dry_run.durations { boot = 1 }]])
    assert.matches("unknown operation 'boot'", tostring(err))
    local rep = dry([[require("moonbox.render").dry_run.durations { create = 10 }
local sb <close> = require("moonbox.render").sandboxes.create {}]])
    assert.are.equal(10, rep.durations.create)
    assert.is_true(rep.simulated_s >= 10, tostring(rep.simulated_s))
    -- a loop waiting for output no hook gives ends at the simulated-time limit
    local looped
    rep, _, looped = dry([[
local render = require "moonbox.render"
render.dry_run.limit(100)
local sb <close> = render.sandboxes.create {}
while sb:exec("cat /ready").stdout ~= "yes" do require("moonbox.task").sleep(10) end
]])
    assert.are.equal("simulated_time_limit", looped.code)
    assert.is_true(rep.simulated_s > 100 and rep.simulated_s < 120, tostring(rep.simulated_s))
    assert.are.equal(0, rep.live_at_end)
    local r = proc.run { L.BIN, "run", "--dry-run", "--backend", "local", "recipes/quickstart.lua" }
    assert.are.equal(2, r.code)
    assert.matches("%-%-dry%-run simulates the backend", r.stderr)
    task.yield()
  end))
end)
