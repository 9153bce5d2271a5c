-- Pins moonbox.archive: gzip'd tar of directory trees packed and unpacked on worker threads,
-- round trips that keep the tree identical, the unpack safety rules (each hostile member refused
-- by name with nothing written outside the target), limits, corrupt input, merge semantics,
-- modes, and that the loop keeps running and cancellation leaves no partial output.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local proc = require "moonbox.proc"
local archive = require "moonbox.archive"
local files = require "spec.support.files"
local ustar = require "spec.support.ustar"

local O600, O644, O755, O777 = tonumber("600", 8), tonumber("644", 8), tonumber("755", 8),
  tonumber("777", 8)

-- Runs a shell script ($1, $2, ... are the extra arguments) and returns its stdout.
local function sh(script, ...)
  local r = proc.run { script, ..., shell = true }
  assert(r.code == 0, ("shell script failed (%s): %s\n%s"):format(tostring(r.code), script, r.stderr))
  return r.stdout
end

local function exists(path)
  return proc.run { '[ -e "$1" ] || [ -L "$1" ]', path, shell = true }.code == 0
end

local read_file = files.must_read
local write_file = files.write

-- "<mode> <uid> <gid>" of path, not following a symlink.
local function stat(path) return (sh('stat -c "%a %u %g" "$1"', path):gsub("\n$", "")) end

-- A fresh directory under /tmp (short, so absolute member names fit a ustar header) and a
-- guard that removes it.
local function scratch()
  local dir = sh("mktemp -d /tmp/mbarch.XXXXXX"):gsub("\n$", "")
  return dir, setmetatable({}, { __close = function() proc.run { "rm", "-rf", dir } end })
end

-- Every entry of the tree at dir: path, type, mode and link target, sorted.
local function listing(dir)
  return sh([[cd "$1" && find . -mindepth 1 -printf '%P %y %m %l\n' | LC_ALL=C sort]], dir)
end

