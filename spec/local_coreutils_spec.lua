-- moonbox.local.engine.coreutils (mkdir/rm/mv in pure Lua over an abstract file system, for the
-- dry run's simulated engine) against the host's real GNU coreutils: the same argv sequences
-- run on a small table-backed file system (a test double of our own interface, written here)
-- and, in the C locale, in a temp directory on the host; each step must give the same exit
-- status and the same stderr, and each sequence must leave the same tree.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local coreutils = require "moonbox.local.engine.coreutils"

-- ---- the table-backed file system ---------------------------------------------------------------

local function parent(p) return p:match("^(.*)/[^/]*$") ~= "" and p:match("^(.*)/[^/]*$") or "/" end

--- new_fs() -> a file system with "/" only: nodes keyed by absolute path. readonly[path] = true
-- makes mkdir/remove/rename inside that directory fail with EACCES.
local function new_fs()
  local fs = { nodes = { ["/"] = { type = "directory", size = 0, mtime = 0 } }, readonly = {} }
  function fs:lstat(p) return self.nodes[p] end
  function fs:children(p)
    local out, prefix = {}, p == "/" and "/" or p .. "/"
    for k in pairs(self.nodes) do
      if k ~= p and k:sub(1, #prefix) == prefix and not k:sub(#prefix + 1):find("/") then
        out[#out + 1] = k:sub(#prefix + 1)
      end
    end
    return out
  end
  local function check_parent(self, p)
    local d = self.nodes[parent(p)]
    if not d then return nil, "ENOENT" end
    if d.type ~= "directory" then return nil, "ENOTDIR" end
    if self.readonly[parent(p)] then return nil, "EACCES" end
    return true
  end
  function fs:mkdir(p)
    local ok, e = check_parent(self, p)
    if not ok then return nil, e end
    if self.nodes[p] then return nil, "EEXIST" end
    self.nodes[p] = { type = "directory", size = 0, mtime = 1 }
    return true
  end
  function fs:remove(p)
    local ok, e = check_parent(self, p)
    if not ok then return nil, e end
    local n = self.nodes[p]
    if not n then return nil, "ENOENT" end
    if n.type == "directory" and #self:children(p) > 0 then return nil, "ENOTEMPTY" end
    self.nodes[p] = nil
    return true
  end
  function fs:rename(from, to)
    local ok, e = check_parent(self, to)
    if not ok then return nil, e end
    ok, e = check_parent(self, from)
    if not ok then return nil, e end
    if self.nodes[to] then return nil, "EEXIST" end
    local moved = {}
    for k, v in pairs(self.nodes) do
      if k == from or k:sub(1, #from + 1) == from .. "/" then moved[to .. k:sub(#from + 1)] = v; self.nodes[k] = nil end
    end
    for k, v in pairs(moved) do self.nodes[k] = v end
    return true
  end
  return fs
end

-- ---- the same tree on both sides -------------------------------------------------------------------

local CWD = "/w" -- the simulated working directory; on the host, a fresh temp dir

-- The starting tree: {kind, relative path, link target}.
local TREE = {
  { "dir", "d" }, { "file", "d/x" }, { "dir", "e" }, { "dir", "g" }, { "file", "g/y" }, { "file", "f" },
  { "link", "la", "d" }, { "link", "dangling", "nowhere" }, { "link", "lf", "f" },
}

local function build_sim()
  local fs = new_fs()
  fs.nodes[CWD] = { type = "directory", size = 0, mtime = 0 }
  for _, e in ipairs(TREE) do
    local p = CWD .. "/" .. e[2]
    if e[1] == "dir" then fs.nodes[p] = { type = "directory", size = 0, mtime = 0 }
    elseif e[1] == "file" then fs.nodes[p] = { type = "file", size = 1, mtime = 0 }
    else fs.nodes[p] = { type = "symlink", size = 0, mtime = 0, target = e[3] } end
  end
  return fs
end

local function build_host()
  local dir = proc.run({ "mktemp", "-d", "/tmp/moonbox-coreutils-spec.XXXXXX" }).stdout:gsub("%s+$", "")
  for _, e in ipairs(TREE) do
    local argv = e[1] == "dir" and { "mkdir", "--", e[2] } or e[1] == "file" and { "sh", "-c", 'printf x > "$1"',
      "sh", e[2] } or { "ln", "-s", "--", e[3], e[2] }
    argv.cwd = dir
    assert(proc.run(argv).code == 0)
  end
  return dir
end

local TYPE = { d = "directory", f = "file", l = "symlink" }

--- The host tree under dir as sorted "path type target" records (NUL-safe: find's %P fields).
local function host_tree(dir)
  local r = proc.run { "find", ".", "-mindepth", "1", "-printf", "%P\\0%y\\0%l\\0", cwd = dir }
  local f, out = {}, {}
  for field in r.stdout:gmatch("([^%z]*)%z") do f[#f + 1] = field end
  for i = 1, #f - 2, 3 do out[#out + 1] = f[i] .. " " .. (TYPE[f[i + 1]] or f[i + 1]) .. " " .. f[i + 2] end
  table.sort(out)
  return out
end

local function sim_tree(fs)
  local out = {}
  for k, v in pairs(fs.nodes) do
    if k:sub(1, #CWD + 1) == CWD .. "/" then
      out[#out + 1] = k:sub(#CWD + 2) .. " " .. v.type .. " " .. (v.target or "")
    end
  end
  table.sort(out)
  return out
end

--- Runs each argv of steps on a fresh simulated tree and a fresh host tree; asserts the same
-- (exit status, stderr) step by step and the same tree at the end.
local function same_as_host(steps)
  local fs, dir = build_sim(), build_host()
  for _, argv in ipairs(steps) do
    local handled, code, stdout, stderr = coreutils.run(fs, argv, CWD)
    local host = { table.unpack(argv) }
    host.cwd, host.env = dir, { LC_ALL = "C", LANG = "C" }
    local r = proc.run(host)
    local what = table.concat(argv, " ")
    assert.is_true(handled, what)
    assert.are.same({ r.code, r.stdout, r.stderr }, { code, stdout, stderr }, what)
  end
  assert.are.same(host_tree(dir), sim_tree(fs), "the trees differ after the sequence")
  proc.run { "rm", "-rf", "--", dir }
end

-- One name per byte class a path may hold, and the names whose quoting coreutils treats
-- specially.
local HOSTILE = { "two words", "it's", 'say "hi"', "$(x)", "back\\slash", "new\nline", "-rf", "caf\233",
  "*?[a]", "a'b c", "'", "''", "\n\n", "a\1\2b", "a'\255", "ab'cd\255", "\255'", "tab\there", "a'b$c",
  "del\127", "x~", "#x" }

describe("coreutils.run against the host's coreutils", function()
  it("mkdir -- P", T.async(function()
    same_as_host { { "mkdir", "--", "d" }, { "mkdir", "--", "f" }, { "mkdir", "--", "no/x" },
      { "mkdir", "--", "f/x" }, { "mkdir", "--", "dangling" }, { "mkdir", "--", "la/new" },
      { "mkdir", "--", "new" }, { "mkdir", "--", "new" }, { "mkdir", "--", "lf/x" }, { "mkdir", "--", "." } }
  end))

  it("mkdir -p -- P", T.async(function()
    same_as_host { { "mkdir", "-p", "--", "f" }, { "mkdir", "-p", "--", "f/x" }, { "mkdir", "-p", "--", "dangling" },
      { "mkdir", "-p", "--", "dangling/x" }, { "mkdir", "-p", "--", "lf" }, { "mkdir", "-p", "--", "lf/x" },
      { "mkdir", "-p", "--", "la" }, { "mkdir", "-p", "--", "la/n/m" }, { "mkdir", "-p", "--", "a/b/c" },
      { "mkdir", "-p", "--", "d/x/y" }, { "mkdir", "-p", "--", "a/b" }, { "mkdir", "-p", "--", "." } }
  end))

  it("rm -d -- P", T.async(function()
    same_as_host { { "rm", "-d", "--", "nope" }, { "rm", "-d", "--", "d" }, { "rm", "-d", "--", "f/x" },
      { "rm", "-d", "--", "no/x" }, { "rm", "-d", "--", "e" }, { "rm", "-d", "--", "e" }, { "rm", "-d", "--", "la" },
      { "rm", "-d", "--", "dangling" }, { "rm", "-d", "--", "f" }, { "rm", "-d", "--", "d/x" } }
  end))

  it("rm -r -- P", T.async(function()
    same_as_host { { "rm", "-r", "--", "nope" }, { "rm", "-r", "--", "f/x" }, { "rm", "-r", "--", "lf" },
      { "rm", "-r", "--", "la" }, { "rm", "-r", "--", "." }, { "rm", "-r", "--", "d/.." },
      { "rm", "-r", "--", "g" }, { "rm", "-r", "--", "d" }, { "rm", "-r", "--", "f" } }
  end))

  it("mv -T -- A B", T.async(function()
    same_as_host { { "mv", "-T", "--", "nope", "z" }, { "mv", "-T", "--", "d", "f" }, { "mv", "-T", "--", "f", "d" },
      { "mv", "-T", "--", "e", "g" }, { "mv", "-T", "--", "f", "no/z" }, { "mv", "-T", "--", "d", "d/sub" },
      { "mv", "-T", "--", "f", "f/x" }, { "mv", "-T", "--", "f", "f" }, { "mv", "-T", "--", "nope/x", "z" },
      { "mv", "-T", "--", "d", "e" }, { "mv", "-T", "--", "f", "g/y" }, { "mv", "-T", "--", "la", "lb" },
      { "mv", "-T", "--", "g", "moved" } }
  end))

  it("quotes every hostile name as coreutils does, in messages of each command", T.async(function()
    local steps = {}
    for i, name in ipairs(HOSTILE) do
      local other = "other" .. i
      for _, argv in ipairs {
        { "mkdir", "--", name }, { "mkdir", "--", name }, { "mkdir", "-p", "--", name .. "/in" },
        { "rm", "-d", "--", name .. "/missing" }, { "mv", "-T", "--", name, other },
        { "mv", "-T", "--", name, other }, { "rm", "-d", "--", other }, { "rm", "-r", "--", other },
        { "mkdir", "--", "f/" .. name },
      } do steps[#steps + 1] = argv end
    end
    same_as_host(steps)
  end))
end)

describe("coreutils.run on its own", function()
  it("leaves other commands to its caller and argv outside the subset, doing nothing", function()
    local fs = build_sim()
    assert.is_false((coreutils.run(fs, { "ls", "-l" }, CWD)))
    assert.is_false((coreutils.run(fs, { "rmdir", "d" }, CWD)))
    local before = sim_tree(fs)
    for _, argv in ipairs { { "rm", "-rf", "--", "d" }, { "mkdir", "d2" }, { "mv", "f", "g" },
      { "rm", "-d", "--", "a", "b" }, { "mkdir", "-p", "d3" } } do
      assert.is_false((coreutils.run(fs, argv, CWD)), table.concat(argv, " "))
    end
    assert.are.same(before, sim_tree(fs))
  end)

  it("answers EACCES from the file system with coreutils' Permission denied", function()
    local fs = build_sim()
    fs.readonly[CWD .. "/d"] = true
    local cases = {
      { { "mkdir", "--", "d/new" }, "mkdir: cannot create directory 'd/new': Permission denied\n" },
      { { "mkdir", "-p", "--", "d/new/x" }, "mkdir: cannot create directory 'd/new': Permission denied\n" },
      { { "rm", "-d", "--", "d/x" }, "rm: cannot remove 'd/x': Permission denied\n" },
      { { "rm", "-r", "--", "d" }, "rm: cannot remove 'd/x': Permission denied\n" },
      { { "mv", "-T", "--", "d/x", "moved" }, "mv: cannot move 'd/x' to 'moved': Permission denied\n" },
    }
    for _, c in ipairs(cases) do
      local handled, code, stdout, stderr = coreutils.run(fs, c[1], CWD)
      assert.are.same({ true, 1, "", c[2] }, { handled, code, stdout, stderr }, table.concat(c[1], " "))
    end
    assert.are.equal("file", fs:lstat(CWD .. "/d/x").type)
  end)

  it("resolves relative paths under /root by default and absolute ones from /", function()
    local fs = new_fs()
    local handled, code, _, stderr = coreutils.run(fs, { "mkdir", "--", "x" })
    assert.are.same({ true, 1, "mkdir: cannot create directory 'x': No such file or directory\n" },
      { handled, code, stderr })
    assert(fs:mkdir("/root"))
    assert.are.equal(0, select(2, coreutils.run(fs, { "mkdir", "--", "x" })))
    assert.are.equal("directory", fs:lstat("/root/x").type)
    assert.are.equal(0, select(2, coreutils.run(fs, { "mkdir", "-p", "--", "/srv/a/b" })))
    assert.are.equal("directory", fs:lstat("/srv/a/b").type)
    _, code, _, stderr = coreutils.run(fs, { "rm", "-r", "--", "/" })
    assert.are.equal(1, code)
    assert.are.equal("rm: it is dangerous to operate recursively on '/'\n" ..
      "rm: use --no-preserve-root to override this failsafe\n", stderr)
    assert.are.equal("directory", fs:lstat("/srv/a/b").type)
  end)
end)
