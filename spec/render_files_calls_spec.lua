-- Every files call of a Sandbox (sb:read, write, copy_in, copy_out, ls, stat, exists, remove,
-- mkdir, rename) against each backend in BACKENDS, with hostile names — one per byte class: a
-- space, a single quote, a double quote, `$(x)`, a backslash, a newline, a leading dash, a byte
-- >= 0x80 that is not UTF-8, glob characters — checking what comes back, what the sandbox holds
-- (seen through a second mechanism: an argv command reads what the files API wrote, the files
-- API reads what an argv command made), and each typed error with its fields.
--
-- The same body runs on every backend: BACKENDS is a list of makers, each starting a backend
-- and pointing moonbox.render at it; a new backend is one more entry.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local render = require "moonbox.render"
local files = require "spec.support.files"
local L = require "spec.support.local_backend"

--- The backends the body runs against: {name, start() -> backend (with :connect_render() and
-- :destroy())}. [start yields]
-- commands: whether the backend runs the sandbox's own programs (a dry run runs none: it carries
-- out only the argv commands the files calls send, moonbox.local.engine.coreutils), so checks
-- made through a second program (stat, cat, test) and the kernel's own refusals (/proc) are made
-- where there is a kernel.
local BACKENDS = {
  { name = "moonbox local", commands = true, start = function() return L.start { edge = false } end },
  { name = "moonbox local through the TLS + HTTP/2 edge", commands = true,
    start = function() return L.start { edge = true } end },
  { name = "a dry run (moonbox local's service on the simulated engine)", commands = false,
    start = function() return require("spec.support.dryrun_backend").start() end },
}

-- One name per byte class a path may hold (NUL excepted).
local NAMES = {
  { "a space", "two words" },
  { "a single quote", "it's" },
  { "a double quote", 'say "hi"' },
  { "a command substitution", "$(x)" },
  { "a backslash", "back\\slash" },
  { "a newline", "new\nline" },
  { "a leading dash", "-rf" },
  { "a byte >= 0x80 that is not UTF-8", "caf\233" },
  { "glob characters", "*?[a]" },
}

-- What JSON (a Go server's, and moonbox local's) makes of a name in a listing: bytes that are
-- not UTF-8 become U+FFFD.
local function as_listed(name) return (name:gsub("\233", "\239\191\189")) end

local function sh(script, ...)
  local r = proc.run { script, ..., shell = true }
  assert(r.code == 0, "shell failed: " .. script .. "\n" .. r.stderr)
  return r.stdout
end

--- Asserts fn(...) raises the typed error `code` from `call` at `path` in sb, its message naming
-- the call, the path (as messages show it) and the sandbox; returns the error.
local function typed(sb, code, call, path, fn, ...)
  local err = T.errors_with(code, fn, ...)
  assert.are.equal(call, err.op)
  assert.are.equal(path, err.path)
  assert.are.equal(sb.id, err.sandbox_id)
  assert.matches(call, err.message, 1, true)
  assert.matches(sb.id, err.message, 1, true)
  if not path:find("[%c\128-\255]") then assert.matches(path, err.message, 1, true) end
  return err
end

local function names_in(entries)
  local by = {}
  for _, e in ipairs(entries) do by[e.name] = e end
  return by
end