-- Names in dir left behind by a pack (".x.partial-*") or an unpack (".x.moonbox-staging-*").
local function leftovers(dir)
  local found = {}
  for name in sh('ls -A "$1"', dir):gmatch("[^\n]+") do
    if name:find("%.partial%-") or name:find("%.moonbox%-staging%-") then found[#found + 1] = name end
  end
  return found
end

local errors_with = T.errors_with

-- Waits until no archive worker runs (a cancelled one may still be removing its output).
local function wait_workers_idle()
  local deadline = task.now() + 10
  while archive.live_count() > 0 and task.now() < deadline do task.sleep(0.01) end
  assert.are.equal(0, archive.live_count())
end

-- Writes a tar of members no well-behaved tar would produce (spec/support/ustar.lua: m: name,
-- type, link, data, mode, uid, gid, major, minor).
local function write_tar(path, members) write_file(path, ustar.archive(members)) end

-- Packs the tree the shell snippet make_src writes below "$1/src" (base/src, made empty first)
-- into base/name (archive.pack opts); returns the archive's bytes.
local function packed(base, make_src, name, opts)
  sh('mkdir "$1/src" && ' .. make_src, base)
  archive.pack(base .. "/src", base .. "/" .. name, opts)
  return read_file(base .. "/" .. name)
end

-- s with its byte at (1-based) position at changed (plus one, mod 256).
local function flipped(s, at) return s:sub(1, at - 1) .. string.char((s:byte(at) + 1) % 256) .. s:sub(at + 1) end

-- A tree with nested directories, binary, empty and UTF-8-named files, relative symlinks
-- (one dangling), a hard link and an empty directory.
local function make_tree(dir)
  sh([[
    set -e
    mkdir -p "$1/a/b/c" "$1/empty" "$1/x y"
    printf 'hello\n' > "$1/top.txt"
    head -c 300000 /dev/urandom > "$1/a/b/c/blob.bin"
    : > "$1/a/empty.txt"
    printf 'w' > "$1/x y/héllo wörld.txt"
    chmod 755 "$1/a/b"
    chmod 640 "$1/top.txt"
    ln -s ../../top.txt "$1/a/b/up"
    ln -s c/blob.bin "$1/a/b/down"
    ln -s nowhere "$1/dangling"
    ln "$1/top.txt" "$1/a/hard"
  ]], dir)
end

describe("archive.pack and archive.unpack", function()
  it("round-trip a tree into an identical tree", T.async(function()
    local base, _g <close> = scratch()
    make_tree(base .. "/src")
    local refs = T.refs()
    local p = archive.pack(base .. "/src", base .. "/t.tgz")
    assert.are.same({ entries = 13, bytes = 6 + 300000 + 1, skipped = 0 }, p)
    local u = archive.unpack(base .. "/t.tgz", base .. "/dst")
    assert.are.same({ entries = 13, bytes = 6 + 300000 + 1 }, u)
    sh('diff -r --no-dereference "$1/src" "$1/dst"', base)
    assert.are.equal(listing(base .. "/src"), listing(base .. "/dst"))
    assert.are.equal(sh('stat -c %i "$1/dst/top.txt"', base), sh('stat -c %i "$1/dst/a/hard"', base))
    assert.are.same({}, leftovers(base))
    assert.are.equal(refs, T.refs())
  end))

  it("stores names relative to src_dir, symlinks as symlinks and hard links as links",
    T.async(function()
      local base, _g <close> = scratch()
      make_tree(base .. "/src")
      archive.pack(base .. "/src", base .. "/t.tgz")
      local by_name = {}
      for _, m in ipairs(archive.list(base .. "/t.tgz")) do
        assert.is_nil(m.name:find("^%./"), m.name)
        assert.is_nil(m.name:find("^/"), m.name)
        by_name[m.name] = m
      end
      assert.are.same({ name = "a/b/up", type = "symlink", size = 0, mode = O777, target = "../../top.txt" },
        by_name["a/b/up"])
      assert.are.equal("directory", by_name["empty"].type)
      assert.are.equal(300000, by_name["a/b/c/blob.bin"].size)
      -- the walk is sorted, so "a/hard" comes first and carries the data
      assert.are.same({ "file", "hardlink", "a/hard" },
        { by_name["a/hard"].type, by_name["top.txt"].type, by_name["top.txt"].target })
      -- what GNU tar reads back
      local names = sh('tar --quoting-style=literal -tzf "$1/t.tgz" | LC_ALL=C sort', base)
      assert.matches("\na/b/c/blob.bin\n", "\n" .. names)
      assert.matches("\nx y/héllo wörld.txt\n", "\n" .. names)
    end))

  it("interoperates with GNU tar in both directions", T.async(function()
    local base, _g <close> = scratch()
    make_tree(base .. "/src")
    sh('tar -czf "$1/gnu.tgz" -C "$1/src" .', base) -- "./"-prefixed names and a "./" member
    archive.unpack(base .. "/gnu.tgz", base .. "/from_gnu")
    sh('diff -r --no-dereference "$1/src" "$1/from_gnu"', base)
    assert.are.equal(listing(base .. "/src"), listing(base .. "/from_gnu"))
    archive.pack(base .. "/src", base .. "/ours.tgz")
    sh('mkdir "$1/by_gnu" && tar -xzf "$1/ours.tgz" -C "$1/by_gnu"', base)
    sh('diff -r --no-dereference "$1/src" "$1/by_gnu"', base)
  end))

  it("skips devices, fifos and sockets and counts them", T.async(function()
    local base, _g <close> = scratch()
    sh('mkdir "$1/src" && echo x > "$1/src/f" && mkfifo "$1/src/fifo"', base)
    local specials = 1
    if proc.run { "mknod", base .. "/src/null", "c", "1", "3", stderr = "null" }.code == 0 then
      specials = specials + 1
    end
    local p = archive.pack(base .. "/src", base .. "/t.tgz")
    assert.are.equal(specials, p.skipped)
    assert.are.equal(1, p.entries)
    local members = archive.list(base .. "/t.tgz")
    assert.are.equal(1, #members)
    assert.are.equal("f", members[1].name)
  end))

  it("writes the archive 0600, or nothing at all when it fails", T.async(function()
    local base, _g <close> = scratch()
    make_tree(base .. "/src")
    archive.pack(base .. "/src", base .. "/t.tgz")
    assert.are.equal("600", stat(base .. "/t.tgz"):match("^%d+"))
    local err = errors_with("not_found", archive.pack, base .. "/missing", base .. "/u.tgz")
    assert.are.equal(base .. "/missing", err.path)
    assert.is_false(exists(base .. "/u.tgz"))
    errors_with("not_found", archive.pack, base .. "/src", base .. "/no/such/dir/u.tgz")
    errors_with("io_error", archive.pack, base .. "/src/top.txt", base .. "/u.tgz")
    assert.are.same({}, leftovers(base))
  end))

  it("leaves its own output out when it is written inside src_dir", T.async(function()
    local base, _g <close> = scratch()
    sh('mkdir "$1/src" && echo x > "$1/src/f"', base)
    archive.pack(base .. "/src", base .. "/src/self.tgz")
    local names = {}
    for _, m in ipairs(archive.list(base .. "/src/self.tgz")) do names[#names + 1] = m.name end
    assert.are.same({ "f" }, names)
  end))

  it("writes a plain tar with gzip = false, and unpack detects either", T.async(function()
    local base, _g <close> = scratch()
    make_tree(base .. "/src")
    archive.pack(base .. "/src", base .. "/t.tar", { gzip = false })
    assert.are.equal("ustar", read_file(base .. "/t.tar"):sub(258, 262))
    archive.unpack(base .. "/t.tar", base .. "/dst")
    sh('diff -r --no-dereference "$1/src" "$1/dst"', base)
  end))

  it("raises a usage error outside a task and for unknown options", function()
    local ok, err = pcall(archive.pack, "/tmp", "/tmp/x.tgz")
    assert.is_false(ok)
    assert.matches("archive.pack", tostring(err))
    T.run(function()
      ok, err = pcall(archive.unpack, "/tmp/x.tgz", "/tmp/y", { mergE = true })
      assert.is_false(ok)
      assert.matches("unknown option 'mergE'", tostring(err))
      ok, err = pcall(archive.unpack, "/tmp/x.tgz", "/tmp/y", { umask = 1000 })
      assert.is_false(ok)
      assert.matches("umask", tostring(err))
    end)
  end)
end)

describe("archive.unpack refuses unsafe archives", function()
  -- Unpacks the archive at tarf into <base>/out/target and checks the refusal: code, member
  -- named, no target, no staging directory left, and none of the sentinel paths created.
  local function refused(base, tarf, member, sentinels)
    sh('mkdir -p "$1/out"', base)
    local target = base .. "/out/target"
    local err = errors_with("unsafe_archive", archive.unpack, tarf, target)
    assert.are.equal(member, err.member, tostring(err))
    assert.are.equal(tarf, err.path)
    assert.matches(member, err.message, 1, true)
    assert.is_false(exists(target))
    assert.are.same({}, leftovers(base .. "/out"))
    for _, s in ipairs(sentinels or {}) do assert.is_false(exists(s), s .. " was written") end
    return err
  end

  it("refuses an absolute member name (GNU tar -P)", T.async(function()
    local base, _g <close> = scratch()
    sh('mkdir "$1/abs" && echo evil > "$1/abs/f" && tar -P -cf "$1/x.tar" "$1/abs/f" && rm -r "$1/abs"', base)
    refused(base, base .. "/x.tar", base .. "/abs/f", { base .. "/abs" })
  end))

  it("refuses ../evil and a/../../evil", T.async(function()
    local base, _g <close> = scratch()
    sh([[mkdir "$1/in" && echo evil > "$1/in/evil"
         tar -P --transform 's,^,../,' -cf "$1/up.tar" -C "$1/in" evil
         tar -P --transform 's,^,a/../../,' -cf "$1/deep.tar" -C "$1/in" evil]], base)
    local sentinels = { base .. "/out/evil", base .. "/evil" }
    refused(base, base .. "/up.tar", "../evil", sentinels)
    refused(base, base .. "/deep.tar", "a/../../evil", sentinels)
  end))

  it("refuses a symlink to an absolute path such as /etc", T.async(function()
    local base, _g <close> = scratch()
    local probe = "moonbox-evil-" .. base:match("[^.]+$")
    sh('mkdir "$1/in" && ln -s /etc "$1/in/etc" && tar -cf "$1/x.tar" -C "$1/in" etc', base)
    write_tar(base .. "/y.tar", {
      { name = "etc", type = "2", link = "/etc" },
      { name = "etc/" .. probe, data = "evil" },
    })
    local err = refused(base, base .. "/x.tar", "etc")
    assert.matches("absolute", err.message)
    refused(base, base .. "/y.tar", "etc", { "/etc/" .. probe })
  end))

  it("refuses link -> .. followed by link/evil, at the link", T.async(function()
    local base, _g <close> = scratch()
    write_tar(base .. "/x.tar", {
      { name = "link", type = "2", link = ".." },
      { name = "link/evil", data = "evil" },
    })
    local err = refused(base, base .. "/x.tar", "link", { base .. "/out/evil" })
    assert.matches("outside the target directory", err.message)
  end))

  it("refuses symlink targets that climb out or have '..' after a name", T.async(function()
    local base, _g <close> = scratch()
    write_tar(base .. "/deep.tar", {
      { name = "a/", type = "5", mode = O755 },
      { name = "a/l", type = "2", link = "../../x" },
    })
    refused(base, base .. "/deep.tar", "a/l")
    -- "d/../evil" reads as "evil" at the top, but with d -> . the kernel takes d/.. to the
    -- directory above the target
    write_tar(base .. "/zigzag.tar", {
      { name = "d", type = "2", link = "." },
      { name = "l", type = "2", link = "d/../evil" },
    })
    local err = refused(base, base .. "/zigzag.tar", "l")
    assert.matches("'..' after a name", err.message)
  end))

  it("refuses a member written through a symlink extracted before it", T.async(function()
    local base, _g <close> = scratch()
    write_tar(base .. "/x.tar", { -- "./" names as GNU tar writes them: errors name them as stored
      { name = "./sub/", type = "5", mode = O755 },
      { name = "./l", type = "2", link = "sub" }, -- a harmless link on its own
      { name = "./l/evil", data = "evil" },
    })
    local err = refused(base, base .. "/x.tar", "./l/evil")
    assert.matches("through the symlink 'l'", err.message)
  end))

  it("refuses hard links to /etc/passwd, outside the tree, or to no earlier member",
    T.async(function()
      local base, _g <close> = scratch()
      write_tar(base .. "/abs.tar", { { name = "h", type = "1", link = "/etc/passwd" } })
      refused(base, base .. "/abs.tar", "h")
      write_tar(base .. "/up.tar", { { name = "h", type = "1", link = "../x" } })
      refused(base, base .. "/up.tar", "h")
      write_tar(base .. "/none.tar", { { name = "h", type = "1", link = "etc/passwd" } })
      local err = refused(base, base .. "/none.tar", "h")
      assert.matches("not a file extracted before it", err.message)
    end))

  it("refuses a hard link that gives a symlink a new directory it escapes from",
    T.async(function()
      local base, _g <close> = scratch()
      write_tar(base .. "/x.tar", {
        { name = "a/", type = "5", mode = O755 },
        { name = "a/l", type = "2", link = "../top" }, -- inside, seen from a/
        { name = "h", type = "1", link = "a/l" }, -- the same text from the top escapes
      })
      refused(base, base .. "/x.tar", "h")
    end))

  it("refuses device nodes and fifos", T.async(function()
    local base, _g <close> = scratch()
    write_tar(base .. "/dev.tar", { { name = "null", type = "3", major = 1, minor = 3 } })
    local err = refused(base, base .. "/dev.tar", "null")
    assert.matches("character device", err.message)
    write_tar(base .. "/fifo.tar", { { name = "ok", data = "fine" }, { name = "p", type = "6" } })
    refused(base, base .. "/fifo.tar", "p")
  end))
end)

describe("archive.unpack limits and corrupt input", function()
  it("stops at max_bytes and max_entries with archive_too_large", T.async(function()
    local base, _g <close> = scratch()
    sh('mkdir -p "$1/src/d" && head -c 1000 /dev/zero > "$1/src/d/f"', base)
    archive.pack(base .. "/src", base .. "/t.tgz") -- two members: d, d/f
    local err = errors_with("archive_too_large", archive.unpack, base .. "/t.tgz", base .. "/a",
      { max_bytes = 999 })
    assert.are.equal("max_bytes", err.limit)
    assert.are.same({ entries = 2, bytes = 1000 },
      archive.unpack(base .. "/t.tgz", base .. "/b", { max_bytes = 1000 }))
    err = errors_with("archive_too_large", archive.unpack, base .. "/t.tgz", base .. "/c",
      { max_entries = 1 })
    assert.are.equal("max_entries", err.limit)
    archive.unpack(base .. "/t.tgz", base .. "/d", { max_entries = 2 })
    assert.is_false(exists(base .. "/a"))
    assert.is_false(exists(base .. "/c"))
    assert.are.same({}, leftovers(base))
    err = errors_with("archive_too_large", archive.list, base .. "/t.tgz", { max_entries = 1 })
    assert.are.equal("max_entries", err.limit)
  end))

  it("reports a damaged gzip stream, a truncated archive and garbage as corrupt_archive",
    T.async(function()
      local base, _g <close> = scratch()
      local good = packed(base, 'head -c 200000 /dev/urandom > "$1/src/r"', "t.tgz")
      write_file(base .. "/damaged.tgz", good:sub(1, 20) .. ("\255"):rep(64) .. good:sub(85))
      write_file(base .. "/short.tgz", good:sub(1, #good // 2))
      write_file(base .. "/garbage.tgz", ("not an archive\n"):rep(100))
      for _, name in ipairs { "damaged.tgz", "short.tgz", "garbage.tgz" } do
        errors_with("corrupt_archive", archive.unpack, base .. "/" .. name, base .. "/out")
        assert.is_false(exists(base .. "/out"))
      end
      errors_with("corrupt_archive", archive.list, base .. "/garbage.tgz")
      errors_with("corrupt_archive", archive.list, base .. "/short.tgz")
      errors_with("not_found", archive.unpack, base .. "/missing.tgz", base .. "/out")
      errors_with("not_found", archive.unpack, base .. "/t.tgz", base .. "/no/such/out")
      assert.are.same({}, leftovers(base))
    end))

  it("checks the gzip CRC: one flipped byte in stored file data is corrupt_archive",
    T.async(function()
      local base, _g <close> = scratch()
      local good = packed(base, 'head -c 300000 /dev/urandom > "$1/src/r"', "t.tgz")
      -- inside a stored (incompressible) block: inflate alone cannot tell
      write_file(base .. "/flip.tgz", flipped(good, 150001))
      local err = errors_with("corrupt_archive", archive.unpack, base .. "/flip.tgz", base .. "/out")
      assert.matches("incorrect data check", err.message)
      assert.is_false(exists(base .. "/out"))
      errors_with("corrupt_archive", archive.list, base .. "/flip.tgz")
      assert.are.same({}, leftovers(base))
    end))

  it("checks the gzip trailer even when the tar ends long before it", T.async(function()
    local base, _g <close> = scratch()
    packed(base, 'echo x > "$1/src/f"', "t.tar", { gzip = false })
    -- 1 MiB of zero blocks after the end-of-archive marker, as a large tar -b would leave
    sh('cd "$1" && { cat t.tar; head -c 1048576 /dev/zero; } | gzip > long.tgz', base)
    archive.unpack(base .. "/long.tgz", base .. "/ok")
    local good = read_file(base .. "/long.tgz")
    local crc_at = #good - 7 -- first byte of the CRC-32 in the trailer
    write_file(base .. "/badcrc.tgz", flipped(good, crc_at))
    errors_with("corrupt_archive", archive.unpack, base .. "/badcrc.tgz", base .. "/bad")
    assert.is_false(exists(base .. "/bad"))
  end))

  it("accepts concatenated gzip members and zero padding, refuses trailing garbage",
    T.async(function()
      local base, _g <close> = scratch()
      make_tree(base .. "/src")
      archive.pack(base .. "/src", base .. "/t.tar", { gzip = false })
      sh([[cd "$1" && head -c 100000 t.tar | gzip > two.tgz && tail -c +100001 t.tar | gzip >> two.tgz
           cp two.tgz padded.tgz && head -c 4096 /dev/zero >> padded.tgz
           cp two.tgz junk.tgz && echo junk >> junk.tgz]], base)
      archive.unpack(base .. "/two.tgz", base .. "/two")
      sh('diff -r --no-dereference "$1/src" "$1/two"', base)
      archive.unpack(base .. "/padded.tgz", base .. "/padded")
      local err = errors_with("corrupt_archive", archive.unpack, base .. "/junk.tgz", base .. "/junk")
      assert.matches("not gzip", err.message)
      assert.is_false(exists(base .. "/junk"))
    end))
end)

describe("archive.unpack into an existing directory", function()
  -- target holds keep.txt, a.txt, d/old.txt and lnk -> ../outside; the archive a.txt, d/new.txt
  -- and a directory lnk/ with a file.
  local function setup(base)
    sh([[set -e
      mkdir -p "$1/target/d" "$1/outside" "$1/src/d" "$1/src/lnk"
      echo keep > "$1/target/keep.txt"; echo old > "$1/target/a.txt"; echo old > "$1/target/d/old.txt"
      ln -s ../outside "$1/target/lnk"
      echo new > "$1/src/a.txt"; echo new > "$1/src/d/new.txt"; echo f > "$1/src/lnk/f"]], base)
    archive.pack(base .. "/src", base .. "/t.tgz")
  end

  it("refuses an existing target without merge and leaves it untouched", T.async(function()
    local base, _g <close> = scratch()
    setup(base)
    local before = listing(base .. "/target")
    local err = errors_with("target_exists", archive.unpack, base .. "/t.tgz", base .. "/target")
    assert.matches("merge = true", err.message)
    assert.are.equal(before, listing(base .. "/target"))
    assert.are.same({}, leftovers(base))
  end))

  it("merges: replaces files, merges directories, replaces symlinks without following them",
    T.async(function()
      local base, _g <close> = scratch()
      setup(base)
      archive.unpack(base .. "/t.tgz", base .. "/target", { merge = true })
      assert.are.equal("keep\n", read_file(base .. "/target/keep.txt"))
      assert.are.equal("new\n", read_file(base .. "/target/a.txt"))
      assert.are.equal("old\n", read_file(base .. "/target/d/old.txt"))
      assert.are.equal("new\n", read_file(base .. "/target/d/new.txt"))
      assert.are.equal("d", sh('stat -c %F "$1/target/lnk"', base):sub(1, 1)) -- a directory now
      assert.are.equal("f\n", read_file(base .. "/target/lnk/f"))
      assert.is_false(exists(base .. "/outside/f"))
      assert.are.same({}, leftovers(base))
    end))

  it("creates a missing target with merge = true as without it", T.async(function()
    local base, _g <close> = scratch()
    setup(base)
    archive.unpack(base .. "/t.tgz", base .. "/fresh", { merge = true })
    sh('diff -r "$1/src" "$1/fresh"', base)
  end))

  it("refuses to replace a directory by a file and changes nothing", T.async(function()
    local base, _g <close> = scratch()
    setup(base)
    sh('rm -r "$1/src/d" && echo file > "$1/src/d" && echo newer > "$1/src/a.txt"', base)
    archive.pack(base .. "/src", base .. "/conflict.tgz")
    local before = listing(base .. "/target")
    local err = errors_with("merge_conflict", archive.unpack, base .. "/conflict.tgz",
      base .. "/target", { merge = true })
    assert.are.equal("d", err.member)
    assert.are.equal(before, listing(base .. "/target"))
    assert.are.equal("old\n", read_file(base .. "/target/a.txt"))
    assert.are.same({}, leftovers(base))
  end))
end)

describe("archive.unpack modes and owners", function()
  local function modes_tar(path)
    write_tar(path, {
      { name = "d/", type = "5", mode = O777, uid = 1234, gid = 2345 },
      { name = "d/plain", mode = O644, data = "p", uid = 1234, gid = 2345 },
      { name = "d/exec", mode = O777, data = "x" },
      { name = "d/suid", mode = tonumber("4755", 8), data = "s" },
    })
  end

  it("keeps the archive's permission bits minus umask 022 and drops setuid", T.async(function()
    local base, _g <close> = scratch()
    modes_tar(base .. "/m.tar")
    archive.unpack(base .. "/m.tar", base .. "/out")
    local me = sh("id -u"):gsub("\n", "") .. " " .. sh("id -g"):gsub("\n", "")
    assert.are.equal("755 " .. me, stat(base .. "/out/d"))
    assert.are.equal("644 " .. me, stat(base .. "/out/d/plain"))
    assert.are.equal("755 " .. me, stat(base .. "/out/d/exec"))
    assert.are.equal("755 " .. me, stat(base .. "/out/d/suid"))
    assert.are.equal(("%o"):format(O755), stat(base .. "/out"):match("^%d+"))
  end))

  it("applies opts.umask and forces opts.file_mode on regular files", T.async(function()
    local base, _g <close> = scratch()
    modes_tar(base .. "/m.tar")
    archive.unpack(base .. "/m.tar", base .. "/u", { umask = tonumber("077", 8) })
    assert.are.equal("700", stat(base .. "/u/d"):match("^%d+"))
    assert.are.equal("600", stat(base .. "/u/d/plain"):match("^%d+"))
    assert.are.equal("700", stat(base .. "/u/d/exec"):match("^%d+"))
    archive.unpack(base .. "/m.tar", base .. "/f", { file_mode = O600 })
    assert.are.equal("755", stat(base .. "/f/d"):match("^%d+"))
    for _, name in ipairs { "plain", "exec", "suid" } do
      assert.are.equal("600", stat(base .. "/f/d/" .. name):match("^%d+"))
    end
  end))

  it("restores numeric owners only with owner = true (as root)", T.async(function()
    if sh("id -u") ~= "0\n" then
      -- Without root, owner = true is refused up front; the restoring itself cannot be pinned.
      local ok, err = pcall(archive.unpack, "/tmp/x", "/tmp/y", { owner = true })
      assert.is_false(ok)
      assert.matches("needs root", tostring(err))
      error("this spec restores numeric owners, which needs root: run the suite as root (CI does)")
    end
    local base, _g <close> = scratch()
    modes_tar(base .. "/m.tar")
    archive.unpack(base .. "/m.tar", base .. "/o", { owner = true })
    assert.are.equal("755 1234 2345", stat(base .. "/o/d"))
    assert.are.equal("644 1234 2345", stat(base .. "/o/d/plain"))
    assert.are.equal("4755 0 0", stat(base .. "/o/d/suid"))
  end))
end)

describe("archive.list", function()
  it("lists members with their types, sizes, modes and targets", T.async(function()
    local base, _g <close> = scratch()
    write_tar(base .. "/x.tar", {
      { name = "./d/", type = "5", mode = O755 },
      { name = "./d/f", data = "abc" },
      { name = "./d/l", type = "2", link = "f" },
      { name = "./d/h", type = "1", link = "./d/f" },
      { name = "./d/null", type = "3", major = 1, minor = 3 },
    })
    assert.are.same({
      { name = "./d", type = "directory", size = 0, mode = O755 },
      { name = "./d/f", type = "file", size = 3, mode = O644 },
      { name = "./d/l", type = "symlink", size = 0, mode = O644, target = "f" },
      { name = "./d/h", type = "hardlink", size = 0, mode = O644, target = "./d/f" },
      { name = "./d/null", type = "other", size = 0, mode = O644 },
    }, archive.list(base .. "/x.tar"))
  end))
end)

describe("archive work on the worker thread", function()
  local function big_tree(dir)
    sh('mkdir -p "$1" && for i in 1 2 3 4; do head -c 50000000 /dev/zero > "$1/f$i"; done', dir)
  end

  it("keeps the loop running while 200 MB are packed", T.async(function()
    local base, _g <close> = scratch()
    big_tree(base .. "/big")
    -- A ticker on the loop looks at the pack's partial output while the worker writes it: it
    -- must run during the pack, and see the output grow between its turns (a plain tar, so the
    -- output grows with every block read, not with every 64 KiB of gzip).
    local ticks, sizes, nsizes, stop = 0, {}, 0, false
    local ticker = task.spawn(function()
      while not stop do
        task.sleep(0.01)
        local partial = leftovers(base)[1]
        local f = partial and io.open(base .. "/" .. partial, "rb")
        if f then
          ticks = ticks + 1
          local size = f:seek("end")
          f:close()
          if not sizes[size] then sizes[size], nsizes = true, nsizes + 1 end
        end
      end
    end)
    local r = archive.pack(base .. "/big", base .. "/big.tar", { gzip = false })
    stop = true
    task.join(ticker)
    assert.are.equal(200000000, r.bytes)
    assert.is_true(ticks >= 3, ("the loop ran %d times during the pack"):format(ticks))
    assert.is_true(nsizes >= 2, ("the loop saw the output at %d size(s)"):format(nsizes))
  end))

  it("cancelling a pack leaves no partial output file", T.async(function()
    local base, _g <close> = scratch()
    big_tree(base .. "/big")
    local out = base .. "/big.tgz"
    local t = task.spawn(function() return archive.pack(base .. "/big", out) end)
    local deadline = task.now() + 5
    while #leftovers(base) == 0 and task.now() < deadline do task.sleep(0.005) end
    assert.are.equal(1, #leftovers(base), "the pack never started writing")
    task.cancel(t)
    local ok, err = pcall(task.join, t)
    assert.is_false(ok)
    assert.is_true(task.is_cancelled(err), tostring(err))
    wait_workers_idle()
    assert.is_false(exists(out))
    assert.are.same({}, leftovers(base))
  end))

  it("cancelling an unpack leaves no staging directory and no target", T.async(function()
    local base, _g <close> = scratch()
    big_tree(base .. "/big")
    archive.pack(base .. "/big", base .. "/big.tar", { gzip = false })
    sh('mkdir "$1/out"', base)
    local target = base .. "/out/target"
    local t = task.spawn(function() return archive.unpack(base .. "/big.tar", target) end)
    local deadline = task.now() + 5
    while #leftovers(base .. "/out") == 0 and task.now() < deadline do task.sleep(0.002) end
    assert.are.equal(1, #leftovers(base .. "/out"), "the unpack never started staging")
    task.cancel(t)
    local ok, err = pcall(task.join, t)
    assert.is_false(ok)
    assert.is_true(task.is_cancelled(err), tostring(err))
    wait_workers_idle()
    assert.is_false(exists(target))
    assert.are.same({}, leftovers(base .. "/out"))
  end))

  it("runs several jobs at once", T.async(function()
    local base, _g <close> = scratch()
    make_tree(base .. "/src")
    local jobs = {}
    for i = 1, 6 do
      jobs[i] = task.spawn(function()
        archive.pack(base .. "/src", base .. "/t" .. i .. ".tgz")
        return archive.unpack(base .. "/t" .. i .. ".tgz", base .. "/d" .. i).entries
      end)
    end
    for i = 1, 6 do assert.are.equal(13, task.join(jobs[i])) end
    assert.are.equal(0, archive.live_count())
  end))
end)
