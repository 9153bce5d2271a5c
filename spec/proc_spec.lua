-- Pins moonbox.proc: child processes with argv, env, cwd, pipes with bounded buffers, process
-- groups, exit statuses, structured spawn errors, cancellation and proc.run's capture/timeout.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local proc = require "moonbox.proc"
local files = require "spec.support.files"

-- True once pid no longer runs: kill -0 fails, or it is a zombie nobody has reaped yet (it can
-- no longer do anything; its reaper may be an init that reaps lazily).
local function is_gone(pid)
  local f = io.open("/proc/" .. pid .. "/stat")
  if f then
    local state = f:read("a"):match("^%d+ %b() (%a)")
    f:close()
    if state == "Z" then return true end
  end
  return proc.run({ "kill", "-0", tostring(pid), stderr = "null" }).code ~= 0
end

local function wait_gone(pid, seconds)
  local until_ = task.now() + (seconds or 3)
  repeat
    if is_gone(pid) then return true end
    task.sleep(0.01)
  until task.now() > until_
  return false
end

local read_all = files.drain

local errors_with = T.errors_with

describe("proc.spawn", function()
  it("passes argv to the program literally, without a shell", T.async(function()
    local p <close> = proc.spawn { "printf", "%s\n", "two words", "$HOME", "*", "a;b" }
    local lines = {}
    for line in p:lines() do lines[#lines + 1] = line end
    assert.are.same({ "two words", "$HOME", "*", "a;b" }, lines)
    assert.are.same({ 0 }, { (p:wait()) })
  end))

  it("runs a command line through /bin/sh when shell = true, extra elements as $1..",
    T.async(function()
      local r = proc.run { 'echo "$0|$1|$2"; echo $((6 * 7))', "one arg", "$HOME", shell = true }
      assert.are.equal("sh|one arg|$HOME\n42\n", r.stdout)
    end))

  it("adds env to the inherited environment by default", T.async(function()
    local r = proc.run { "sh", "-c", 'echo "$MB_X|$HOME"', env = { MB_X = "1 2" } }
    assert.are.equal("1 2|" .. os.getenv("HOME") .. "\n", r.stdout)
  end))

  it("removes an inherited variable given as false", T.async(function()
    local r = proc.run { "sh", "-c", 'echo "${HOME-unset}"', env = { HOME = false } }
    assert.are.equal("unset\n", r.stdout)
  end))

  it("gives the child only env with env_mode = replace", T.async(function()
    local r = proc.run { "/usr/bin/env", env = { ONLY = "this", N = 5 }, env_mode = "replace" }
    local vars = {}
    for line in r.stdout:gmatch("[^\n]+") do vars[#vars + 1] = line end
    table.sort(vars)
    assert.are.same({ "N=5", "ONLY=this" }, vars)
  end))

  it("searches PATH of the child's environment", T.async(function()
    local err = errors_with("not_found", proc.spawn,
      { "ls", env = { PATH = "/nonexistent" }, env_mode = "replace" })
    assert.matches("no such program in PATH", err.message)
  end))

  it("runs the child in cwd", T.async(function()
    local r = proc.run { "pwd", cwd = "/usr/bin" }
    assert.are.equal("/usr/bin\n", r.stdout)
    -- a relative program path is relative to cwd, as in the child
    assert.are.equal(0, proc.run({ "./true", cwd = "/usr/bin" }).code)
  end))

  it("keeps stdout and stderr apart", T.async(function()
    local p <close> = proc.spawn { "sh", "-c", "echo out1; echo err1 >&2; echo out2; echo err2 >&2" }
    assert.are.equal("out1\nout2\n", read_all(p, "stdout"))
    assert.are.equal("err1\nerr2\n", read_all(p, "stderr"))
  end))

  it("merges stderr into stdout with stderr = 'stdout'", T.async(function()
    local r = proc.run { "sh", "-c", "echo a; echo b >&2; echo c", stderr = "stdout" }
    assert.are.equal("a\nb\nc\n", r.stdout)
    assert.is_nil(r.stderr)
  end))

  it("writes stdout to a file with {file = path} and appends with append = true",
    T.async(function()
      local path = os.tmpname()
      proc.run { "echo", "one", stdout = { file = path } }
      proc.run { "echo", "two", stdout = { file = path, append = true } }
      local f = assert(io.open(path))
      local text = f:read("a")
      f:close()
      os.remove(path)
      assert.are.equal("one\ntwo\n", text)
    end))

  it("gives the child /dev/null as stdin by default", T.async(function()
    assert.are.equal("", proc.run({ "cat" }).stdout)
  end))

  it("delivers 20 MB completely to a slow reader while its buffer stays bounded",
    T.async(function()
      local p <close> = proc.spawn { "head", "-c", "20000000", "/dev/zero" }
      local total, reads, chunk_max = 0, 0, 16384
      while true do
        local chunk = p:read("stdout", chunk_max)
        if not chunk then break end
        assert.is_true(#chunk <= chunk_max)
        total = total + #chunk
        reads = reads + 1
        if reads % 16 == 0 then task.sleep(0.001) end
      end
      local st = p:stats()
      assert.are.equal(20000000, total)
      assert.are.equal(20000000, st.stdout_bytes)
      assert.are.equal(65536, st.buffer_limit)
      assert.is_true(st.stdout_peak <= st.buffer_limit + chunk_max,
        "peak " .. st.stdout_peak .. " above the bound")
      assert.are.same({ 0 }, { (p:wait()) })
    end))

  it("keeps a small buffer bound and loses nothing while paused", T.async(function()
    local p <close> = proc.spawn { "seq", "1", "100000", buffer = 1024 }
    local n = 0
    for line in p:lines() do
      n = n + 1
      if line ~= tostring(n) then error("line " .. n .. " is " .. line) end
      if n % 5000 == 0 then task.sleep(0.001) end
    end
    assert.are.equal(100000, n)
    assert.is_true(p:stats().stdout_peak <= 1024)
  end))

  it("returns the last line even without a trailing newline", T.async(function()
    local p <close> = proc.spawn { "printf", "a\n\nb" }
    local lines = {}
    for line in p:lines() do lines[#lines + 1] = line end
    assert.are.same({ "a", "", "b" }, lines)
  end))

  it("assembles a line longer than the buffer", T.async(function()
    local p <close> = proc.spawn { "sh", "-c", "head -c 300000 /dev/zero | tr '\\0' x; echo; echo end",
      buffer = 4096 }
    local it = p:lines()
    assert.are.equal(string.rep("x", 300000), it())
    assert.are.equal("end", it())
    assert.is_nil(it())
  end))

  it("writes to stdin and the child sees the end after close_stdin", T.async(function()
    local p <close> = proc.spawn { "cat", stdin = "pipe" }
    local data = string.rep("0123456789abcdef", 65536) -- 1 MiB: many times the pipe's size
    local writer = task.spawn(function()
      p:write(data)
      p:close_stdin()
    end)
    local out = read_all(p, "stdout")
    task.join(writer)
    assert.are.equal(#data, #out)
    assert.is_true(out == data)
    assert.are.same({ 0 }, { (p:wait()) })
  end))

  it("raises broken_pipe when writing to a child that closed its stdin", T.async(function()
    local p <close> = proc.spawn { "true", stdin = "pipe" }
    p:wait()
    local err = errors_with("broken_pipe", p.write, p, "hello")
    assert.are.equal("proc.write", err.op)
    assert.are.equal(p.pid, err.pid)
  end))

  it("reports exit codes", T.async(function()
    assert.are.same({ 42 }, { (proc.spawn { "sh", "-c", "exit 42" }):wait() })
    assert.are.equal(0, proc.run({ "true" }).code)
    assert.are.equal(1, proc.run({ "false" }).code)
  end))

  it("reports the signal that ended the process as (nil, name)", T.async(function()
    local p <close> = proc.spawn { "sleep", "100" }
    assert.is_true(p:kill("KILL"))
    local code, sig = p:wait()
    assert.is_nil(code)
    assert.are.equal("KILL", sig)
    local r = proc.run { "sh", "-c", "kill -SEGV $$" }
    assert.is_nil(r.code)
    assert.are.equal("SEGV", r.signal)
  end))

  it("accepts signal names with SIG and numbers, and makes kill after the exit a no-op",
    T.async(function()
      local p <close> = proc.spawn { "sleep", "100" }
      assert.is_true(p:kill(0)) -- only checks
      assert.is_true(p:kill("SIGINT"))
      assert.are.same({ nil, "INT" }, { p:wait() })
      assert.is_false(p:kill("TERM"))
      local q <close> = proc.spawn { "sleep", "100" }
      assert.is_true(q:kill(15))
      assert.are.same({ nil, "TERM" }, { q:wait() })
      assert.has_error(function() q:kill("NOPE") end)
    end))

  it("kills the whole process group, grandchildren included", T.async(function()
    local p <close> = proc.spawn { "sh", "-c", "sleep 100 & echo $!; sleep 100" }
    local grandchild = tonumber(p:lines()())
    assert.is_false(is_gone(grandchild))
    assert.is_true(p:kill())
    assert.are.same({ nil, "TERM" }, { p:wait() })
    assert.is_true(wait_gone(grandchild), "grandchild " .. grandchild .. " survived")
  end))

  it("kills a running process and its group when the handle is closed by <close>",
    T.async(function()
      collectgarbage()
      collectgarbage() -- handles earlier tests dropped without closing them
      local before = proc.live_count()
      local pid, grandchild
      do
        local p <close> = proc.spawn { "sh", "-c", "sleep 100 & echo $!; sleep 100" }
        pid = p.pid
        grandchild = tonumber(p:lines()())
      end
      assert.is_true(wait_gone(pid))
      assert.is_true(wait_gone(grandchild))
      -- the runtime still reaps the killed child, then forgets it
      local until_ = task.now() + 3
      while proc.live_count() > before and task.now() < until_ do task.sleep(0.01) end
      assert.is_true(proc.live_count() <= before)
    end))

  it("raises a structured not_found error naming a missing program", T.async(function()
    local err = errors_with("not_found", proc.spawn, { "no-such-program-xyz", "arg" })
    assert.are.equal("proc.spawn", err.op)
    assert.are.equal("no-such-program-xyz", err.program)
    assert.matches("cannot run 'no%-such%-program%-xyz': no such program in PATH", err.message)
    errors_with("not_found", proc.spawn, { "/no/such/dir/prog" })
  end))

  it("raises a structured not_found error naming a missing cwd", T.async(function()
    local err = errors_with("not_found", proc.spawn, { "ls", cwd = "/no/such/dir" })
    assert.are.equal("/no/such/dir", err.cwd)
    assert.matches("working directory '/no/such/dir' does not exist", err.message)
  end))

  it("raises permission_denied for a file that is not executable", T.async(function()
    local path = os.tmpname()
    local err = errors_with("permission_denied", proc.spawn, { path })
    os.remove(path)
    assert.matches("permission denied", err.message)
  end))

  it("raises a usage error for a bad option, not a structured one", function()
    local ok, err = pcall(proc.spawn, { "ls", stdout = "bogus" })
    assert.is_false(ok)
    assert.matches("stdout must be", err)
    ok, err = pcall(proc.spawn, { "ls", timout = 3 })
    assert.is_false(ok)
    assert.matches("unknown option 'timout'", err)
    ok, err = pcall(proc.spawn, {})
    assert.is_false(ok)
    assert.matches("at least the program name", err)
  end)

  it("leaks no fd into the child, even ones opened without close-on-exec", T.async(function()
    local leaky = assert(io.open("/dev/null")) -- Lua's io.open does not set O_CLOEXEC
    local other <close> = proc.spawn { "sleep", "10", stdin = "pipe" } -- our own pipes exist too
    local r = proc.run { "ls", "/proc/self/fd" }
    leaky:close()
    local fds = {}
    for fd in r.stdout:gmatch("%d+") do fds[#fds + 1] = tonumber(fd) end
    table.sort(fds)
    -- 0, 1, 2 and the directory ls itself is reading
    assert.are.same({ 0, 1, 2, 3 }, fds)
    assert.is_not_nil(other.pid)
  end))

  it("leaves the process running and the handle usable when a waiting task is cancelled",
    T.async(function()
      local p <close> = proc.spawn { "sh", "-c", "read line; echo got $line; exit 7", stdin = "pipe" }
      local waiter = task.spawn(function() return p:wait() end)
      local reader = task.spawn(function() return p:read() end)
      task.sleep(0.05)
      task.cancel(waiter)
      task.cancel(reader)
      for _, t in ipairs { waiter, reader } do
        local ok, err = pcall(task.join, t)
        assert.is_false(ok)
        assert.is_true(task.is_cancelled(err))
      end
      assert.is_true(p:kill(0)) -- still running
      p:write("go\n")
      assert.are.equal("got go\n", p:read())
      assert.are.same({ 7 }, { (p:wait()) })
    end))

  it("raises a clear error when waiting outside a task", function()
    local p <close> = proc.spawn { "true" }
    local ok, err = pcall(p.wait, p)
    assert.is_false(ok)
    assert.matches("not inside a task", err)
  end)

  it("runs 50 processes at once to completion", T.async(function()
    local items = {}
    for i = 1, 50 do items[i] = i end
    local outs = task.map(items, function(i)
      return proc.run({ 'sleep 0.05; echo "$1"; echo "e$1" >&2', i, shell = true }).stdout
    end, 50)
    for i = 1, 50 do assert.are.equal(i .. "\n", outs[i]) end
  end))
end)

describe("proc.run", function()
  it("captures code, stdout and stderr", T.async(function()
    local r = proc.run { "sh", "-c", "echo out; echo err >&2; exit 3" }
    assert.are.equal(3, r.code)
    assert.is_nil(r.signal)
    assert.are.equal("out\n", r.stdout)
    assert.are.equal("err\n", r.stderr)
    assert.is_number(r.pid)
  end))

  it("feeds input while draining both pipes, so a child flooding stderr cannot deadlock",
    T.async(function()
      local input = string.rep("y", 1 << 20)
      local r = proc.run { "sh", "-c", "head -c 1048576 /dev/zero >&2; cat", input = input }
      assert.are.equal(0, r.code)
      assert.are.equal(1 << 20, #r.stderr)
      assert.is_true(r.stdout == input)
    end))

  it("kills the group and raises code timeout when the timeout expires", T.async(function()
    local err = errors_with("timeout", proc.run,
      { "sh", "-c", "sleep 100 & echo $!; sleep 100", timeout = 0.2 })
    assert.are.equal("proc.run", err.op)
    assert.are.equal(0.2, err.seconds)
    local grandchild = tonumber(err.stdout:match("%d+"))
    assert.is_true(wait_gone(err.pid))
    assert.is_true(wait_gone(grandchild))
  end))

  it("kills the group when its task is cancelled, then lets the cancellation through",
    T.async(function()
      local path = os.tmpname()
      local t = task.spawn(function()
        return proc.run { "sh", "-c", 'echo $$ > "$1"; sleep 100 & echo $! >> "$1"; wait', "sh", path }
      end)
      local pids
      repeat
        task.sleep(0.01)
        local f = assert(io.open(path))
        pids = {}
        for pid in f:read("a"):gmatch("%d+") do pids[#pids + 1] = tonumber(pid) end
        f:close()
      until #pids == 2
      os.remove(path)
      task.cancel(t)
      local ok, err = pcall(task.join, t)
      assert.is_false(ok)
      assert.is_true(task.is_cancelled(err))
      assert.is_true(wait_gone(pids[1]))
      assert.is_true(wait_gone(pids[2]))
    end))

  it("is bounded by an enclosing task.timeout", T.async(function()
    local ok, err = pcall(task.timeout, 0.1, proc.run, { "sleep", "100" })
    assert.is_false(ok)
    assert.is_true(task.is_timeout(err)) -- not the end of `sleep 100`, which would return
  end))

  it("raises a clear error outside a task, before starting anything", function()
    local before = proc.live_count()
    local ok, err = pcall(proc.run, { "true" })
    assert.is_false(ok)
    assert.matches("not inside a task", err)
    assert.are.equal(before, proc.live_count())
  end)
end)
