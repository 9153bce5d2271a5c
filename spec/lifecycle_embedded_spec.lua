-- The embedded local backend (issue 12): one per state directory, started once however many
-- tasks and processes ask at once, shared by the runs that use it, gone with the last of them —
-- SIGKILL included — and brought up again by `moonbox reap` to terminate what a killed run left.
-- Every test runs `moonbox run` as a user would, with no backend configured, in a home of its
-- own (its state dir is $HOME/.local/state/moonbox/local).
local T = require "moonbox.testing"
local runs = require "spec.support.runs"
local task = require "moonbox.task"
local proc = require "moonbox.proc"
local conn = require "moonbox.render.conn"
local embedded = require "moonbox.render.embedded"
local files = require "spec.support.files"

local read = files.read

local function count(text, pattern)
  local n = 0
  for _ in text:gmatch(pattern) do n = n + 1 end
  return n
end

-- Waits until the embedded backend's process pid (started at `start`; its pid file removes
-- itself before the process has quite ended) is gone; polls: there is no event for another
-- process's end. At most 60 s. [yields]
local function until_stopped(pid, start)
  if not pid then return end
  local ledger = require "moonbox.ledger"
  for _ = 1, 600 do
    if ledger.pid_start(pid) ~= start then return end
    task.sleep(0.1)
  end
  error("the embedded backend (pid " .. pid .. ") did not stop within 60 s")
end

-- The backends (moonbox local --embedded) running on dir, by their command lines.
local function backend_processes(dir)
  local r = proc.run { "pgrep", "-f", "moonbox local --embedded --quiet --port 0 --state " .. dir .. "$" }
  return count(r.stdout, "%d+")
end

local STARTED = "moonbox: started an embedded local backend at http://127%.0%.0%.1:%d+"
local SHARING = "moonbox: sharing the embedded local backend at http://127%.0%.0%.1:%d+"

