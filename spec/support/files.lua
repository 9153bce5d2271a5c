--- spec/support/files.lua — the small file chores specs repeat: read a file whole, write one,
-- ask whether a path exists, drain a process's stdout, run a shell command, own a temp dir.
-- Reading goes through moonbox.path's read_file, so a spec's notion of "the file's content" is
-- the program's own.
local proc = require "moonbox.proc"
local read_file = require("moonbox.path").read_file

local M = {}

--- files.read(path) -> the whole content of path, or nil when it cannot be opened.
M.read = read_file

--- files.listdir(path) -> the names in directory path, sorted; {} when it cannot be listed
-- (gone, not a directory).
function M.listdir(path)
  local ok, names = pcall(require("moonbox.sys").listdir, path)
  if not ok then return {} end
  table.sort(names)
  return names
end

--- files.must_read(path) -> the whole content of path; raises naming path when it cannot be
-- opened (a file the spec itself expects to be there).
function M.must_read(path)
  local s = read_file(path)
  if s == nil then error("cannot open " .. path, 2) end
  return s
end

--- files.write(path, data, mode): (re)writes path with data, byte for byte; with mode (an octal
-- string such as "0600") chmods it afterwards. Raises when it cannot be opened.
function M.write(path, data, mode)
  local f = assert(io.open(path, "wb"))
  f:write(data)
  f:close()
  if mode then
    local r = proc.run { "chmod", mode, path }
    assert(r.code == 0, "chmod " .. mode .. " " .. path .. ": " .. r.stderr)
  end
end

--- files.exists(path) -> whether path can be opened for reading (a dangling symlink: false).
function M.exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

--- files.drain(p, stream) -> all that process p writes on stream ("stdout" by default) until it
-- closes it. [yields]
function M.drain(p, stream)
  stream = stream or "stdout"
  local parts = {}
  for chunk in function() return p:read(stream) end do parts[#parts + 1] = chunk end
  return table.concat(parts)
end

--- files.run_tag() -> "<time>-<random>": a tag that sets this spec run's names (state
-- directories, secrets) apart from another run's on the same machine.
function M.run_tag()
  return string.format("%d-%d", os.time(), math.random(1e6))
end

--- files.sh(cmd) -> the stdout of shell command cmd, run through io.popen: blocks the loop, for
-- the specs that do not run on it (plain `it` functions).
function M.sh(cmd)
  local p = assert(io.popen(cmd))
  local out = p:read("a")
  p:close()
  return out
end

--- files.temp_dir(setup, teardown, name, ready): a private directory for a spec file, through
-- its busted setup and teardown (pass them: a support module does not see a spec's
-- environment): setup makes /tmp/moonbox-NAME-spec.XXXXXX and hands its path to ready(dir);
-- teardown removes it and all in it. Neither yields.
function M.temp_dir(setup, teardown, name, ready)
  local dir
  setup(function()
    dir = M.sh("mktemp -d /tmp/moonbox-" .. name .. "-spec.XXXXXX"):gsub("%s+$", "")
    assert(dir:match("^/tmp/moonbox%-"), "mktemp failed for " .. name)
    ready(dir)
  end)
  teardown(function()
    if dir and dir:match("^/tmp/moonbox%-") then os.execute("rm -rf " .. dir) end
  end)
end

return M
