-- sb:exec / sb:spawn semantics (docs/reference/render.md, "Exec") against a real `moonbox local`:
-- env never in command text, kill before start, process-group kill, cancellation, max_output.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local json = require "moonbox.json"
local render = require "moonbox.render"
local L = require "spec.support.local_backend"

local B, sb

L.fixture(setup, teardown, function(b)
  B, sb = b, render.sandboxes.create {}:keep()
  return function() sb:terminate() end
end)

-- Processes in the sandbox whose command line matches; "[s]leep" so pgrep and the shell that
-- runs it (whose own command lines hold the pattern) do not count themselves.
local function count(pattern)
  local re = "[" .. pattern:sub(1, 1) .. "]" .. pattern:sub(2)
  return tonumber(sb:exec("pgrep -c -f " .. render.shell_quote(re) .. " || true").stdout) or 0
end

describe("sb:exec env", function()
  it("passes env values without putting them in any command text the backend recorded", T.async(function()
    local secret = "s3cr3t-" .. tostring(math.random(1e9))
    local r = sb:exec('printf "%s|%s" "$TOKEN" "$OTHER"', { env = { TOKEN = secret, OTHER = "it's \"quoted\"" } })
    assert.are.equal(secret .. "|it's \"quoted\"", r:check().stdout)
    local _, entries = B:req("GET", "/_moonbox/journal")
    assert.is_nil(json.encode(entries):find(secret, 1, true))
    for e in (function()
      local _, page = B:req("GET", "/v1/sandboxes/" .. sb.id .. "/execs", { query = { limit = 100 } })
      local i = 0
      return function() i = i + 1; return page[i] and page[i].execution end
    end)() do
      assert.is_nil((e.command or ""):find(secret, 1, true))
    end
    -- and the env file is gone afterwards
    assert.are.equal("", sb:exec("ls /dev/.moonbox/*.env 2>/dev/null || true").stdout)
  end))

  it("refuses names bash cannot export", T.async(function()
    for _, name in ipairs({ "UID", "EUID", "PPID", "SHELLOPTS", "BASHOPTS", "BASH_VERSINFO", "1BAD" }) do
      local ok, err = pcall(sb.exec, sb, "true", { env = { [name] = "x" } })
      assert.is_false(ok, name)
      assert.matches(name, tostring(err))
    end
  end))
end)

describe("kill", function()
  it("kills a sleep 1000 tree, leaving no process", T.async(function()
    local p = sb:spawn("sleep 1000 & sleep 1000 & wait")
    for _ = 1, 100 do
      if count("sleep 1000") >= 2 then break end
      task.sleep(0.05)
    end
    assert.is_true(count("sleep 1000") >= 2)
    assert.are.equal("signalled", p:kill("KILL"))
    local r = p:wait()
    assert.is_true(r.code ~= 0)
    assert.are.equal(0, count("sleep 1000"))
  end))

  it("of a command that has not started makes it exit 143 without running", T.async(function()
    local exec = require "moonbox.render.exec"
    -- Leave the kill marker first, as a kill racing ahead of the start would.
    local id = "pre" .. tostring(math.random(1e6))
    sb:exec("mkdir -p /dev/.moonbox && touch /dev/.moonbox/" .. id .. ".kill"):check()
    local c = render.connection()
    local script = exec.wrapper(id, "touch /root/should-not-exist", nil, false)
    local s, tok = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/runs/sync/token", { body = { command = script } })
    assert.are.equal(201, s)
    local r = require("moonbox.http").request { method = "POST", url = tok.uri,
      body = json.encode({ command = script }), headers = { Authorization = "Bearer " .. tok.token } }
    assert.are.equal(143, json.decode(r.body).exit_code)
    assert.are.equal(1, sb:exec("test -e /root/should-not-exist").code)
    assert.is_truthy(c)
  end))

  it("escalates TERM to KILL after the grace period for a command that ignores TERM", T.async(function()
    local p = sb:spawn("trap '' TERM; sleep 5000 & wait")
    for _ = 1, 100 do -- the wrapper, its bash -c and the sleep itself
      if count("sleep 5000") >= 3 then break end
      task.sleep(0.05)
    end
    assert.are.equal("signalled", p:kill("TERM", { grace = 0.5 }))
    local r = p:wait()
    assert.is_true(r.code ~= 0)
    -- the sleep ignores TERM: only the KILL after the grace period ends it
    local left = count("sleep 5000")
    for _ = 1, 60 do
      if left == 0 then break end
      task.sleep(0.05)
      left = count("sleep 5000")
    end
    assert.are.equal(0, left)
  end))

  it("kills the process group when the waiting task is cancelled", T.async(function()
    local waiter = task.spawn(function() return sb:exec("sleep 2000") end)
    for _ = 1, 100 do
      if count("sleep 2000") >= 1 then break end
      task.sleep(0.05)
    end
    task.cancel(waiter)
    local ok, err = pcall(task.join, waiter)
    assert.is_false(ok)
    assert.is_true(task.is_cancelled(err))
    assert.are.equal(0, count("sleep 2000"))
  end))

  it("kills the group when the exec's timeout expires", T.async(function()
    local ok, err = pcall(sb.exec, sb, "sleep 3000", { timeout = 1 })
    assert.is_false(ok)
    assert.is_true(task.is_timeout(err))
    assert.are.equal(0, count("sleep 3000"))
  end))

  it("stops leftover background children before reporting the exit", T.async(function()
    assert.are.equal(0, sb:exec("sleep 4000 > /dev/null 2>&1 & echo started"):check().code)
    assert.are.equal(0, count("sleep 4000"))
  end))
end)

