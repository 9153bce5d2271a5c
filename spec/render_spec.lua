-- moonbox.render against a real `moonbox local`: sandboxes, exec, typed errors, retries (seen in
-- the backend's request journal), and the never-re-sent create.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local json = require "moonbox.json"
local render = require "moonbox.render"
local L = require "spec.support.local_backend"
local runs = require "spec.support.runs"

local B

local run = T.async

L.fixture(setup, teardown, function(b) B = b end)

local function journal_mark() return runs.last_seq(B) end

describe("render.sandboxes", function()
  it("creates a running sandbox, sends only the fields given, and terminates it on scope exit", T.async(function()
    local mark = journal_mark()
    local id
    do
      local sb <close> = render.sandboxes.create {}
      id = sb.id
      assert.are.equal("running", sb.status)
      assert.matches("^sbg%-", sb.sandbox_group_id)
    end
    local creates = runs.requests(B, mark, "POST", "/v1/sandboxes")
    assert.are.equal(1, #creates)
    -- nothing but the owner and moonbox's label (by which a lost answer is reconciled)
    assert.matches("^mb%-x%x+$", creates[1].body.name)
    assert.are.equal(json.encode({ name = creates[1].body.name, ownerId = B.workspace }), creates[1].body_json)
    local _, got = B:req("GET", "/v1/sandboxes/" .. id)
    assert.are.equal("terminated", got.status)
  end))

  it("refuses an option it does not know, at the caller's line, before sending anything", T.async(function()
    -- A misspelt network option must never create an allow-all sandbox without a word.
    local mark = journal_mark()
    local cases = {
      { function() local r = render.sandboxes.create { netwrok = "deny-all" }; return r end,
        "render.sandboxes.create: unknown option `netwrok` (did you mean `network`?)" },
      { function() local r = render.sandboxes.create { network = "deny-all", lifetme = 5 }; return r end,
        "render.sandboxes.create: unknown option `lifetme` (did you mean `lifetime`?)" },
      { function() local r = render.sandboxes.create { network = "deny-all", timeout = 5 }; return r end,
        "render.sandboxes.create: `timeout` was the sandbox's lifetime: write `lifetime`; the wait's deadline " ..
          "is `wait_timeout`" },
      { function() local r = render.restore("base", { count = 2, netwrok = "deny-all" }); return r end,
        "render.restore: unknown option `netwrok` (did you mean `network`?)" },
      { function() local r = render.restore("base", { count = 2, wait = true }); return r end,
        "render.restore: unknown option `wait`" },
      { function() local r = render.sandboxes.create { [1] = "deny-all" }; return r end,
        "render.sandboxes.create: unknown option `1`" },
    }
    for _, c in ipairs(cases) do
      local line = debug.getinfo(c[1], "S").linedefined
      local ok, err = pcall(c[1])
      assert.is_false(ok)
      assert.matches(c[2], tostring(err), 1, true)
      -- the location is the recipe's call (not a tail call: its frame must be there), not moonbox's
      assert.matches("render_spec.lua:" .. line .. ":", tostring(err), 1, true)
    end
    assert.are.same({}, runs.requests(B, mark, "POST", "/v1/sandboxes"))
  end))

  it("keeps a sandbox past its scope after keep()", T.async(function()
    local id
    do
      local sb <close> = render.sandboxes.create { network = "deny-all", lifetime = 600 }
      sb:keep()
      id = sb.id
      assert.are.equal("deny-all", sb.network_policy.default)
    end
    assert.are.equal("running", render.sandboxes.get(id).status)
    render.sandboxes.terminate(id)
    assert.are.equal("terminated", render.sandboxes.get(id).status)
  end))

  it("reads the API's fields in snake_case only: a camelCase read raises at its line, naming the spelling",
    T.async(function()
      local object = require "moonbox.render.object"
      local sb <close> = render.sandboxes.create { network = "deny-all", lifetime = 600 }
      assert.are.same({ 600, "deny-all" }, { sb.timeout_seconds, sb.network_policy.default })
      assert.matches("^sbg%-", sb.sandbox_group_id)
      local names = {}
      for k, v in pairs(sb.network_policy) do names[#names + 1] = k .. "=" .. tostring(v) end
      assert.are.same({ "default=deny-all" }, names)
      local line = debug.getinfo(1, "l").currentline + 1
      local ok, err = pcall(function() local v = sb.sandboxGroupId; return v end)
      assert.is_false(ok)
      assert.matches("render_spec.lua:" .. line .. ": moonbox.render.Sandbox: fields are read in snake_case: " ..
        "`sandbox_group_id`, not `sandboxGroupId`", err, 1, true)
      ok, err = pcall(function() local v = sb.network_policy.allowedDomains; return v end)
      assert.is_false(ok)
      assert.matches("`allowed_domains`, not `allowedDomains`", err, 1, true)
      -- the API object itself keeps the wire's spelling
      assert.are.equal(sb.sandbox_group_id, object.fields(sb).sandboxGroupId)
      assert.are.equal("deny-all", object.fields(sb).networkPolicy.default)
    end))

  it("lists every sandbox through the pages", T.async(function()
    local a <close> = render.sandboxes.create { name = "listed-a" }
    local b <close> = render.sandboxes.create { name = "listed-b" }
    local seen = {}
    for sb in render.sandboxes.list {} do seen[sb.id] = true end
    assert.is_true(seen[a.id] and seen[b.id])
  end))

  it("raises typed errors carrying the sandbox id, never the API key", T.async(function()
    local ok, err = pcall(render.sandboxes.get, "sbx-0000000000000000000000000")
    assert.is_false(ok)
    assert.are.equal("not_found", err.code)
    assert.are.equal(404, err.status)
    assert.are.equal("sbx-0000000000000000000000000", err.sandbox_id)
    assert.matches("^req%-", err.request_id)
    assert.matches("sandbox sbx%-0+", tostring(err))
    assert.is_nil(tostring(err):find(B.key, 1, true))
    assert.is_nil((err.traceback or ""):find(B.key, 1, true))
  end))

  it("retries idempotent calls on 503 and 429, honouring Retry-After", T.async(function()
    local sb <close> = render.sandboxes.create {}
    B:faults("GET /v1/sandboxes/*=503#2;GET /v1/sandboxes/*=429:1#1")
    local mark = journal_mark()
    local t0 = task.now()
    local trace = require "moonbox.trace"
    local trace_file = os.tmpname()
    trace.start(trace_file)
    local ok_get, status = pcall(function() return render.sandboxes.get(sb.id).status end)
    trace.stop()
    -- The waits the client chose, from its "retry" trace instants: attempt -> seconds.
    local waits = {}
    for line in io.lines(trace_file) do
      local ev = line:match("^(%b{})")
      ev = ev and json.decode(ev)
      if ev and ev.name == "retry" then waits[ev.args.attempt] = ev.args.wait_s end
    end
    os.remove(trace_file)
    assert.is_true(ok_get, tostring(status))
    assert.are.equal("running", status)
    local times = {}
    for i, e in ipairs(runs.requests(B, mark, "GET", "/v1/sandboxes/" .. sb.id)) do times[i] = e.t end
    assert.are.equal(4, #times) -- two 503s, one 429, then the answer
    assert.is_true(task.now() - t0 >= 1, "Retry-After: 1 was not honoured")
    -- spacing: the backoff after the 429 is its Retry-After (1 s)
    assert.is_true(times[4] - times[3] >= 0.95, "the retry after the 429 came " .. (times[4] - times[3]) .. " s later")
    -- The 503 backoffs are jittered below their caps (0.2 s, then 0.4 s); the 429's is 1 s.
    local w1, w2 = waits[1] or -1, waits[2] or -1
    assert.is_true(w1 >= 0 and w1 <= 0.2, "backoff after the first 503: " .. tostring(waits[1]))
    assert.is_true(w2 >= 0 and w2 <= 0.4, "backoff after the second 503: " .. tostring(waits[2]))
    assert.are.equal(1, waits[3])
    B:req("DELETE", "/_moonbox/faults")
  end))

  it("never re-sends a create: a 503 is raised, a lost answer is unknown_outcome", T.async(function()
    B:faults("POST /v1/sandboxes=503#1")
    local mark = journal_mark()
    local ok, err = pcall(render.sandboxes.create, {})
    assert.is_false(ok)
    assert.are.equal("server_error", err.code)
    B:faults("POST /v1/sandboxes=drop#1")
    local ok2, err2 = pcall(render.sandboxes.create, { name = "maybe" })
    assert.is_false(ok2)
    -- directly the connection breaks; through an edge, the edge answers its own 502 (non-JSON)
    assert.are.equal("unknown_outcome", err2.code)
    if B.edge then assert.are.same({ "http_502", 502 }, { err2.cause, err2.status }) end
    assert.are.equal(2, #runs.requests(B, mark, "POST", "/v1/sandboxes"))
    B:req("DELETE", "/_moonbox/faults")
    for sb in render.sandboxes.list {} do if sb.name == "maybe" then sb:terminate() end end
  end))
end)

describe("sb:exec", function()
  local sb
  setup(run(function() sb = render.sandboxes.create {}:keep() end))
  teardown(run(function() sb:terminate() end))

  it("returns code, stdout, stderr and the exec id; check raises on non-zero", T.async(function()
    local r = sb:exec("echo out; echo err >&2; exit 3")
    assert.are.same({ 3, "out\n", "err\n", false }, { r.code, r.stdout, r.stderr, r.truncated })
    assert.matches("^exe%-", r.exec_id)
    local ok, err = pcall(r.check, r)
    assert.is_false(ok)
    assert.are.equal("exit_status", err.code)
    assert.matches("err", err.message)
    assert.are.equal(r, sb:exec("true"):check() and r)
  end))

  it("quotes argv elements so they arrive literally", T.async(function()
    local r = sb:exec({ "printf", "%s|", "a b", "$HOME", "it's", "*" }):check()
    assert.are.equal("a b|$HOME|it's|*|", r.stdout)
  end))

  it("runs in cwd when asked", T.async(function()
    assert.are.equal("/tmp\n", sb:exec("pwd", { cwd = "/tmp" }):check().stdout)
  end))

  it("truncates at max_output bytes without splitting a character", T.async(function()
    local r = sb:exec("printf 'ééééé'", { max_output = 5 })
    assert.is_true(r.truncated)
    assert.are.equal("éé", r.stdout) -- 4 bytes: the fifth would split a character
  end))

  it("streams output to on_output as it arrives", T.async(function()
    local got = {}
    sb:exec("echo one; echo two >&2", { on_output = function(s, d) got[#got + 1] = s .. ":" .. d end })
    table.sort(got)
    assert.are.same({ "stderr:two\n", "stdout:one\n" }, got)
  end))

  it("raises unknown_outcome when the stream ends without an exit event", T.async(function()
    B:faults("POST /proxy/*/runs/stream=cut#1")
    local ok, err = pcall(sb.exec, sb, "echo x")
    assert.is_false(ok)
    assert.are.equal("unknown_outcome", err.code)
    assert.matches("^exe%-", err.exec_id)
    B:req("DELETE", "/_moonbox/faults")
  end))

end)

describe("the embedded local backend", function()
  it("is started for a recipe when no backend is configured, and stopped with it", function()
    local home = os.tmpname()
    os.remove(home)
    local recipe = os.tmpname()
    local f = assert(io.open(recipe, "w"))
    f:write([[
local render = require "moonbox.render"
local sb <close> = render.sandboxes.create {}
io.write(sb:exec({ "echo", "embedded ok" }):check().stdout)
]])
    f:close()
    local out = os.tmpname()
    local cmd = string.format("env -u RENDER_API_KEY -u RENDER_LOCAL_DEV_URL -u RENDER_USE_LOCAL_DEV HOME=%s " ..
      "XDG_STATE_HOME= MOONBOX_IMAGES=%s %s run %s > %s 2>&1", home, require("spec.support.runs").images(), L.BIN,
      recipe, out)
    local ok = os.execute(cmd)
    local text = assert(io.open(out)):read("a")
    assert.is_true(ok, text)
    assert.matches("embedded ok", text)
    assert.matches("started an embedded local backend at http://127%.0%.0%.1:%d+", text)
    local left = io.popen("pgrep -f '[m]oonbox local --embedded --quiet --port 0 --state " .. home ..
      "' || true"):read("a")
    assert.are.equal("", left)
    os.execute("rm -rf --one-file-system " .. home .. " " .. recipe .. " " .. out)
  end)
end)

describe("a running moonbox local in the default state dir", function()
  it("is reused by a recipe instead of starting another", T.async(function()
    local proc = require "moonbox.proc"
    local home = proc.run({ "mktemp", "-d" }).stdout:gsub("%s+$", "")
    local state = home .. "/.local/state/moonbox/local"
    local p = proc.spawn { L.BIN, "local", "--quiet", "--port", "0", "--state", state, stderr = "inherit" }
    local lines = p:lines("stdout")
    local url
    for _ = 1, 3 do
      local line = lines()
      url = url or line:match("^RENDER_LOCAL_DEV_URL=(.*)$")
    end
    local recipe = home .. "/r.lua"
    local f = assert(io.open(recipe, "w"))
    f:write('local render = require "moonbox.render"\nio.write(render.connection().base, "\\n")\n')
    f:close()
    local r = proc.run { "env", "-u", "RENDER_API_KEY", "-u", "RENDER_LOCAL_DEV_URL", "HOME=" .. home,
      "XDG_STATE_HOME=", "MOONBOX_IMAGES=" .. require("spec.support.runs").images(), L.BIN, "run", recipe }
    assert.are.equal(0, r.code, r.stderr)
    assert.are.equal(url .. "/v1\n", r.stdout)
    -- reused, and said so in one line: nothing was started
    assert.are.equal("moonbox: using the moonbox local already serving at " .. url .. " (state in " .. state ..
      ")\n", r.stderr)
    p:kill("TERM")
    p:wait()
    L.remove_tree(home)
  end))
end)

describe("moonbox run --backend", function()
  it("points moonbox.render at the given backend", function()
    local recipe = os.tmpname()
    local f = assert(io.open(recipe, "w"))
    f:write([[
local render = require "moonbox.render"
local c = render.connection()
io.write(c.base, " ", c.kind, "\n")
]])
    f:close()
    local out = os.tmpname()
    local cmd = string.format("RENDER_API_KEY=%s RENDER_WORKSPACE_ID=%s %s run --backend %s %s > %s 2>&1",
      B.key, B.workspace, L.BIN, B.url, recipe, out)
    local ok = os.execute(cmd)
    local text = assert(io.open(out)):read("a")
    assert.is_true(ok, text)
    assert.are.equal(B.url .. "/v1 local\n", text)
    local bad = os.execute(L.BIN .. " run --backend nowhere " .. recipe .. " > /dev/null 2>&1")
    assert.is_falsy(bad)
    os.remove(recipe)
    os.remove(out)
  end)
end)

describe("wait_running", function()
  it("raises sandbox_not_running when the sandbox is terminated while waited for", T.async(function()
    local sb = render.sandboxes.create { wait = false }
    render.sandboxes.terminate(sb.id)
    local ok, err = pcall(sb.wait_running, sb, { timeout = 10 })
    assert.is_false(ok)
    assert.are.equal("sandbox_not_running", err.code)
    assert.are.equal(sb.id, err.sandbox_id)
  end))
end)

describe("snapshot errors through the client", function()
  it("raises snapshot_failed when the capture fails", T.async(function()
    local sb <close> = render.sandboxes.create {}
    B:faults("POST /v1/sandboxes/*/snapshots=capture#1")
    local ok, err = pcall(sb.snapshot, sb, { name = "doomed" })
    B:faults("")
    assert.is_false(ok)
    assert.are.equal("snapshot_failed", err.code)
    assert.matches("disk full", err.message)
    assert.is_string(err.snapshot_id)
    B:req("DELETE", "/_moonbox/faults")
  end))

  it("raises snapshot_creating when deleting a snapshot still being captured", T.async(function()
    local sb <close> = render.sandboxes.create {}
    sb:exec("head -c 300000000 /dev/zero > /root/big"):check()
    local snap = sb:snapshot { wait = false }
    local ok, err = pcall(render.snapshots.delete, snap)
    -- A 300 MB capture takes far longer than one request, so the delete meets it running; if
    -- the machine were fast enough to finish first, the delete simply succeeds.
    if not ok then
      assert.are.equal("snapshot_creating", err.code)
      assert.are.equal(409, err.status)
      assert.are.equal(snap.id, err.snapshot_id)
      snap:wait_available()
      snap:delete()
    end
  end))
end)

describe("an edge block", function()
  it("is reported as edge_blocked, not as bad credentials", T.async(function()
    local sb <close> = render.sandboxes.create {}
    B:faults("POST /v1/sandboxes/*/runs/stream/token=edge#1")
    local ok, err = pcall(sb.exec, sb, "curl example; echo")
    B:faults("")
    assert.is_false(ok)
    assert.are.equal("edge_blocked", err.code)
    assert.are.equal(403, err.status)
    assert.matches("not an API key problem", err.message)
    assert.is_nil(err.request_id)
    B:req("DELETE", "/_moonbox/faults")
  end))
end)
