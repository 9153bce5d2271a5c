-- moonbox.render files against a real `moonbox local`: whole files (sb:read/sb:write) and copies
-- (sb:copy_in/sb:copy_out of a file and of a tree), path normalisation (seen in the backend's
-- journal), typed errors, the listing, the old names refused, and a hostile tarball refused on
-- copy_out without writing anything. spec/render_files_calls_spec.lua covers every call with
-- hostile names on each backend.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local render = require "moonbox.render"
local files = require "spec.support.files"
local L = require "spec.support.local_backend"
local runs = require "spec.support.runs"

local B, sb, work

local run = T.async

local function sh(script, ...)
  local r = proc.run { script, ..., shell = true }
  assert(r.code == 0, "shell failed: " .. script .. "\n" .. r.stderr)
  return r.stdout
end

local read = files.must_read
local write = files.write

local function journal_mark() return runs.last_seq(B) end

--- The file-token requests made since `seq`: {kind, path} each.
local function token_requests_since(seq)
  local out = {}
  for _, e in ipairs(runs.journal(B, seq)) do
    local kind = e.path:match("/files/(%a+)/token$")
    if kind then
      local q = e.query
      local p = type(q) == "table" and q.path or nil
      if type(q) == "string" then
        p = (q:match("path=([^&]*)") or ""):gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end)
      end
      out[#out + 1] = { kind = kind, path = p }
    end
  end
  return out
end

-- Every byte value, NULs and 0xFF runs included.
local BINARY = (function()
  local t = {}
  for i = 0, 255 do t[#t + 1] = string.char(i) end
  return "\0\0\255\255" .. table.concat(t) .. string.rep("\0\255", 5000) .. "end\0"
end)()

L.fixture(setup, teardown, function(b)
  B, sb = b, render.sandboxes.create {}:keep()
  return function() sb:terminate() end
end)
setup(run(function()
  work = proc.run({ "mktemp", "-d", "/tmp/moonbox-files-spec.XXXXXX" }).stdout:gsub("%s+$", "")
end))
teardown(run(function()
  if work then L.remove_tree(work) end
end))

describe("render.normalize_path", function()
  it("cleans paths as Go's path.Clean does", function()
    local cases = {
      ["/app/data/"] = "/app/data", ["workspace//x"] = "workspace/x", ["workspace/"] = "workspace",
      ["/app/./data/../data.txt"] = "/app/data.txt", ["//app/x"] = "/app/x", ["."] = ".",
      ["a/.."] = ".", ["/.."] = "/", ["/"] = "/", ["../x"] = "../x", ["a/../../b"] = "../b",
      ["./a/./b/"] = "a/b", ["/app/data.txt"] = "/app/data.txt",
    }
    for input, want in pairs(cases) do
      assert.are.equal(want, render.normalize_path(input), "for " .. input)
    end
  end)

  it("refuses an empty path with invalid_path", function()
    T.errors_with("invalid_path", render.normalize_path, "")
  end)
end)

describe("sandbox files", function()
  it("round-trips binary bytes through write and read", T.async(function()
    sb:write("/tmp/bin.dat", BINARY)
    assert.are.equal(BINARY, sb:read("/tmp/bin.dat"))
    assert.are.equal(tostring(#BINARY) .. "\n", sb:exec("stat -c %s /tmp/bin.dat"):check().stdout)
  end))

  it("round-trips binary bytes through copy_in and copy_out of a file, leaving no temp file", T.async(function()
    local dir = work .. "/files"
    sh('mkdir -p "$1"', dir)
    write(dir .. "/in.bin", BINARY)
    sb:copy_in("bin2.dat", dir .. "/in.bin") -- relative: under the home directory
    assert.are.equal(BINARY, sb:read("/root/bin2.dat"))
    write(dir .. "/out.bin", "old contents")
    sb:copy_out("bin2.dat", dir .. "/out.bin")
    assert.are.equal(BINARY, read(dir .. "/out.bin"))
    assert.are.equal("in.bin\nout.bin\n", sh('ls -A "$1"', dir))
  end))

  it("sends normalised paths in the token requests", T.async(function()
    sb:exec("mkdir -p /tmp/norm/data"):check()
    local mark = journal_mark()
    sb:write("/tmp/norm/./data/../data.txt", "x")
    assert.are.equal("x", sb:read("//tmp/norm//data.txt"))
    sb:write("norm-rel//a.txt", "r")
    assert.are.equal("r", sb:exec("cat /root/norm-rel/a.txt"):check().stdout)
    assert.are.same({
      { kind = "upload", path = "/tmp/norm/data.txt" },
      { kind = "download", path = "/tmp/norm/data.txt" },
      { kind = "upload", path = "norm-rel/a.txt" },
    }, token_requests_since(mark))
  end))

  it("refuses an empty path before any request", T.async(function()
    local mark = journal_mark()
    T.errors_with("invalid_path", sb.write, sb, "", "x")
    T.errors_with("invalid_path", sb.read, sb, "")
    T.errors_with("invalid_path", sb.copy_out, sb, "", work .. "/never")
    T.errors_with("invalid_path", sb.copy_in, sb, "", work)
    T.errors_with("invalid_path", sb.ls, sb, "")
    T.errors_with("invalid_path", sb.stat, sb, "a\0b")
    T.errors_with("invalid_path", sb.exists, sb, "")
    T.errors_with("invalid_path", sb.remove, sb, "")
    T.errors_with("invalid_path", sb.mkdir, sb, "x\0")
    T.errors_with("invalid_path", sb.rename, sb, "/tmp/a", "")
    assert.are.same({}, token_requests_since(mark))
    local _, entries = B:req("GET", "/_moonbox/journal", { query = { since = mark } })
    for _, e in ipairs(entries) do assert.is_nil(e.path:find("/files/", 1, true), e.path) end
    assert.is_false(io.open(work .. "/never") ~= nil)
  end))

  it("raises not_found naming the path and the sandbox for a missing file", T.async(function()
    local err = T.errors_with("not_found", sb.read, sb, "/tmp/no/such/file")
    assert.are.equal(404, err.status)
    assert.are.equal(sb.id, err.sandbox_id)
    assert.matches("/tmp/no/such/file", err.message, 1, true)
    assert.matches(sb.id, err.message, 1, true)
    local target = work .. "/missing.bin"
    T.errors_with("not_found", sb.copy_out, sb, "/tmp/no/such/file", target)
    assert.is_nil(io.open(target))
    assert.are.equal("", sh('ls -A "$1" | grep moonbox || true', work))
    T.errors_with("not_found", sb.copy_out, sb, "/tmp/no/such/dir", work .. "/missing-dir")
    assert.is_nil(io.open(work .. "/missing-dir"))
    T.errors_with("not_found", sb.ls, sb, "/tmp/no/such/dir")
  end))

  it("refuses a read of a directory; copy_out tells a file from a directory by the answer", T.async(function()
    sb:exec("mkdir -p /tmp/adir && echo f > /tmp/afile && echo g > /tmp/adir/g"):check()
    T.errors_with("is_a_directory", sb.read, sb, "/tmp/adir")
    sb:copy_out("/tmp/afile", work .. "/afile-copy")
    assert.are.equal("f\n", read(work .. "/afile-copy"))
    sb:copy_out("/tmp/adir", work .. "/adir-copy")
    assert.are.equal("g\n", read(work .. "/adir-copy/g"))
  end))

  it("refuses the old names with the new call and its argument order", T.async(function()
    for old, new in pairs({ upload = "sb:write(path, data)", download = "sb:read(path)",
      upload_file = "sb:copy_in(path, local_path)", put_dir = "sb:copy_in(path, local_dir)",
      download_file = "sb:copy_out(path, local_path)", get_dir = "sb:copy_out(path, local_dir)" }) do
      local ok, err = pcall(function() sb[old](sb, "/tmp/x", "y") end)
      assert.is_false(ok)
      assert.matches("sb:" .. old .. " was renamed: use " .. new, tostring(err), 1, true)
      assert.matches("render_files_spec.lua:%d+", tostring(err))
    end
    local ok, err = pcall(function() sb:ls("/tmp", 0) end)
    assert.is_false(ok)
    assert.matches("sb:ls: depth is an option now: sb:ls(path, { depth = 0 })", tostring(err), 1, true)
  end))
end)

describe("sandbox directory trees", function()
  it("round-trips nested dirs, binary files and a relative symlink through copy_in and copy_out", T.async(function()
    local src = work .. "/tree"
    sh([[mkdir -p "$1/a/b/c" "$1/empty" && printf 'top\n' > "$1/top.txt" && ln -s a/b/c "$1/link" &&
      printf 'deep' > "$1/a/b/c/deep.txt"]], src)
    write(src .. "/a/bin.dat", BINARY)
    sb:copy_in("/srv/tree/", src)
    assert.are.equal("/srv/tree/a/b/c\n", sb:exec("readlink -f /srv/tree/link"):check().stdout)
    local back = work .. "/tree-back"
    sb:copy_out("/srv/tree", back)
    local d = proc.run { "diff", "-r", "--no-dereference", src, back }
    assert.are.equal(0, d.code, d.stdout .. d.stderr)
    assert.are.equal("a/b/c\n", sh('readlink "$1/link"', back))
    T.errors_with("target_exists", sb.copy_out, sb, "/srv/tree", back)
    sb:exec("echo new > /srv/tree/new.txt"):check()
    sb:copy_out("/srv/tree", back, { merge = true })
    assert.are.equal("new\n", read(back .. "/new.txt"))
    assert.are.equal(BINARY, read(back .. "/a/bin.dat"))
  end))

  it("lists a directory's entries with type, size, time and link target", T.async(function()
    sb:exec("mkdir -p /srv/ls/sub && printf 12345 > /srv/ls/f.txt && ln -s sub /srv/ls/cur"):check()
    local entries, second = sb:ls("/srv/ls/")
    assert.is_nil(second, "sb:ls returns one value")
    local by = {}
    for _, e in ipairs(entries) do by[e.name] = e end
    assert.are.same({ name = "f.txt", type = "file", size = 5, modified_at = by["f.txt"].modified_at },
      by["f.txt"])
    assert.matches("^%d%d%d%d%-%d%d%-%d%dT", by["f.txt"].modified_at)
    assert.are.equal("directory", by.sub.type)
    assert.are.equal("symlink", by.cur.type)
    assert.are.equal("sub", by.cur.target)
    assert.is_nil(by.sub.target)
    local self_entry = sb:ls("/srv/ls/f.txt", { depth = 0 })
    assert.are.equal(1, #self_entry)
    assert.are.equal(5, self_entry[1].size)
  end))

  it("refuses a tarball with a symlink escaping the tree and writes nothing", T.async(function()
    sb:exec("mkdir -p /srv/hostile && ln -s /etc /srv/hostile/evil && echo ok > /srv/hostile/file"):check()
    local root = work .. "/hostile-root"
    sh('mkdir -p "$1"', root)
    local before = sh('ls -A "$1"', work)
    local target = root .. "/out"
    local err = T.errors_with("unsafe_archive", sb.copy_out, sb, "/srv/hostile", target)
    assert.are.equal("evil", err.member)
    assert.are.equal(sb.id, err.sandbox_id)
    assert.is_nil(io.open(target))
    assert.are.equal("", sh('ls -A "$1"', root)) -- no staging directory left either
    assert.are.equal(before, sh('ls -A "$1"', work)) -- nothing beside it either
  end))
end)