--- The body: every call on the sandbox sb() gives, with local scratch space under work().
local function body(sb_of, work_of, commands)
  describe("with hostile names", function()
    for i, case in ipairs(NAMES) do
      local what, name = case[1], case[2]
      local dir = "/tmp/hostile-" .. i

      it("writes, reads, stats, lists and finds a file named with " .. what, T.async(function()
        local sb = sb_of()
        sb:mkdir(dir)
        local p = dir .. "/" .. name
        local data = "bytes of " .. name .. "\0\255"
        sb:write(p, data)
        assert.are.equal(data, sb:read(p))
        -- an argv command reaches the same file (its size: exec output is JSON text, not bytes)
        if commands then
          assert.are.equal(#data .. "\n", sb:exec({ "stat", "-c", "%s", "--", p }):check().stdout)
        end
        local st = sb:stat(p)
        assert.are.same({ "file", #data }, { st.type, st.size })
        assert.matches("^%d%d%d%d%-%d%d%-%d%dT", st.modified_at)
        assert.is_true(sb:exists(p))
        local entries = sb:ls(dir)
        assert.are.equal(1, #entries)
        assert.are.equal(as_listed(name), entries[1].name)
        assert.are.equal(#data, entries[1].size)
      end))

      it("makes, renames and removes directories and files named with " .. what, T.async(function()
        local sb = sb_of()
        local d = dir .. "/d " .. name
        sb:mkdir(d .. "/" .. name .. "/deeper", { parents = true })
        assert.are.equal("directory", sb:stat(d .. "/" .. name .. "/deeper").type)
        sb:mkdir(d .. "/" .. name, { parents = true }) -- an existing directory is no error with parents
        -- the files API sees what the argv command made, and the reverse
        sb:write(d .. "/" .. name .. "/f", "x")
        if commands then
          assert.are.equal("x", sb:exec({ "cat", "--", d .. "/" .. name .. "/f" }):check().stdout)
        end
        sb:rename(d .. "/" .. name .. "/f", d .. "/" .. name .. "/" .. name)
        assert.is_false(sb:exists(d .. "/" .. name .. "/f"))
        assert.are.equal("x", sb:read(d .. "/" .. name .. "/" .. name))
        typed(sb, "not_empty", "sb:remove", d .. "/" .. name, sb.remove, sb, d .. "/" .. name)
        sb:remove(d .. "/" .. name .. "/" .. name)
        sb:remove(d .. "/" .. name .. "/deeper")
        sb:remove(d .. "/" .. name) -- now empty
        assert.is_false(sb:exists(d .. "/" .. name))
        sb:mkdir(d .. "/" .. name .. "/a/b", { parents = true })
        sb:remove(d, { recursive = true })
        assert.is_false(sb:exists(d))
        if commands then
          assert.are.equal("1\n", sb:exec({ "sh", "-c", 'test -e "$1"; echo $?', "sh", d }):check().stdout)
        end
      end))
    end

    it("copies a local tree of every hostile name in and out", T.async(function()
      local sb = sb_of()
      local src = work_of() .. "/hostile-src"
      sh('mkdir -p "$1"', src)
      for _, case in ipairs(NAMES) do
        files.write(src .. "/" .. case[2], "content of " .. case[2])
        sh('mkdir -p "$1"', src .. "/dir " .. case[2])
        files.write(src .. "/dir " .. case[2] .. "/" .. case[2], "inner " .. case[2])
      end
      sb:copy_in("/tmp/hostile-tree", src)
      local listed = names_in(sb:ls("/tmp/hostile-tree"))
      for _, case in ipairs(NAMES) do
        local name = case[2]
        assert.are.equal("file", listed[as_listed(name)].type, name)
        assert.are.equal("directory", listed[as_listed("dir " .. name)].type, name)
        assert.are.equal("content of " .. name, sb:read("/tmp/hostile-tree/" .. name))
        assert.are.equal("inner " .. name, sb:read("/tmp/hostile-tree/dir " .. name .. "/" .. name))
        -- single files both ways, the sandbox path first
        sb:copy_in("/tmp/hostile-single-" .. name, src .. "/" .. name)
        assert.are.equal("content of " .. name, sb:read("/tmp/hostile-single-" .. name))
        sb:copy_out("/tmp/hostile-single-" .. name, work_of() .. "/single " .. name)
        assert.are.equal("content of " .. name, files.must_read(work_of() .. "/single " .. name))
      end
      local back = work_of() .. "/hostile-back"
      sb:copy_out("/tmp/hostile-tree", back)
      local d = proc.run { "diff", "-r", src, back }
      assert.are.equal(0, d.code, d.stdout .. d.stderr)
    end))
  end)

  describe("typed errors", function()
    setup(T.async(function()
      local sb = sb_of()
      -- the tree, symlinks included, goes in as one archive (symlinks travel as symlinks)
      local t = work_of() .. "/typed-tree"
      sh('mkdir -p "$1/full/sub" "$1/empty" && printf f > "$1/file" && ln -s nowhere "$1/dangling" && ln -s full "$1/link"', t)
      sb:copy_in("/tmp/t", t)
    end))

    it("not_found: reading, stating, listing, copying out, removing, renaming what is not there",
      T.async(function()
        local sb = sb_of()
        local missing = "/tmp/t/missing"
        local err = typed(sb, "not_found", "sb:read", missing, sb.read, sb, missing)
        assert.are.equal(404, err.status)
        typed(sb, "not_found", "sb:stat", missing, sb.stat, sb, missing)
        typed(sb, "not_found", "sb:ls", missing, sb.ls, sb, missing)
        typed(sb, "not_found", "sb:copy_out", missing, sb.copy_out, sb, missing, work_of() .. "/never")
        assert.is_nil(io.open(work_of() .. "/never"))
        assert.is_false(sb:exists(missing))
        err = typed(sb, "not_found", "sb:remove", missing, sb.remove, sb, missing)
        assert.are.equal(1, err.exit_code)
        assert.matches("No such file or directory", err.message, 1, true)
        typed(sb, "not_found", "sb:remove", missing, sb.remove, sb, missing, { recursive = true })
        typed(sb, "not_found", "sb:mkdir", missing .. "/x", sb.mkdir, sb, missing .. "/x")
        err = typed(sb, "not_found", "sb:rename", missing, sb.rename, sb, missing, "/tmp/t/other")
        assert.are.equal("/tmp/t/other", err.to)
        typed(sb, "not_found", "sb:rename", "/tmp/t/file", sb.rename, sb, "/tmp/t/file", missing .. "/x")
        assert.are.equal("f", sb:read("/tmp/t/file"))
      end))

    it("exists: mkdir of anything already there", T.async(function()
      local sb = sb_of()
      typed(sb, "exists", "sb:mkdir", "/tmp/t/empty", sb.mkdir, sb, "/tmp/t/empty")
      typed(sb, "exists", "sb:mkdir", "/tmp/t/file", sb.mkdir, sb, "/tmp/t/file")
      typed(sb, "exists", "sb:mkdir", "/tmp/t/file", sb.mkdir, sb, "/tmp/t/file", { parents = true })
      typed(sb, "exists", "sb:mkdir", "/tmp/t/dangling", sb.mkdir, sb, "/tmp/t/dangling")
    end))

    it("not_a_directory: a file where a directory must be", T.async(function()
      local sb = sb_of()
      typed(sb, "not_a_directory", "sb:read", "/tmp/t/file/x", sb.read, sb, "/tmp/t/file/x")
      typed(sb, "not_a_directory", "sb:write", "/tmp/t/file/x", sb.write, sb, "/tmp/t/file/x", "y")
      typed(sb, "not_a_directory", "sb:stat", "/tmp/t/file/x", sb.stat, sb, "/tmp/t/file/x")
      typed(sb, "not_a_directory", "sb:ls", "/tmp/t/file", sb.ls, sb, "/tmp/t/file")
      assert.is_false(sb:exists("/tmp/t/file/x"))
      typed(sb, "not_a_directory", "sb:mkdir", "/tmp/t/file/x", sb.mkdir, sb, "/tmp/t/file/x")
      typed(sb, "not_a_directory", "sb:mkdir", "/tmp/t/file/x/y", sb.mkdir, sb, "/tmp/t/file/x/y", { parents = true })
      typed(sb, "not_a_directory", "sb:remove", "/tmp/t/file/x", sb.remove, sb, "/tmp/t/file/x")
      typed(sb, "not_a_directory", "sb:rename", "/tmp/t/empty", sb.rename, sb, "/tmp/t/empty", "/tmp/t/file")
      assert.are.equal("directory", sb:stat("/tmp/t/empty").type)
    end))

    it("is_a_directory: a directory where a file must be", T.async(function()
      local sb = sb_of()
      typed(sb, "is_a_directory", "sb:read", "/tmp/t/full", sb.read, sb, "/tmp/t/full")
      typed(sb, "is_a_directory", "sb:write", "/tmp/t/full", sb.write, sb, "/tmp/t/full", "y")
      typed(sb, "is_a_directory", "sb:rename", "/tmp/t/file", sb.rename, sb, "/tmp/t/file", "/tmp/t/empty")
      assert.are.equal("f", sb:read("/tmp/t/file"))
    end))

    it("not_empty: removing or renaming onto a directory that holds something", T.async(function()
      local sb = sb_of()
      typed(sb, "not_empty", "sb:remove", "/tmp/t/full", sb.remove, sb, "/tmp/t/full")
      typed(sb, "not_empty", "sb:rename", "/tmp/t/empty", sb.rename, sb, "/tmp/t/empty", "/tmp/t/full")
      assert.are.equal("directory", sb:stat("/tmp/t/full/sub").type)
    end))

    if commands then it("permission_denied: what the sandbox's root may not touch", T.async(function()
      local sb = sb_of()
      typed(sb, "permission_denied", "sb:write", "/proc/x", sb.write, sb, "/proc/x", "y")
      typed(sb, "permission_denied", "sb:remove", "/proc/self", sb.remove, sb, "/proc/self")
    end)) end

    it("exec_failed with coreutils' message for what is none of the typed cases", T.async(function()
      local sb = sb_of()
      local err = typed(sb, "exec_failed", "sb:rename", "/tmp/t/full", sb.rename, sb, "/tmp/t/full",
        "/tmp/t/full/sub/inside")
      assert.matches("subdirectory of itself", err.message, 1, true)
    end))

    it("a command past its timeout raises timeout naming the call", T.async(function()
      local sb = sb_of()
      local err = T.errors_with("timeout", sb.mkdir, sb, "/tmp/t/late", { timeout = 0.001 })
      assert.are.equal("sb:mkdir", err.op)
      assert.are.equal("/tmp/t/late", err.path)
      assert.matches("sb:mkdir /tmp/t/late in sandbox " .. sb.id .. " did not finish within", err.message, 1, true)
    end))

    it("symlinks: stat does not follow, exists sees a dangling one, remove removes the link", T.async(function()
      local sb = sb_of()
      assert.are.same({ "symlink", "nowhere" }, { sb:stat("/tmp/t/dangling").type, sb:stat("/tmp/t/dangling").target })
      assert.is_true(sb:exists("/tmp/t/dangling"))
      assert.are.equal("symlink", sb:stat("/tmp/t/link").type)
      assert.are.equal("sub", sb:ls("/tmp/t/link")[1].name) -- a listing follows a link given as the path
      sb:remove("/tmp/t/link")
      assert.is_false(sb:exists("/tmp/t/link"))
      assert.are.equal("directory", sb:stat("/tmp/t/full").type)
    end))

    it("refuses unknown options, an empty path and a NUL before any request", T.async(function()
      local sb = sb_of()
      local ok, err = pcall(function() sb:remove("/tmp/t/x", { recursve = true }) end)
      assert.is_false(ok)
      assert.matches("sb:remove: unknown option `recursve` (did you mean `recursive`?)", tostring(err), 1, true)
      assert.matches("render_files_calls_spec.lua:%d+", tostring(err))
      ok, err = pcall(function() sb:mkdir("/tmp/t/x", { parent = true }) end)
      assert.is_false(ok)
      assert.matches("did you mean `parents`?", tostring(err), 1, true)
      ok, err = pcall(function() sb:ls("/tmp/t", { dpeth = 0 }) end)
      assert.is_false(ok)
      assert.matches("did you mean `depth`?", tostring(err), 1, true)
      T.errors_with("invalid_path", sb.stat, sb, "")
      T.errors_with("invalid_path", sb.write, sb, "a\0b", "x")
      T.errors_with("invalid_path", sb.rename, sb, "/tmp/t/file", "x\0")
    end))
  end)
end

for _, backend in ipairs(BACKENDS) do
  describe(backend.name, function()
    local B, sb, work
    setup(T.async(function()
      B = backend.start()
      B:connect_render()
      sb = render.sandboxes.create {}:keep()
      work = proc.run({ "mktemp", "-d", "/tmp/moonbox-files-calls.XXXXXX" }).stdout:gsub("%s+$", "")
    end))
    teardown(T.async(function()
      if sb then sb:terminate() end
      if B then B:destroy() end
      if work then L.remove_tree(work) end
    end))
    body(function() return sb end, function() return work end, backend.commands)
  end)
end
