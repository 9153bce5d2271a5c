-- Seeing and stopping a fan-out, against a real `moonbox local`: `moonbox run --trace` writes
-- valid Chrome trace JSON with one span per API call, `--json` sums the run up, neither holds a
-- planted secret; the adaptive window shrinks under injected 429s (sizes read from the trace)
-- and recovers; SIGTERM exits 143 with everything terminated; a second SIGINT forces the exit
-- and `moonbox reap` finishes the job; a failed capture reaches the client as snapshot_failed.
local T = require "moonbox.testing"
local L = require "spec.support.local_backend"
local proc = require "moonbox.proc"
local json = require "moonbox.json"
local task = require "moonbox.task"
local files = require "spec.support.files"

local SECRET_ENV = "planted-env-secret-7f3a9c"
local SECRET_EXEC = "planted-exec-secret-2b81de"

local B, tmp

local write = files.write

-- tmp/name holding text: a recipe of the spec's. -> its path.
local function recipe_file(name, text)
  local path = tmp .. "/" .. name
  write(path, text)
  return path
end
local read = files.read

-- Runs `moonbox run ARGS...` with the backend's env; returns code, stdout, stderr.
local function run(args, env)
  local argv = { L.BIN, "run" }
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  argv.env = env or { RENDER_LOCAL_DEV_URL = B.url, RENDER_API_KEY = B.key, RENDER_WORKSPACE_ID = B.workspace,
    XDG_STATE_HOME = tmp .. "/state", PATH = os.getenv("PATH") }
  local r = proc.run(argv)
  return r.code, r.stdout, r.stderr
end

local FANOUT = [[
local render = require "moonbox.render"
local task = require "moonbox.task"
local sb <close> = render.sandboxes.create { env = { TOKEN = "%s" } }
local out = sb:exec("echo $TOKEN-seen", { env = { EXTRA = "%s" } }):check().stdout
assert(out:find("seen"), out)
local snap = sb:snapshot { name = "orch", wait = true }
local fleet <close> = render.restore(snap, { count = %d, concurrency = %d })
task.map(fleet, function(s) return s:exec("echo $EXTRA", { env = { EXTRA = "%s" } }):check().code end)
]]

