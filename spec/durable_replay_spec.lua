-- Recordings and replays (issue 25, item 4): every recipe in recipes/ is recorded against a real
-- `moonbox local` (`moonbox run --record CASSETTE RECIPE`), then replayed with no backend at all
-- (`moonbox run --replay CASSETTE`) in a network namespace with no interface up, as an
-- unprivileged user with no capabilities and no state dir, and must print what the recording
-- printed. A cassette holds no secret: each is searched for the backend's API key, every env
-- value the recording sent and every connect token the backend minted for it — all three read
-- from what went over the wire, through a pass-through proxy of the spec's own between the
-- recording and the backend (the backend hands out connect URIs on the proxy: --public-url).
-- A replay that diverges fails with nondeterminism naming both calls; a file that is not a
-- cassette is refused naming the file and line. The busted helper (moonbox.testing's T.replay)
-- replays the cassettes committed under spec/cassettes/.
--
-- MOONBOX_SPEC_RECORD_CASSETTES=1 writes the recordings this spec makes of recipes/ to
-- spec/cassettes/ (NAME.cassette and NAME.stdout): how the committed ones are re-recorded after
-- a recipe changed.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local json = require "moonbox.json"
local http = require "moonbox.http"
local httpd = require "moonbox.httpd"
local sys = require "moonbox.sys"
local L = require "spec.support.local_backend"
local runs = require "spec.support.runs"

-- The uid the replays run as: nobody, who owns nothing here.
local NOBODY = "65534"

local B, proxy, work
local wire -- what the proxy saw of the current recording: keys, env values, tokens minted

local function reset_wire()
  wire = { bearers = {}, env = {}, minted = {}, env_tokens = {} }
end
reset_wire()

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

-- The values of an env file (moonbox.render.exec: one `export NAME='value'` per line).
local function env_file_values(text, into)
  for value in text:gmatch("export [%w_]+='(.-)'\n") do into[#into + 1] = (value:gsub("'\\''", "'")) end
end

-- What the proxy learns of one request and its answer.
local function observe(req, status, body)
  local bearer = (req.headers.authorization or ""):match("^Bearer (.+)$")
  if bearer then wire.bearers[bearer] = true end
  if req.method == "PUT" and bearer and wire.env_tokens[bearer] then env_file_values(req.body, wire.env) end
  if req.method == "POST" and req.path == "/v1/sandboxes" then
    local ok, b = pcall(json.decode, req.body)
    if ok and type(b) == "table" and type(b.env) == "table" then
      for _, v in pairs(b.env) do wire.env[#wire.env + 1] = tostring(v) end
    end
  end
  if req.path:match("/token$") and status == 201 then
    local tok = json.decode(body)
    wire.minted[#wire.minted + 1] = tok.token
    local path = req:query_param("path")
    if path and path:match("%.env$") then wire.env_tokens[tok.token] = true end
  end
end

local HOP = { host = true, ["content-length"] = true, connection = true, ["transfer-encoding"] = true,
  ["accept-encoding"] = true, expect = true, ["keep-alive"] = true }

-- The pass-through proxy: every request (control plane and data plane) goes to the backend as
-- it came, and its answer back as it came, streams included; observe() reads both.
local function start_proxy()
  local srv = httpd.listen { host = "127.0.0.1", port = 0, max_body = 64 * 1024 * 1024 }
  srv:route("*", "/*", function(req, res)
    local headers = {}
    for k, v in pairs(req.headers) do if not HOP[k] then headers[k] = v end end
    local resp <close> = http.stream { method = req.method, url = B.direct_url .. req.target, headers = headers,
      body = req.body ~= "" and req.body or nil, timeout = 300 }
    local out = {}
    for k, v in pairs(resp.headers) do
      if not HOP[k] and k ~= "content-encoding" then out[k] = v end
    end
    if (resp.headers["content-type"] or ""):find("event-stream", 1, true) then
      observe(req, resp.status, "")
      local w = res:stream(resp.status, out)
      while true do
        local chunk = resp:read()
        if not chunk then break end
        w:write(chunk)
      end
      return
    end
    local parts = {}
    while true do
      local chunk = resp:read()
      if not chunk then break end
      parts[#parts + 1] = chunk
    end
    local body = table.concat(parts)
    observe(req, resp.status, body)
    res:send(resp.status, body, out)
  end, { body = "memory", max_body = 64 * 1024 * 1024 })
  return srv
end

setup(T.async(function()
  work = proc.run({ "mktemp", "-d", "/tmp/moonbox-replay-spec.XXXXXX" }).stdout:gsub("%s+$", "")
  assert(proc.run({ "chmod", "755", work }).code == 0)
  proxy = start_proxy()
  B = L.start { args = { "--public-url", proxy.url }, edge = false }
end))

teardown(T.async(function()
  if proxy then proxy:close() end
  if B then B:destroy() end
  if work then L.remove_tree(work) end
end))

-- `moonbox run ARGS...` as a user whose backend is the proxy in front of B, from the project's
-- root (recipes are named as recipes/NAME.lua, as a user names them). -> {code, stdout, stderr}
local function moonbox(...)
  local argv = { L.BIN, ... }
  argv.env = { RENDER_LOCAL_DEV_URL = proxy.url, RENDER_API_KEY = B.key, RENDER_WORKSPACE_ID = B.workspace,
    RENDER_USE_LOCAL_DEV = false, HOME = work, XDG_STATE_HOME = work .. "/recorder-state",
    MOONBOX_DATABASE_URL = false }
  argv.timeout = 300
  return proc.run(argv)
end

-- Runs `moonbox run --replay CASSETTE [RECIPE]` with no backend: in a new network namespace
-- (only lo, and lo down), as nobody with no capabilities (setpriv, no_new_privs), with an
-- environment of nothing but PATH, HOME and XDG_STATE_HOME, both under an empty directory
-- nobody cannot write. First, in the same process, it probes what it can reach: its uid, its
-- effective capabilities, its network interfaces, and whether a TCP connection to the backend's
-- port gets through (lines "probe: ..." on stderr). -> {code, stdout, stderr, probe, empty}
-- where empty is the directory, to check nothing was created in it.
local function replay_isolated(cassette, recipe)
  local empty = proc.run({ "mktemp", "-d", work .. "/empty.XXXXXX" }).stdout:gsub("%s+$", "")
  assert(proc.run({ "chmod", "755", empty }).code == 0)
  local port = assert(B.direct_url:match(":(%d+)$"))
  local probe = [[
echo "probe: uid $(id -u)" >&2
grep '^CapEff:' /proc/self/status | sed 's/^/probe: /' >&2
tail -n +3 /proc/self/net/dev | sed 's/^ *\([^:]*\):.*/probe: interface \1/' >&2
if (exec 3<>"/dev/tcp/127.0.0.1/$PROBE_PORT") 2>/dev/null; then echo "probe: backend reached" >&2
else echo "probe: backend unreachable" >&2; fi
exec "$@"]]
  local argv = { "unshare", "--net", "--", "setpriv", "--reuid=" .. NOBODY, "--regid=" .. NOBODY, "--clear-groups",
    "--no-new-privs", "--", "env", "-i", "PATH=/usr/bin:/bin", "HOME=" .. empty .. "/home",
    "XDG_STATE_HOME=" .. empty .. "/state", "PROBE_PORT=" .. port, "bash", "-c", probe, "bash",
    L.BIN, "run", "--replay", cassette }
  if recipe then argv[#argv + 1] = recipe end
  argv.timeout = 300
  local r = proc.run(argv)
  r.probe = {}
  for line in r.stderr:gmatch("probe: ([^\n]*)") do r.probe[#r.probe + 1] = line end
  r.empty = empty
  return r
end

-- Asserts that the replay r ran as it must: as nobody, no capability, lo its only interface and
-- the backend out of reach, and left its empty directory empty (no state dir, no home).
local function assert_isolated(r, what)
  local p = table.concat(r.probe, "\n")
  assert.are.equal("uid " .. NOBODY, r.probe[1], what .. ": " .. p)
  assert.are.equal("CapEff:\t0000000000000000", r.probe[2], what .. ": " .. p)
  assert.are.equal("interface lo", r.probe[3], what .. ": " .. p)
  assert.are.equal("backend unreachable", r.probe[4], what .. ": " .. p)
  assert.are.equal(4, #r.probe, what .. ": " .. p)
  assert.are.same({}, sys.listdir(r.empty), what .. ": the replay created something in its empty dir")
  assert.is_nil(r.stderr:find("embedded local backend", 1, true), what .. ": " .. r.stderr)
end

-- The recipes in recipes/, as a user names them (recipes/NAME.lua), sorted.
local function recipes()
  local out = {}
  for _, name in ipairs(sys.listdir("recipes")) do
    if name:match("%.lua$") then out[#out + 1] = "recipes/" .. name end
  end
  table.sort(out)
  return out
end

-- The secrets of one recording, named for messages: the API key, its env values, its tokens.
local function secrets_of(w)
  local out = { { "the API key", B.key } }
  for i, v in ipairs(w.env) do
    -- shorter values are not treated as secrets anywhere (trace.secret: they would redact text)
    if #v >= 4 then out[#out + 1] = { "env value " .. i .. " it sent", v } end
  end
  for i, t in ipairs(w.minted) do out[#out + 1] = { "connect token " .. i .. " minted", t } end
  for t in pairs(w.bearers) do out[#out + 1] = { "a bearer credential it sent", t } end
  return out
end

local HEADER_KEYS = { args = true, moonbox = true, moonbox_cassette = true, recipe = true, recorded_at = true,
  workspace = true }

-- Asserts that no secret is in the cassette's text: its header (whose keys are the format's
-- own words: checked to be those, then its values searched) and every line after it.
local function assert_no_secret(text, secrets, what)
  local header, rest = text:match("^([^\n]*)\n(.*)$")
  local h = json.decode(header)
  for k, v in pairs(h) do
    assert.is_true(HEADER_KEYS[k], what .. ": unknown header key " .. k)
    local shown = type(v) == "table" and json.encode(v) or tostring(v)
    for _, s in ipairs(secrets) do
      assert.is_nil(shown:find(s[2], 1, true), what .. ": the header's " .. k .. " holds " .. s[1])
    end
  end
  for _, s in ipairs(secrets) do
    local at = rest:find(s[2], 1, true)
    -- where it is, with the secret itself left out of the message
    local context = at and (rest:sub(math.max(1, at - 80), at - 1) .. "<" .. s[1] .. ">" ..
      rest:sub(at + #s[2], at + #s[2] + 40)) or ""
    assert.is_nil(at, what .. " holds " .. s[1] .. ": ..." .. context)
  end
end

local recorded = {} -- recipe path -> {cassette, stdout, secrets}
local totals = { env = 0, minted = 0 }

describe("every recipe in recipes/", function()
  it("is recorded against moonbox local, and replays with no backend printing the same stdout", T.async(function()
    local list = recipes()
    assert.is_true(#list >= 3, "recipes/ holds " .. #list .. " recipes")
    for _, recipe in ipairs(list) do
      local name = recipe:match("([^/]+)%.lua$")
      local cassette = work .. "/" .. name .. ".cassette"
      reset_wire()
      local mark = runs.last_seq(B)
      local rec = moonbox("run", "--record", cassette, recipe)
      assert.are.equal(0, rec.code, recipe .. " (recording): " .. rec.stderr)
      assert.is_true(#rec.stdout > 0, recipe .. " printed nothing")
      runs.settled(B, mark)
      assert.are.same({}, runs.live(B), recipe .. ": the recording left sandboxes running")
      assert(proc.run({ "chmod", "644", cassette }).code == 0)
      recorded[recipe] = { cassette = cassette, stdout = rec.stdout, secrets = secrets_of(wire) }
      totals.env, totals.minted = totals.env + #wire.env, totals.minted + #wire.minted
      io.stderr:write(string.format("spec: %s recorded: %d lines of stdout, %d cassette bytes, %d tokens minted, " ..
        "%d env values sent\n", recipe, select(2, rec.stdout:gsub("\n", "")), #read(cassette), #wire.minted, #wire.env))

      local rep = replay_isolated(cassette)
      assert.are.equal(0, rep.code, recipe .. " (replay): " .. rep.stderr)
      assert_isolated(rep, recipe .. " (replay)")
      assert.are.equal(rec.stdout, rep.stdout, recipe .. ": the replay printed otherwise")
      assert.matches("moonbox: replayed %d+ call", rep.stderr)

      if os.getenv("MOONBOX_SPEC_RECORD_CASSETTES") == "1" then
        write("spec/cassettes/" .. name .. ".cassette", read(cassette))
        write("spec/cassettes/" .. name .. ".stdout", rec.stdout)
        io.stderr:write("spec: wrote spec/cassettes/", name, ".cassette and .stdout\n")
      end
    end
  end))

  it("left no API key, env value or connect token in any cassette", function()
    assert.is_true(next(recorded) ~= nil, "nothing was recorded (the test above failed)")
    -- the search must have something to find: the recipes sent env values and used tokens
    assert.is_true(totals.env > 0, "no recording sent an env value")
    assert.is_true(totals.minted > 0, "no recording was minted a connect token")
    for recipe, r in pairs(recorded) do
      assert_no_secret(read(r.cassette), r.secrets, recipe .. "'s cassette")
    end
  end)

  it("a replay needs what the probe says it lacks: outside the namespace the backend is reached",
    T.async(function()
      -- the probe's control: the same shell, not isolated, does reach the backend
      local port = assert(B.direct_url:match(":(%d+)$"))
      local r = proc.run { "bash", "-c", 'if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then echo reached; ' ..
        'else echo unreachable; fi', "bash", port }
      assert.are.equal("reached\n", r.stdout)
    end))
end)

-- A recipe of two sandboxes' worth of calls, the one the divergence tests record and then edit.
local DIVERGING = [[
local render = require "moonbox.render"
local sb <close> = render.sandboxes.create { network = "deny-all", lifetime = 120 }
io.write(sb:exec("echo first"):check().stdout)
io.write(sb:exec("echo second"):check().stdout)
sb:write("note.txt", "kept\n")
print("done")
]]

describe("a replay that diverges", function()
  local cassette, recipe
  local edits = 0

  -- A copy of the recorded recipe with its first match of from replaced by to. -> its path
  local function edited(from, to)
    local text, n = DIVERGING:gsub(from, to, 1)
    assert.are.equal(1, n, "the edit " .. from .. " found nothing to edit")
    edits = edits + 1
    local path = work .. "/edited-" .. edits .. ".lua"
    write(path, text)
    assert(proc.run({ "chmod", "644", path }).code == 0)
    return path
  end

  setup(T.async(function()
    recipe = work .. "/diverging.lua"
    cassette = work .. "/diverging.cassette"
    write(recipe, DIVERGING)
    local rec = moonbox("run", "--record", cassette, recipe)
    assert.are.equal(0, rec.code, rec.stderr)
    assert.are.equal("first\nsecond\ndone\n", rec.stdout)
    assert(proc.run({ "chmod", "644", cassette, recipe }).code == 0)
  end))

  it("replays as it was recorded when the recipe is unchanged", T.async(function()
    local r = replay_isolated(cassette, recipe)
    assert.are.equal(0, r.code, r.stderr)
    assert_isolated(r, "unchanged")
    assert.are.equal("first\nsecond\ndone\n", r.stdout)
  end))

  -- Replays the edited recipe at path: it must fail with nondeterminism after printing stdout
  -- (what ran before the divergence, as recorded). -> the error's line
  local function diverged(path, what, stdout)
    local r = replay_isolated(cassette, path)
    assert.are.equal(1, r.code, r.stderr)
    assert_isolated(r, what)
    assert.are.equal(stdout, r.stdout)
    local line = assert(r.stderr:match("moonbox: recipe [^\n]- failed: ([^\n]*)"), r.stderr)
    assert.matches("[code nondeterminism]", line, 1, true)
    -- the sandbox's <close> met the divergence too: a replay made nothing, so nothing is to reap
    assert.is_nil(r.stderr:find("moonbox reap", 1, true), r.stderr)
    return line
  end

  it("fails with nondeterminism naming both calls when a command changed", T.async(function()
    local path = edited('exec%("echo second"%)', 'exec("echo 2nd")')
    local line = diverged(path, "edited", "first\n")
    -- both calls: the recipe's (its line, its command) and the cassette's (its line, its command)
    assert.matches(path .. ":4, sandbox:exec ", line, 1, true)
    assert.matches("echo 2nd", line, 1, true)
    assert.matches("echo second", line, 1, true)
    assert.matches("(made at " .. recipe .. ":4)", line, 1, true)
    assert.is_true(line:find("echo 2nd", 1, true) < line:find("echo second", 1, true), line)
  end))

  it("fails with nondeterminism naming both calls when a call was added", T.async(function()
    local path = edited('sb:write%(', 'sb:exec("true"):check()\nsb:write(')
    local line = diverged(path, "added", "first\nsecond\n")
    assert.matches(path .. ":5, sandbox:exec /sandboxes/sbx-", line, 1, true)
    assert.matches("is not the journal's next call in this task, sb:write /sandboxes/sbx-", line, 1, true)
    assert.matches("(made at " .. recipe .. ":5)", line, 1, true)
  end))
end)

describe("a file that is not a cassette", function()
  local good

  setup(T.async(function()
    good = work .. "/good.cassette"
    local rec = moonbox("run", "--record", good, "recipes/tasks_and_http.lua", "5")
    assert.are.equal(0, rec.code, rec.stderr)
  end))

  -- Writes a broken copy of the good cassette: its lines, changed by edit(lines).
  local function broken(name, edit)
    local lines = {}
    for l in read(good):gmatch("[^\n]*\n") do lines[#lines + 1] = l end
    local path = work .. "/" .. name .. ".cassette"
    write(path, table.concat(edit(lines)))
    assert(proc.run({ "chmod", "644", path }).code == 0)
    return path, #lines
  end

  local function refused(path, line_no, why)
    local r = replay_isolated(path, "recipes/tasks_and_http.lua")
    assert.are.equal(1, r.code, r.stderr)
    assert_isolated(r, path)
    assert.are.equal("", r.stdout, "the recipe ran from a file that is not a cassette")
    assert.matches(path .. ":" .. line_no .. " ", r.stderr, 1, true)
    assert.matches(why, r.stderr, 1, true)
  end

  it("is refused naming the file and line 1 when its header is not a cassette's", T.async(function()
    local path = broken("bad-format", function(lines)
      lines[1] = lines[1]:gsub('"moonbox_cassette":1', '"moonbox_cassette":99')
      return lines
    end)
    refused(path, 1, "is not a moonbox cassette's header (format 99")
    path = broken("no-header", function(lines)
      table.remove(lines, 1)
      return lines
    end)
    refused(path, 1, "is not a moonbox cassette's header")
    path = broken("not-json", function(lines)
      lines[1] = "# a shell script, say\n"
      return lines
    end)
    refused(path, 1, "is not a cassette line")
  end))

  it("is refused naming the file and line when a line is cut short", T.async(function()
    local path, n = broken("truncated", function(lines)
      lines[#lines] = lines[#lines]:sub(1, #lines[#lines] // 2)
      return lines
    end)
    refused(path, n, "is not a cassette line")
    path = broken("cut-in-the-middle", function(lines)
      lines[3] = lines[3]:sub(1, 20) .. "\n"
      return lines
    end)
    refused(path, 3, "is not a cassette line")
  end))
end)

describe("moonbox.testing's T.replay", function()
  -- The committed cassettes (recorded from recipes/ by this spec: see the top of the file).
  local function committed()
    local out = {}
    for _, name in ipairs(sys.listdir("spec/cassettes")) do
      local base = name:match("^(.+)%.cassette$")
      if base then out[#out + 1] = base end
    end
    table.sort(out)
    return out
  end

  it("replays every committed cassette printing what its recording printed", T.async(function()
    local list = committed()
    assert.is_true(#list >= 3, "spec/cassettes holds " .. #list .. " cassettes")
    for _, name in ipairs(list) do
      local r = T.replay("spec/cassettes/" .. name .. ".cassette", "recipes/" .. name .. ".lua")
      assert.is_true(r.ok, name .. ": " .. tostring(r.error) .. "\n" .. r.stderr ..
        "\n(re-record: MOONBOX_SPEC_RECORD_CASSETTES=1, see spec/cassettes/README.md)")
      assert.are.equal(0, r.code)
      assert.is_nil(r.error)
      assert.is_true(r.replayed > 0, name .. ": nothing was replayed")
      assert.are.equal(read("spec/cassettes/" .. name .. ".stdout"), r.stdout, name)
    end
  end))

  it("works outside a task too, and takes the cassette's own recipe and arguments", function()
    local r = T.replay("spec/cassettes/quickstart.cassette")
    assert.is_true(r.ok, tostring(r.error))
    assert.are.equal(read("spec/cassettes/quickstart.stdout"), r.stdout)
  end)

  it("gives the outcome of a replay that diverges: ok false, the error and its code", T.async(function()
    local path = work .. "/quickstart-edited.lua"
    local text, n = read("recipes/quickstart.lua"):gsub("sort %-n ", "sort -rn ", 1)
    assert.are.equal(1, n)
    write(path, text)
    local r = T.replay("spec/cassettes/quickstart.cassette", path)
    assert.is_false(r.ok)
    assert.are.equal(1, r.code)
    assert.are.equal("nondeterminism", r.error_code, r.stderr)
    assert.matches("sort -rn work/input.txt", r.error, 1, true)
    assert.matches("sort -n work/input.txt", r.error, 1, true)
    assert.is_nil(r.error:find("stack traceback", 1, true))
    assert.matches("^created sbx%-", r.stdout) -- what it printed before the divergence
  end))

  it("gives a cassette that is not one as a failure naming the file and line", T.async(function()
    local path = work .. "/empty-lines.cassette"
    write(path, read("spec/cassettes/quickstart.cassette"):gsub("\n", "\n\n", 1))
    local r = T.replay(path, "recipes/quickstart.lua")
    assert.is_false(r.ok)
    assert.matches(path .. ":2 is not a cassette line", r.error, 1, true)
    assert.are.equal("", r.stdout)
  end))

  it("the committed cassettes hold no secret and nothing of the machine that recorded them", function()
    local here = sys.getcwd()
    for _, name in ipairs(committed()) do
      local text = read("spec/cassettes/" .. name .. ".cassette")
      assert_no_secret(text, { { "the spec backend's API key", L.KEY } }, name)
      -- connect tokens and API keys are 64 hex digits (moonbox.ids.token); digests are 16
      assert.is_nil(text:find(string.rep("%x", 64)), name .. " holds something token-shaped")
      for _, s in ipairs { here, "/tmp/", "/root", "/home/" } do
        assert.is_nil(text:find(s, 1, true), name .. " holds " .. s)
      end
      local h = json.decode(text:match("^[^\n]*"))
      assert.are.equal("recipes/" .. name .. ".lua", h.recipe)
    end
  end)
end)
