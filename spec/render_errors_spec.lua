-- Every documented error code is the one raised. The spec reads the code tables of the manual —
-- docs/reference/render.md "Error codes" (code, op), errors.md's "Codes raised by the runtime
-- core" (code, op) and http.md's "Errors" (code; op http.request) — and, for each (code, op)
-- written there, provokes it against a real `moonbox local` (its fault injection for the error
-- paths) and asserts the structured error's code and op are exactly the documented ones. A code
-- written down is a code this spec must provoke (PROVOKE below, or NOT_PROVOKED with the reason
-- no loopback backend can make it), and the other way round: every `code = "..."` in
-- lua/moonbox/render/ is documented, and every code in a "raises" column of render.md is a row
-- of its code table.
local T = require "moonbox.testing"
local render = require "moonbox.render"
local http = require "moonbox.http"
local task = require "moonbox.task"
local json = require "moonbox.json"
local sys = require "moonbox.sys"
local proc = require "moonbox.proc"
local markdown = require "spec.support.markdown"
local files = require "spec.support.files"
local L = require "spec.support.local_backend"

-- ---- the manual's tables ----------------------------------------------------------------------

-- Every table of a markdown file (spec/support/markdown.lua).
local function tables(path) return markdown.tables(files.must_read(path)) end

-- The code a cell names when it is exactly one backticked code (`snapshot_not_found`), else nil.
local function one_code(cell)
  return cell:match("^`([a-z][a-z0-9_]*)`$")
end