describe("secrets", function()
  it("never show a planted env secret in a failing recipe's output or error", function()
    local secret = "planted-" .. tostring(math.random(1e9))
    local recipe = os.tmpname()
    local f = assert(io.open(recipe, "w"))
    f:write(string.format([[
local render = require "moonbox.render"
render.connect { backend = %q, api_key = %q, workspace = %q }
local sb <close> = render.sandboxes.create {}
sb:exec("echo working; exit 9", { env = { API_TOKEN = %q } }):check()
]], B.url, B.key, B.workspace, secret))
    f:close()
    local out = os.tmpname()
    local ok = os.execute(L.BIN .. " run " .. recipe .. " > " .. out .. " 2>&1")
    local text = assert(io.open(out)):read("a")
    assert.is_falsy(ok)
    assert.matches("exit_status", text)
    assert.is_nil(text:find(secret, 1, true))
    assert.is_nil(text:find(B.key, 1, true))
    os.remove(recipe)
    os.remove(out)
  end)
end)

describe("output", function()
  it("delivers NULs and multi-megabyte output byte for byte, invalid UTF-8 as U+FFFD", T.async(function()
    -- The backend sends output as UTF-8 text: bytes that are not UTF-8 arrive as U+FFFD.
    local r = sb:exec([[printf 'a\0b\377c\303\251'; printf 'e\0rr' >&2]])
    assert.are.equal("a\0b\239\191\189c\195\169", r.stdout)
    assert.are.equal("e\0rr", r.stderr)
    -- many events, interleaved streams, lines cut anywhere by the pipes
    local n = 3 * 1024 * 1024
    local big = sb:exec("yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c " .. n ..
      "; echo done >&2", { max_output = 4 * n })
    local line = "0123456789abcdefghijklmnopqrstuvwxyz\n"
    local want = string.rep(line, n // #line + 1):sub(1, n)
    assert.are.equal(n, #big.stdout)
    assert.is_true(want == big.stdout, "stdout differs from the command's output")
    assert.are.equal("done\n", big.stderr)
  end))

  it("truncates each stream at max_output bytes with multi-byte output", T.async(function()
    local r = sb:exec("for i in $(seq 100); do printf 'é'; done; printf 'ab' >&2", { max_output = 7 })
    assert.is_true(r.truncated)
    assert.are.equal(string.rep("é", 3), r.stdout) -- 6 bytes: the 4th 'é' would split at 7
    assert.are.equal("ab", r.stderr)
  end))

  it("spawn streams lines as they arrive", T.async(function()
    local p = sb:spawn("for i in 1 2 3; do echo line$i; sleep 0.05; done")
    local got = {}
    for line in p:lines() do got[#got + 1] = line end
    assert.are.same({ "line1", "line2", "line3" }, got)
    assert.are.equal(0, p:wait().code)
  end))

  it("run_sync uses the sync operation", T.async(function()
    local r = sb:run_sync({ "printf", "%s", "sync ok" })
    assert.are.same({ 0, "sync ok", false }, { r.code, r.stdout, r.truncated })
  end))

  it("run_sync says when the server cut its output (2 MiB: truncated, 1 MiB kept)", T.async(function()
    local r = sb:run_sync("head -c 2097152 /dev/zero | tr '\\0' x")
    assert.are.equal(0, r.code)
    assert.is_true(r.truncated, "a cut output reported complete")
    assert.are.equal(1048576, #r.stdout)
  end))
end)