describe("20 concurrent first calls in a recipe with no backend running", function()
  it("start exactly one embedded backend, which ends with the run (5 runs)", T.async(function()
    for i = 1, 5 do
      local home = runs.home()
      local recipe = home:recipe([[
local render = require "moonbox.render"
local task = require "moonbox.task"
local items = {}
for i = 1, 20 do items[i] = i end
local ids = task.map(items, function()
  local sb <close> = render.sandboxes.create {}
  return sb:exec("echo ok"):check().stdout
end, { concurrency = 20 })
assert(#ids == 20)
print(render.connection().base)
]])
      local r = home:moonbox("run", recipe)
      local what = "run " .. i .. ": " .. r.stderr
      assert.are.equal(0, r.code, what)
      assert.are.equal(1, count(r.stderr, STARTED), what)
      assert.are.equal(0, count(r.stderr, SHARING), what)
      assert.is_nil(r.stderr:find("leak", 1, true), what)
      assert.are.equal(0, backend_processes(home:state_dir()), what)
      assert.is_nil(read(home:state_dir() .. "/endpoint"), what)
      home:destroy()
    end
  end))
end)

describe("two recipes started at once on one state dir", function()
  it("share one backend, which outlives the run that started it (5 pairs)", T.async(function()
    -- Each recipe holds a sandbox until the spec lets it go, so the two overlap for certain.
    local function recipe(home, name)
      return home:recipe(string.format([[
local render = require "moonbox.render"
local task = require "moonbox.task"
local sb <close> = render.sandboxes.create {}
print("%s ready") io.stdout:flush()
while not io.open(%q) do task.sleep(0.02) end
print(sb:exec("echo %s after"):check().stdout)
]], name, home.dir .. "/" .. name .. "-go", name))
    end
    for i = 1, 5 do
      local home = runs.home()
      local a = home:spawn("run", recipe(home, "a"))
      local b = home:spawn("run", recipe(home, "b"))
      assert.are.equal("a ready", a:lines()())
      assert.are.equal("b ready", b:lines()())
      -- The first to finish is one of the two; the other must still have its backend.
      assert(io.open(home.dir .. "/a-go", "w")):close()
      assert.are.equal(0, a:wait())
      assert(io.open(home.dir .. "/b-go", "w")):close()
      assert.are.equal(0, b:wait())
      local err = (a:read("stderr") or "") .. (b:read("stderr") or "")
      local out = (a:read() or "") .. (b:read() or "")
      local what = "pair " .. i .. ": " .. err
      assert.matches("a after", out, nil, true)
      assert.matches("b after", out, nil, true)
      assert.are.equal(1, count(err, STARTED), what)
      assert.are.equal(1, count(err, SHARING), what)
      assert.are.equal(0, backend_processes(home:state_dir()), what)
      home:destroy()
    end
  end))

  it("never fail, whoever comes first (10 pairs)", T.async(function()
    for i = 1, 10 do
      local home = runs.home()
      local recipe = home:recipe([[
local render = require "moonbox.render"
local sb <close> = render.sandboxes.create {}
print(sb:exec("echo ok"):check().stdout)
]])
      local a = home:spawn("run", recipe)
      local b = home:spawn("run", recipe)
      local ca, cb = a:wait(), b:wait()
      local err = (a:read("stderr") or "") .. (b:read("stderr") or "")
      assert.are.same({ 0, 0 }, { ca, cb }, "pair " .. i .. ": " .. err)
      -- Both started one (one after the other) or one shared the other's; never two at once.
      assert.are.equal(2, count(err, STARTED) + count(err, SHARING), err)
      assert.are.equal(0, backend_processes(home:state_dir()), err)
      home:destroy()
    end
  end))
end)

-- The backend's journal, through its endpoint and key in the state dir.
local function backend_of(dir)
  local url = (read(dir .. "/endpoint") or ""):match("^(%S+)")
  local key = (read(dir .. "/api-key") or ""):match("%S+")
  if url and key then return { url = url, key = key } end
end

describe("a run on the embedded backend SIGKILLed", function()
  local SEED = tonumber(os.getenv("MOONBOX_KILL_SEED") or "") or 12
  local TIMES = runs.TIMES

  it("takes its backend down with it; the next run starts a fresh one, and says so", T.async(function()
    local home = runs.home()
    local recipe = home:recipe([[
local render = require "moonbox.render"
local sb <close> = render.sandboxes.create {}
print("ready") io.stdout:flush()
require("moonbox.task").sleep(600)
]])
    local p = home:spawn("run", recipe)
    assert.are.equal("ready", p:lines()())
    local pid, start = embedded.backend_pid(home:state_dir())
    assert.is_number(pid)
    p:kill("KILL")
    p:wait()
    until_stopped(pid, start)
    assert.are.equal(0, backend_processes(home:state_dir()))
    local r = home:moonbox("run", home:recipe('print(require("moonbox.render").connection().base)'))
    assert.are.equal(0, r.code, r.stderr)
    assert.matches(STARTED, r.stderr)
    local reap = home:moonbox("reap")
    assert.are.equal(0, reap.code, reap.stdout .. reap.stderr)
    assert.matches("1 terminated", reap.stdout)
    assert.are.equal(0, backend_processes(home:state_dir()))
    home:destroy()
  end))

  for _, kind in ipairs { "task.map", "render.restore" } do
    it("at a random point of a " .. kind .. " fan-out: ps lists exactly what runs, one reap ends it (" .. TIMES .. " kills)",
      T.async(function()
        local home = runs.home()
        local dir = home:state_dir()
        local recipe = home:recipe(runs.fanout(kind))
        math.randomseed(SEED)
        local killed_with = {}
        for i = 1, TIMES do
          local at = i % 2 == 1 and math.random(1, 30) or math.random(1, 150)
          local p = home:spawn("run", recipe)
          -- The backend this run starts serves the journal the kill point is counted in.
          local b, pid, start
          while not b and p:kill(0) do
            pid, start = embedded.backend_pid(dir)
            b = pid and backend_of(dir)
            if not b then task.sleep(0.01) end
          end
          local running = b and pcall(runs.until_requests, b, 0, at, p)
          p:kill("KILL")
          p:wait()
          until_stopped(pid, start)
          local what = string.format("%s kill %d (after %d requests%s, seed %d)", kind, i, at,
            running and "" or "; the run had ended", SEED)
          -- This spec brings the backend up again and holds it while ps and reap look at it.
          local c = conn.connect { backend = "local", state_dir = dir }
          local ok, err = pcall(function()
            local live = runs.live(c)
            killed_with[#killed_with + 1] = runs.count(live)
            local ps = home:moonbox("ps")
            assert.are.equal(0, ps.code, ps.stderr)
            local held, unchecked = runs.ps_sandboxes(ps.stdout)
            assert.are.equal(0, unchecked, what .. ":\n" .. ps.stdout)
            assert.are.same(runs.keys(live), runs.keys(held), what .. ":\n" .. ps.stdout)
            local reap = home:moonbox("reap")
            assert.are.equal(0, reap.code, what .. ":\n" .. reap.stdout .. reap.stderr)
            assert.are.same({}, runs.live(c), what .. ":\n" .. reap.stdout)
          end)
          c:close()
          if not ok then error(err, 0) end
          assert.are.equal(0, backend_processes(dir), what)
        end
        print(string.format("\nembedded %s: sandboxes left at each of %d kills (seed %d): %s", kind, TIMES,
          SEED, table.concat(killed_with, " ")))
        local busy = 0
        for _, n in ipairs(killed_with) do
          if n > 0 then busy = busy + 1 end
        end
        assert.is_true(busy >= TIMES // 2, "too few kills met sandboxes: " .. table.concat(killed_with, " "))
        home:destroy()
      end))
  end
end)