-- The codes a "raises" cell names: its backticked snake_case words, except those another
-- module's errors stand for ("archive.unpack's (`unsafe_archive`, ...)": that module's manual
-- documents them).
local function raised_codes(cell)
  local out = {}
  local own = cell:gsub("[%w_]+%.[%w_]+'s.*$", "")
  for c in own:gmatch("`([a-z][a-z0-9_]*)`") do out[#out + 1] = c end
  return out
end

-- The documented (code, op) pairs, as "code op" → "file:line" of the row.
local DOCUMENTED = {}
local RENDER_CODES = {} -- code → true: render.md's code table
local RAISES = {} -- "render.md: code" → true: the codes of render.md's "raises" columns

local function document(file, op_of)
  for _, t in ipairs(tables(file)) do
    if t.header[1] == "code" then
      local op_col
      for j, h in ipairs(t.header) do if h == "op" then op_col = j end end
      for _, row in ipairs(t.rows) do
        local code = one_code(row[1])
        local op = op_col and row[op_col] and row[op_col]:match("^`([^`]+)`$") or op_of
        if code and op then
          DOCUMENTED[code .. " " .. op] = file .. ":" .. t.line
          if file:find("render.md", 1, true) then RENDER_CODES[code] = true end
        end
      end
    end
    if file:find("render.md", 1, true) then
      for j, h in ipairs(t.header) do
        if h:match("^raises") then
          for _, row in ipairs(t.rows) do
            for _, c in ipairs(raised_codes(row[j] or "")) do RAISES[c] = true end
          end
        end
      end
    end
  end
end

document("docs/reference/render.md")
document("docs/reference/errors.md")
document("docs/reference/http.md", "http.request")

-- Documented codes no loopback backend can make, each with the reason. Kept as short as it can
-- be: every other documented code has a provoking function below.
local NOT_PROVOKED = {
  ["exec_error sandbox:exec"] = "an exec stream's error event: Render's; moonbox local never sends one",
  ["unsupported_encoding sb:copy_out"] = "moonbox local always sends a directory as gzip",
  ["transport_error http.request"] = "libcurl's catch-all: no failure over loopback maps to it",
}

-- ---- the backend ------------------------------------------------------------------------------

local B, SB, SNAP, WORK

L.fixture(setup, teardown, function(b)
  B = b
  SB = render.sandboxes.create {}
  SB:write("/tmp/a-file", "x")
  SB:mkdir("/tmp/full")
  SB:write("/tmp/full/f", "f")
  SNAP = SB:snapshot { name = "errors-base" }
  WORK = proc.run({ "mktemp", "-d", "/tmp/moonbox-errors-spec.XXXXXX" }).stdout:gsub("%s+$", "")
  return function()
    SB:terminate()
    proc.run { "rm", "-rf", WORK }
  end
end)

-- fn() under the injected faults spec (cleared afterwards, whatever happened); returns the error
-- fn raised (asserting it raised one).
local function faulted(spec, fn)
  B:faults(spec)
  local ok, err = pcall(fn)
  B:faults("")
  assert(not ok, "expected an error under faults " .. spec .. ", but the call succeeded")
  return err
end

-- The error fn() raised (asserting it raised one).
local function raised(fn, ...)
  local ok, err = pcall(fn, ...)
  assert(not ok, "expected an error, but the call succeeded")
  return err
end

-- http.request's options for a GET of path on the backend with the API key.
local function api_get(path, extra)
  local o = { url = B.url .. path, headers = { Authorization = "Bearer " .. B.key }, timeout = 10 }
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

local function owner_query() return "?ownerId=" .. B.workspace end

-- An id of the given prefix that names nothing.
local function unknown_id(prefix)
  return prefix .. "-" .. string.rep("0", prefix == "snp" and 20 or 25)
end

-- ---- code → a function provoking it ------------------------------------------------------------

local PROVOKE = {}

-- moonbox.render: answers mapped to codes (api.status_error)

PROVOKE["unauthorized sandboxes.list"] = function()
  render.connect { backend = B.url, api_key = "not-the-key", workspace = B.workspace }
  local err = raised(function() for _ in render.sandboxes.list {} do end end)
  B:connect_render()
  return err
end

PROVOKE["not_found sandboxes.get"] = function()
  return raised(render.sandboxes.get, unknown_id("sbx"))
end

PROVOKE["conflict groups.delete"] = function()
  return raised(render.groups.delete, render.groups.default())
end

PROVOKE["rate_limited sandboxes.get"] = function()
  return faulted("GET /v1/sandboxes/*=429:0", function() render.sandboxes.get(SB.id) end)
end

PROVOKE["server_error groups.create"] = function()
  return faulted("POST /v1/sandbox-groups=500", function() render.groups.create { name = "five-hundred" } end)
end

PROVOKE["http_400 groups.list"] = function()
  return faulted("GET /v1/sandbox-groups=400", function() render.groups.list()() end)
end

PROVOKE["edge_blocked sandboxes.create"] = function()
  return faulted("POST /v1/sandboxes=edge", function() render.sandboxes.create {} end)
end

PROVOKE["unknown_outcome groups.create"] = function()
  return faulted("POST /v1/sandbox-groups=drop", function() render.groups.create { name = "answer-lost" } end)
end

PROVOKE["malformed_response sandboxes.get"] = function()
  return faulted("GET /v1/sandboxes/*=garbage", function() render.sandboxes.get(SB.id) end)
end

-- moonbox.render: Render's own codes, as moonbox local sends them

PROVOKE["invalid_sandbox_group_id sandboxes.create"] = function()
  return raised(render.sandboxes.create, { group = "not-a-group" })
end

PROVOKE["sandbox_not_running sandbox:snapshot"] = function()
  local sb <close> = render.sandboxes.create {}
  sb:suspend()
  return raised(sb.snapshot, sb, {})
end

PROVOKE["timeout sandbox:exec"] = function()
  return raised(SB.exec, SB, "sleep 30", { timeout = 1 })
end

PROVOKE["exit_status sandbox:exec"] = function()
  return raised(function() SB:exec("exit 3"):check() end)
end

PROVOKE["invalid_snapshot_name sandbox:snapshot"] = function()
  return raised(SB.snapshot, SB, { name = "snp-not-a-name" })
end

PROVOKE["invalid_snapshot_id snapshots.get"] = function()
  return raised(render.snapshots.get, "not-a-snapshot-id")
end

PROVOKE["snapshot_not_found snapshots.get"] = function()
  return raised(render.snapshots.get, unknown_id("snp"))
end

PROVOKE["snapshot_creating snapshots.delete"] = function()
  local sb <close> = render.sandboxes.create {}
  -- 128 MiB of incompressible data: the capture takes far longer than one API round trip.
  sb:exec("head -c 134217728 /dev/urandom > /root/big"):check()
  local snap = sb:snapshot { wait = false }
  local err = raised(render.snapshots.delete, snap)
  snap:wait_available { timeout = 120 }
  snap:delete()
  return err
end

PROVOKE["snapshot_failed snapshots.wait_available"] = function()
  B:faults('[{"match":"POST /v1/sandboxes/*/snapshots","fault":"capture","count":1}]')
  local ok, snap = pcall(SB.snapshot, SB, { wait = false })
  B:faults("")
  assert(ok, tostring(snap))
  return raised(snap.wait_available, snap, { timeout = 30 })
end

PROVOKE["snapshot_not_available sandboxes.create"] = function()
  local other = render.groups.create { name = "elsewhere" }
  local snap
  do
    local sb <close> = render.sandboxes.create { group = other.id }
    snap = sb:snapshot { name = "in-other" }
  end
  return raised(render.sandboxes.create, { snapshot = snap.id })
end

PROVOKE["snapshot_plan_mismatch sandboxes.create"] = function()
  local snap = SB:snapshot { kind = "runtime" }
  return raised(render.sandboxes.create, { snapshot = snap, plan = SB.plan == "2c-4g" and "1c-2g" or "2c-4g" })
end

PROVOKE["invalid_status snapshots.list"] = function()
  return raised(function() render.snapshots.list { status = "bogus" }() end)
end

-- moonbox.render: the client's own

PROVOKE["restore_failed render.restore"] = function()
  return faulted("POST /v1/sandboxes=400#1", function() render.restore(SNAP, { count = 2 }) end)
end

PROVOKE["cleanup_failed sandbox:close"] = function()
  local id
  local err = faulted("POST /v1/sandboxes/*/terminate=400", function()
    local sb <close> = render.sandboxes.create {}
    id = sb.id
  end)
  render.sandboxes.terminate(id)
  return err
end

PROVOKE["budget_exceeded render.budget"] = function()
  local t = task.spawn(function()
    render.budget { sandboxes = 1 }
    local _first <close> = render.sandboxes.create {}
    local _second <close> = render.sandboxes.create {}
  end)
  return raised(task.join, t)
end

PROVOKE["rebuild_failed snapshots.rebuild"] = function()
  return raised(render.snapshots.rebuild, "verify-fails", function(sb) sb:exec("true"):check() end,
    { verify = "false" })
end

PROVOKE["verify_failed snapshots.rebuild"] = function()
  local err = raised(render.snapshots.rebuild, "verify-returns-false", function(sb) sb:exec("true"):check() end,
    { verify = function() return false end })
  assert.are.equal("rebuild_failed", err.code)
  return err.cause
end

PROVOKE["backend_busy render.connect"] = function()
  local dir = WORK .. "/busy"
  sys.mkdir_p(dir, tonumber("700", 8))
  local _lock <close> = assert(sys.try_lock(dir .. "/embedded.users", "exclusive"))
  local err = raised(render.connect, { backend = "local", state_dir = dir })
  B:connect_render()
  return err
end

PROVOKE["backend_failed render.connect"] = function()
  -- A state directory whose backend lock this process holds: the `moonbox local` the connect
  -- starts there refuses to serve it and exits.
  local dir = WORK .. "/failed"
  sys.mkdir_p(dir, tonumber("700", 8))
  local _lock <close> = assert(sys.try_lock(dir .. "/backend.lock", "exclusive"))
  local err = raised(render.connect, { backend = "local", state_dir = dir })
  B:connect_render()
  return err
end

PROVOKE["simulated_time_limit render.dry_run"] = function()
  local recipe = WORK .. "/limit.lua"
  local f = assert(io.open(recipe, "w"))
  f:write([[
local render = require "moonbox.render"
render.dry_run.limit(10)
local sb <close> = render.sandboxes.create {}
sb:exec("sleep 100")
]])
  f:close()
  local r = proc.run { L.BIN, "run", "--dry-run", "--json", recipe, stderr = "pipe" }
  local summary = json.decode(r.stdout:match("([^\n]+)\n?$"))
  return summary.errors[1]
end

PROVOKE["invalid_path render.normalize_path"] = function()
  return raised(render.normalize_path, "")
end

PROVOKE["not_found sb:read"] = function()
  return raised(SB.read, SB, "/no/such/file")
end

PROVOKE["is_a_directory sb:read"] = function()
  return raised(SB.read, SB, "/tmp")
end

PROVOKE["not_a_directory sb:ls"] = function()
  return raised(SB.ls, SB, "/tmp/a-file")
end

PROVOKE["exists sb:mkdir"] = function()
  return raised(SB.mkdir, SB, "/tmp/a-file")
end

PROVOKE["not_empty sb:remove"] = function()
  return raised(SB.remove, SB, "/tmp/full")
end

PROVOKE["permission_denied sb:write"] = function()
  return raised(SB.write, SB, "/proc/x", "y")
end

PROVOKE["exec_failed sb:rename"] = function()
  return raised(SB.rename, SB, "/tmp/full", "/tmp/full/inside")
end

PROVOKE["sandbox_gone sb:read"] = function()
  local gone = render.sandboxes.create {}
  gone:terminate()
  return raised(gone.read, gone, "/tmp/a-file")
end

PROVOKE["local_not_found sb:copy_in"] = function()
  return raised(SB.copy_in, SB, "/tmp/never", WORK .. "/no-such-local-file")
end

PROVOKE["target_exists sb:copy_out"] = function()
  return raised(SB.copy_out, SB, "/tmp", WORK)
end

PROVOKE["io_error sb:copy_out"] = function()
  -- WORK is a directory that is not empty: the finished download cannot be renamed onto it.
  return raised(SB.copy_out, SB, "/tmp/a-file", WORK)
end

-- the runtime core (errors.md)

PROVOKE["invalid_option task.map"] = function()
  return raised(task.map, { 1 }, function(x) return x end, { concurency = 2 })
end

PROVOKE["invalid_argument task.sleep"] = function()
  return raised(task.sleep, "soon")
end

PROVOKE["cancelled task"] = function()
  local t = task.spawn(function() task.sleep(30) end)
  task.sleep(0)
  task.cancel(t)
  return raised(task.join, t)
end

PROVOKE["deadline task.timeout"] = function()
  local seen
  pcall(task.timeout, 0.05, function()
    local _, e = pcall(task.sleep, 5)
    seen = e
  end)
  return seen
end

PROVOKE["timeout task.timeout"] = function()
  return raised(task.timeout, 0.05, function() task.sleep(5) end)
end

-- moonbox.http (http.md), against the same backend

PROVOKE["connect_failed http.request"] = function()
  return raised(http.request, { url = "http://127.0.0.1:1/", timeout = 5 })
end

PROVOKE["dns_failed http.request"] = function()
  -- An empty label: the resolver refuses the name without sending a query anywhere.
  return raised(http.request, { url = "http://a..b/", timeout = 5 })
end

PROVOKE["timeout http.request"] = function()
  return faulted("GET /v1/sandbox-groups=latency:3000", function()
    http.request(api_get("/v1/sandbox-groups" .. owner_query(), { timeout = 0.3 }))
  end)
end

PROVOKE["connection_reset http.request"] = function()
  return faulted("GET /v1/sandbox-groups=drop", function()
    http.request(api_get("/v1/sandbox-groups" .. owner_query()))
  end)
end

PROVOKE["malformed_response http.request"] = function()
  return faulted("GET /v1/sandbox-groups=garbage", function()
    http.request(api_get("/v1/sandbox-groups" .. owner_query(), { accept_encoding = "gzip" }))
  end)
end

PROVOKE["tls_failed http.request"] = function()
  return raised(http.request, { url = B.direct_url:gsub("^http:", "https:") .. "/_moonbox/health", timeout = 5 })
end

PROVOKE["body_too_large http.request"] = function()
  return raised(http.request, api_get("/v1/sandbox-groups" .. owner_query(), { max_body = 1 }))
end

PROVOKE["file_error http.request"] = function()
  return raised(http.request, api_get("/v1/sandbox-groups" .. owner_query(), { output_file = "/dev/full" }))
end

PROVOKE["request_failed http.request"] = function()
  return raised(http.request, api_get("/v1/sandbox-groups" .. owner_query(),
    { method = "PUT", body_file = WORK .. "/no-such-body" }))
end

PROVOKE["bad_url http.request"] = function()
  return raised(http.request, { url = "http://[::1/", timeout = 5 })
end

-- ---- the specs --------------------------------------------------------------------------------

local function sorted_keys(t)
  local out = {}
  for k in pairs(t) do out[#out + 1] = k end
  table.sort(out)
  return out
end

describe("the manual's error codes", function()
  it("are read from the code tables (the parser finds them)", function()
    assert.is_truthy(DOCUMENTED["snapshot_not_found snapshots.get"])
    assert.is_truthy(DOCUMENTED["cancelled task"])
    assert.is_truthy(DOCUMENTED["connect_failed http.request"])
  end)

  it("are exactly the codes this spec provokes, both ways", function()
    local undocumented, unprovoked = {}, {}
    for key in pairs(PROVOKE) do
      if not DOCUMENTED[key] then undocumented[#undocumented + 1] = key end
    end
    for key in pairs(NOT_PROVOKED) do
      if not DOCUMENTED[key] then undocumented[#undocumented + 1] = key .. " (NOT_PROVOKED)" end
      assert.is_nil(PROVOKE[key], key .. " is both provoked and listed as not provokable")
    end
    for key in pairs(DOCUMENTED) do
      if not PROVOKE[key] and not NOT_PROVOKED[key] then unprovoked[#unprovoked + 1] = key end
    end
    table.sort(undocumented)
    table.sort(unprovoked)
    assert.are.same({}, undocumented, "provoked here but not in the manual's code tables")
    assert.are.same({}, unprovoked, "documented but provoked nowhere")
  end)

  it("include every code a \"raises\" column of render.md names", function()
    local missing = {}
    for _, code in ipairs(sorted_keys(RAISES)) do
      if not RENDER_CODES[code] then missing[#missing + 1] = code end
    end
    assert.are.same({}, missing)
  end)

  it("include every code lua/moonbox/render/ raises", function()
    local missing = {}
    for _, name in ipairs(files.listdir("lua/moonbox/render")) do
      if name:match("%.lua$") then
        local text = files.must_read("lua/moonbox/render/" .. name)
        -- `code = "x"`, and every literal of `code = cond and "x" or "y"` (not a type test's, nor
        -- a local variable's: api.span's trace label)
        text = text:gsub("local code = [^\n]*", ""):gsub("type%b() == \"%a+\"", "")
        for expr in text:gmatch("code = ([^,\n}]+)") do
          for code in expr:gmatch("\"([a-z_0-9]+)\"") do
            local known = RENDER_CODES[code] or (code == "http_" and RENDER_CODES.http_400)
            for key in pairs(DOCUMENTED) do
              if key:match("^(%S+)") == code then known = true end
            end
            if not known then missing[#missing + 1] = name .. ": " .. code end
          end
        end
      end
    end
    table.sort(missing)
    assert.are.same({}, missing)
  end)
end)

describe("each documented code", function()
  for _, key in ipairs(sorted_keys(DOCUMENTED)) do
    local code, op = key:match("^(%S+) (%S+)$")
    if not NOT_PROVOKED[key] then
      it("is raised as " .. code .. " with op " .. op .. " (" .. DOCUMENTED[key] .. ")", T.async(function()
        local provoke = PROVOKE[key]
        assert(provoke, "no function provokes " .. key .. ": add one to PROVOKE")
        local err = provoke()
        assert.are.equal("table", type(err), "a plain error, not a structured one: " .. tostring(err))
        assert.are.same({ code, op }, { err.code, err.op }, tostring(err.message or err))
      end))
    end
  end
end)

describe("sb:write onto a directory", function()
  it("raises is_a_directory, as the files table says", T.async(function()
    local err = raised(SB.write, SB, "/tmp", "x")
    assert.are.equal("is_a_directory", err.code, tostring(err))
  end))
end)