-- Schema of the Chrome trace event format (the JSON Array Format), as Perfetto reads it.
local PHASES = { X = true, B = true, E = true, b = true, e = true, n = true, i = true, C = true, M = true }
local function check_schema(events)
  assert.is_table(events)
  assert.is_true(#events > 0)
  for k, ev in ipairs(events) do
    local where = "event " .. k .. ": " .. json.encode(ev)
    assert.is_string(ev.name, where)
    assert.is_true(PHASES[ev.ph] == true, where)
    assert.is_number(ev.pid, where)
    assert.is_number(ev.tid, where)
    if ev.ph ~= "M" then
      assert.is_number(ev.ts, where)
      assert.is_true(ev.ts >= 0 and ev.ts % 1 == 0, where)
    end
    if ev.ph == "X" then assert.is_true(type(ev.dur) == "number" and ev.dur >= 0 and ev.dur % 1 == 0, where) end
    if ev.ph == "b" or ev.ph == "e" or ev.ph == "n" then
      assert.is_string(ev.cat, where)
      assert.is_true(ev.id ~= nil, where)
    end
    if ev.ph == "M" then assert.is_string(ev.args and ev.args.name, where) end
    if ev.ph == "C" then
      for _, v in pairs(ev.args) do assert.is_number(v, where) end
    end
    if ev.args ~= nil then assert.is_table(ev.args, where) end
  end
end

local function journal_since(seq)
  local status, j = B:req("GET", "/_moonbox/journal", { query = { since = seq } })
  assert.are.equal(200, status)
  return j
end

local function last_seq()
  local j = journal_since(0)
  return #j > 0 and j[#j].seq or 0
end

setup(T.async(function()
  tmp = proc.run({ "mktemp", "-d", "/tmp/moonbox-orch-spec.XXXXXX" }).stdout:gsub("%s+$", "")
  B = L.start()
end))

teardown(T.async(function()
  if B then B:destroy() end
  proc.run { "rm", "-rf", tmp }
end))

describe("moonbox run --trace and --json", function()
  it("writes valid Chrome trace JSON with one span per API call, and a summary; no secret in either",
    T.async(function()
      local recipe = recipe_file("fanout.lua", FANOUT:format(SECRET_ENV, SECRET_EXEC, 4, 4, SECRET_EXEC))
      local trace_file = tmp .. "/fanout.trace.json"
      local seq = last_seq()
      local code, out, err = run { "--trace", trace_file, "--json", "--progress", recipe }
      assert.are.equal(0, code, err)
      local text = assert(read(trace_file))
      assert.matches("^%[\n", text)
      assert.matches("\n%]\n$", text) -- a trace that stopped normally has its closing bracket
      local doc = json.decode(text)
      check_schema(doc)

      -- One "api" span per request the backend received (the journal is the other side's count).
      local requests = 0
      for _, r in ipairs(journal_since(seq)) do
        if not r.path:match("^/_moonbox") then requests = requests + 1 end
      end
      local api_spans, tasks, sb_begin, sb_end = 0, 0, {}, {}
      for _, ev in ipairs(doc) do
        if ev.cat == "api" and ev.ph == "X" then
          api_spans = api_spans + 1
          assert.matches("^[%w_.:]+$", ev.name)
          assert.is_nil(ev.args.url)
        elseif ev.cat == "task" then
          tasks = tasks + 1
        elseif ev.cat == "sandbox" and ev.ph == "b" then
          sb_begin[ev.id] = ev.ts
        elseif ev.cat == "sandbox" and ev.ph == "e" then
          sb_end[ev.id] = ev.ts
          assert.is_nil(ev.args and ev.args.open, "a sandbox span was still open at the end")
        end
      end
      assert.are.equal(requests, api_spans)
      assert.is_true(tasks >= 4)

      -- The summary is the last line of stdout and agrees with the trace.
      local last = out:match("([^\n]+)\n?$")
      local s = json.decode(last)
      assert.are.equal("ok", s.outcome)
      assert.are.equal(0, s.exit_code)
      assert.are.equal(5, #s.sandboxes.created)
      assert.are.equal(5, #s.sandboxes.terminated)
      assert.are.equal(0, #s.sandboxes.leaked)
      assert.are.equal(requests, s.api_calls)
      for _, id in ipairs(s.sandboxes.created) do
        assert.is_number(sb_begin[id], id)
        assert.is_true(sb_end[id] >= sb_begin[id], id)
      end
      assert.matches("moonbox: 5 created", err) -- the --progress line

      -- Redaction: neither secret, nor the API key, anywhere we wrote.
      for what, blob in pairs({ trace = text, stdout = out, stderr = err }) do
        for _, secret in ipairs({ SECRET_ENV, SECRET_EXEC, B.key }) do
          assert.is_nil(blob:find(secret, 1, true), secret .. " found in the " .. what)
        end
      end
      assert.are.equal(0, B:live())
    end))

  it("lists the error and the ids in the summary when the recipe fails", T.async(function()
    local recipe = recipe_file("fail.lua", [[
local render = require "moonbox.render"
local sb <close> = render.sandboxes.create {}
sb:exec("exit 3"):check()
]])
    local code, out = run { "--json", recipe }
    assert.are.equal(1, code)
    local s = json.decode(out:match("([^\n]+)\n?$"))
    assert.are.equal("failed", s.outcome)
    assert.are.equal(1, #s.sandboxes.created)
    assert.are.same(s.sandboxes.created, s.sandboxes.terminated)
    assert.are.equal(1, #s.errors)
    assert.matches("exit", s.errors[1].message)
    assert.are.equal(s.sandboxes.created[1], s.errors[1].sandbox_id)
  end))

  it("refuses an unknown option and a trace file it cannot write", T.async(function()
    local code, _, err = run { "--bogus", "x.lua" }
    assert.are.equal(2, code)
    assert.matches("unknown option '%-%-bogus'", err)
    local recipe = recipe_file("nop.lua", "return 1\n")
    code, _, err = run { "--trace", "/nonexistent-dir/t.json", recipe }
    assert.are.equal(1, code)
    assert.matches("cannot write the trace file", err)
  end))
end)

describe("a --trace whose run is SIGKILLed", function()
  it("holds whole events: it parses as a Chrome trace after appending ] at most (10 kills)", T.async(function()
    local runs = require "spec.support.runs"
    local recipe = recipe_file("killed-trace.lua", runs.fanout("task.map", { n = 12, execs = 3, concurrency = 6 }))
    math.randomseed(5)
    local env = { RENDER_LOCAL_DEV_URL = B.url, RENDER_API_KEY = B.key, RENDER_WORKSPACE_ID = B.workspace,
      XDG_STATE_HOME = tmp .. "/state", PATH = os.getenv("PATH") }
    local cut = 0
    for i = 1, 10 do
      local trace_file = string.format("%s/killed-%d.trace.json", tmp, i)
      local mark = runs.last_seq(B)
      local p = proc.spawn { L.BIN, "run", "--trace", trace_file, recipe, env = env, stderr = "null" }
      runs.until_requests(B, mark, math.random(1, 100), p)
      p:kill("KILL")
      p:wait()
      local text = assert(read(trace_file))
      if not text:match("%]\n$") then
        cut = cut + 1
        text = text .. "]"
      end
      local ok, doc = pcall(json.decode, text)
      assert.is_true(ok and type(doc) == "table", "kill " .. i .. ": not JSON after appending ]: " .. text:sub(-300))
      check_schema(doc)
      runs.settled(B, mark)
      local reap = proc.run { L.BIN, "reap", env = env }
      assert.are.equal(0, reap.code, reap.stdout .. reap.stderr)
    end
    assert.is_true(cut >= 5, "only " .. cut .. " of 10 kills landed before the trace was closed")
    assert.are.equal(0, B:live())
  end))
end)

describe("adaptive concurrency", function()
  it("halves the window under injected 429s, honours Retry-After, and grows back", T.async(function()
    -- Creates are throttled for a burst (the first 6 creates get 429, Retry-After 1), then pass.
    local recipe = recipe_file("aimd.lua", string.format([[
local render = require "moonbox.render"
local snap = render.snapshots.latest("orch") or error("no snapshot 'orch'")
local fleet <close> = render.restore(snap, { count = 24, concurrency = 8 })
assert(#fleet == 24)
]]))
    B:faults('[{"match":"POST /v1/sandboxes","fault":"status","status":429,"retry_after":1,"count":6}]')
    local trace_file = tmp .. "/aimd.trace.json"
    local code, _, err = run { "--trace", trace_file, recipe }
    B:faults("[]")
    assert.are.equal(0, code, err)
    local doc = json.decode(assert(read(trace_file)))
    check_schema(doc)
    local sizes, throttled = {}, 0
    for _, ev in ipairs(doc) do
      if ev.ph == "C" and ev.name == "concurrency render.restore" then sizes[#sizes + 1] = ev.args.window end
      if ev.name == "throttled" then throttled = throttled + 1 end
    end
    assert.are.equal(6, throttled)
    assert.are.equal(8, sizes[1])
    local min, min_at = math.huge, 0
    for i, v in ipairs(sizes) do
      if v < min then min, min_at = v, i end
    end
    assert.is_true(min <= 4, "the window never shrank: " .. table.concat(sizes, ","))
    -- Halving, not collapse: every cut is at most a halving of the size before it.
    for i = 2, #sizes do
      assert.is_true(sizes[i] >= sizes[i - 1] // 2 and sizes[i] <= sizes[i - 1] + 1, table.concat(sizes, ","))
    end
    -- It recovered: after the smallest size the window grew again.
    local after = 0
    for i = min_at + 1, #sizes do after = math.max(after, sizes[i]) end
    assert.is_true(after > min, "the window did not grow back: " .. table.concat(sizes, ","))
    assert.are.equal(0, B:live())
  end))

  it("task.map backs off too when its work is throttled", T.async(function()
    B:connect_render()
    local render = require "moonbox.render"
    local sb <close> = render.sandboxes.create {}
    B:faults('[{"match":"GET /v1/sandboxes/*","fault":"status","status":429,"retry_after":0,"count":4}]')
    local items = {}
    for i = 1, 16 do items[i] = i end
    local _, stats = task.map(items, function() return render.sandboxes.get(sb.id).status end,
      { concurrency = 8 })
    B:faults("[]")
    assert.is_true(stats.min_window < 8, "min window " .. stats.min_window)
  end))
end)

describe("signals during a fan-out", function()
  local function spawn_run(recipe)
    return proc.spawn { L.BIN, "run", recipe, stdout = "pipe", stderr = "pipe",
      env = { RENDER_LOCAL_DEV_URL = B.url, RENDER_API_KEY = B.key, RENDER_WORKSPACE_ID = B.workspace,
        XDG_STATE_HOME = tmp .. "/state", PATH = os.getenv("PATH") } }
  end

  local SLOW = [[
local render = require "moonbox.render"
local snap = render.snapshots.latest("orch")
local fleet <close> = render.restore(snap, { count = 6, concurrency = 6 })
io.stdout:write("ready\n"); io.stdout:flush()
require("moonbox.task").map(fleet, function(s) return s:exec("sleep 60") end, { concurrency = 6 })
]]

  it("SIGTERM cancels the recipe: exit 143 and every sandbox terminated", T.async(function()
    local recipe = recipe_file("term.lua", SLOW)
    local seq = last_seq()
    local p = spawn_run(recipe)
    local lines = p:lines("stdout")
    assert.are.equal("ready", lines())
    -- The signal comes while the six execs run: the backend has received all their streams.
    local deadline = task.now() + 60
    while true do
      local streams = 0
      for _, e in ipairs(journal_since(seq)) do
        if e.method == "POST" and e.path:find("/runs/stream$") then streams = streams + 1 end
      end
      if streams >= 6 then break end
      assert(task.now() < deadline, "only " .. streams .. " of 6 exec streams reached the backend")
      task.sleep(0.05)
    end
    p:kill("TERM")
    local code = p:wait()
    assert.are.equal(143, code)
    assert.are.equal(0, B:live())
  end))

  it("a second SIGINT forces the exit; moonbox reap terminates what was left", T.async(function()
    -- A guard that takes long to unwind (it closes before the fleet), so the second SIGINT
    -- arrives while the sandboxes still run.
    local recipe = recipe_file("int2.lua", [[
local render = require "moonbox.render"
local guard = require "moonbox.guard"
local snap = render.snapshots.latest("orch")
local fleet <close> = render.restore(snap, { count = 4, concurrency = 4 })
local g <close> = guard.new("slow")
g:defer(function()
  io.stdout:write("unwinding\n"); io.stdout:flush()
  require("moonbox.task").sleep(30)
end)
io.stdout:write("ready\n"); io.stdout:flush()
require("moonbox.task").sleep(60)
]])
    local p = spawn_run(recipe)
    local lines = p:lines("stdout")
    assert.are.equal("ready", lines())
    p:kill("INT")
    assert.are.equal("unwinding", lines()) -- the first SIGINT is being handled
    p:kill("INT")
    local code = p:wait()
    assert.are.equal(130, code)
    assert.are.equal(4, B:live())
    local env = { RENDER_LOCAL_DEV_URL = B.url, RENDER_API_KEY = B.key, RENDER_WORKSPACE_ID = B.workspace,
      XDG_STATE_HOME = tmp .. "/state", PATH = os.getenv("PATH") }
    local ps = proc.run { L.BIN, "ps", env = env }
    local held = 0
    for _ in ps.stdout:gmatch("sbx%-") do held = held + 1 end
    assert.are.equal(4, held, ps.stdout)
    local r = proc.run { L.BIN, "reap",
      env = { RENDER_LOCAL_DEV_URL = B.url, RENDER_API_KEY = B.key, RENDER_WORKSPACE_ID = B.workspace,
        XDG_STATE_HOME = tmp .. "/state", PATH = os.getenv("PATH") } }
    assert.are.equal(0, r.code, r.stderr)
    assert.are.equal(0, B:live())
  end))
end)

describe("a capture that fails", function()
  it("reaches the client as snapshot_failed with the snapshot id", T.async(function()
    B:connect_render()
    local render = require "moonbox.render"
    B:faults('[{"match":"POST /v1/sandboxes/*/snapshots","fault":"capture","count":1}]')
    local sb <close> = render.sandboxes.create {}
    local snap = sb:snapshot { name = "doomed", wait = false }
    local err = T.errors_with("snapshot_failed", function() snap:wait_available { timeout = 30 } end)
    B:faults("[]")
    assert.are.equal(snap.id, err.snapshot_id)
    assert.is_truthy(tostring(err):find(snap.id, 1, true))
  end))
end)
