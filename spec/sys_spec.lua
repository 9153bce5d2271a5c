-- Pins moonbox.sys, the syscalls `moonbox local` uses instead of mkdir, mount, umount, kill, ls
-- and rm processes: what each does, and that every failure is a structured error naming the
-- path or pid and the errno text. The mount cases need root.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local proc = require "moonbox.proc"
local sys = require "moonbox.sys"
local files = require "spec.support.files"

local DIR = "/tmp/moonbox-sys-spec-" .. files.run_tag()
local errors_with = T.errors_with

local write = files.write

local function mode_of(path)
  return tonumber(proc.run({ "stat", "-c", "%a", path }).stdout, 8)
end

describe("moonbox.sys", function()
  teardown(function() os.execute("rm -rf " .. DIR) end)

  it("mkdir_p creates missing parents and gives the last directory the mode", T.async(function()
    assert.is_true(sys.mkdir_p(DIR .. "/a/b/c", tonumber("0700", 8)))
    assert.are.equal(tonumber("0700", 8), mode_of(DIR .. "/a/b/c"))
    assert.is_true(sys.mkdir_p(DIR .. "/a/b/c/")) -- existing: fine, mode left alone
    assert.are.equal(tonumber("0700", 8), mode_of(DIR .. "/a/b/c"))
  end))

  it("mkdir_p on a path through a file raises not_directory naming the path", T.async(function()
    sys.mkdir_p(DIR)
    write(DIR .. "/file", "x")
    local err = errors_with("not_directory", sys.mkdir_p, DIR .. "/file/sub")
    assert.are.equal("sys.mkdir_p", err.op)
    assert.truthy(err.message:find(DIR .. "/file/sub", 1, true))
    assert.truthy(err.message:find("Not a directory", 1, true))
    err = errors_with("not_directory", sys.mkdir_p, DIR .. "/file")
    assert.are.equal(DIR .. "/file", err.path)
  end))

  it("kill of a pid that does not exist raises no_such_process naming the pid", T.async(function()
    local p = proc.spawn { "true" }
    local pid = p.pid
    p:wait()
    local err = errors_with("no_such_process", sys.kill, pid, 0)
    assert.are.equal(pid, err.pid)
    assert.truthy(err.message:find("pid " .. pid, 1, true))
    err = errors_with("no_such_process", sys.kill, -pid, 15)
    assert.truthy(err.message:find("process group " .. pid, 1, true))
  end))

  it("kill signals a process", T.async(function()
    local p = proc.spawn { "sleep", "100" }
    assert.is_true(sys.kill(p.pid, 9))
    local _, sig = p:wait()
    assert.are.equal("KILL", sig)
  end))

  it("listdir lists names, and raises not_found naming a missing directory", T.async(function()
    sys.mkdir_p(DIR .. "/list/x")
    write(DIR .. "/list/y", "")
    local names = sys.listdir(DIR .. "/list")
    table.sort(names)
    assert.are.same({ "x", "y" }, names)
    local err = errors_with("not_found", sys.listdir, DIR .. "/missing")
    assert.truthy(err.message:find(DIR .. "/missing", 1, true))
    assert.truthy(err.message:find("No such file", 1, true))
  end))

  it("umount of a path that is not a mount point raises naming it", T.async(function()
    sys.mkdir_p(DIR .. "/notmount")
    local err = errors_with("invalid", function() return sys.umount(DIR .. "/notmount", true) end)
    assert.are.equal("sys.umount", err.op)
    assert.truthy(err.message:find(DIR .. "/notmount", 1, true))
  end))

  it("mount_overlay mounts, umount unmounts, remove_tree removes everything", T.async(function()
    for _, d in ipairs({ "l1", "l2", "u", "w", "m" }) do sys.mkdir_p(DIR .. "/ov/" .. d) end
    write(DIR .. "/ov/l2/base", "base")
    write(DIR .. "/ov/l1/top", "top")
    sys.mount_overlay({ DIR .. "/ov/l1", DIR .. "/ov/l2" }, DIR .. "/ov/u", DIR .. "/ov/w", DIR .. "/ov/m")
    write(DIR .. "/ov/m/new", "new")
    local names = sys.listdir(DIR .. "/ov/m")
    table.sort(names)
    assert.are.same({ "base", "new", "top" }, names)
    assert.are.equal("unmounted", sys.umount(DIR .. "/ov/m", true))
    assert.are.same({ "new" }, sys.listdir(DIR .. "/ov/u"))
    assert.is_true(sys.remove_tree(DIR .. "/ov"))
    errors_with("not_found", sys.listdir, DIR .. "/ov")
    assert.is_true(sys.remove_tree(DIR .. "/ov")) -- already gone: fine
  end))

  it("mount_overlay with options longer than a page raises too_long naming the target", T.async(function()
    local lowers = {}
    for i = 1, 100 do lowers[i] = DIR .. "/" .. string.rep("l", 40) .. i end
    local err = errors_with("too_long", sys.mount_overlay, lowers, DIR .. "/u", DIR .. "/w", DIR .. "/m")
    assert.are.equal("sys.mount_overlay", err.op)
    assert.are.equal(DIR .. "/m", err.path)
  end))

  it("mount_overlay of a missing directory raises naming the target", T.async(function()
    local err = errors_with("not_found", sys.mount_overlay, { DIR .. "/nope" }, DIR .. "/u",
      DIR .. "/w", DIR .. "/nowhere")
    assert.are.equal("sys.mount_overlay", err.op)
    assert.truthy(err.message:find(DIR .. "/nowhere", 1, true))
  end))

  it("remove_tree parks only its caller: other tasks run while the worker removes", T.async(function()
    local base = DIR .. "/parked"
    sys.mkdir_p(base .. "/a/b/c", 493)
    for i = 1, 200 do write(base .. "/a/f" .. i, "x") end
    local ticks, done = 0, false
    local ticker = task.spawn(function()
      while not done do
        ticks = ticks + 1
        task.yield()
      end
    end)
    assert.is_true(sys.remove_tree(base))
    done = true
    task.join(ticker)
    assert.is_nil(io.open(base .. "/a/f1"))
    assert.is_true(ticks >= 1)
  end))

  it("remove_tree outside a task is refused, not blocking the loop", function()
    assert.has_error(function() sys.remove_tree(DIR .. "/nothing") end)
  end)

  it("getcwd is the absolute working directory", T.async(function()
    local cwd = sys.getcwd()
    assert.are.equal("/", cwd:sub(1, 1))
    assert.are.equal(require("moonbox.proc").run({ "pwd", "-P" }).stdout:gsub("%s+$", ""), cwd)
  end))

  it("remove_tree stops at another filesystem below, naming the entry, and keeps it", T.async(function()
    local base = DIR .. "/xdev"
    sys.mkdir_p(base .. "/m", tonumber("755", 8))
    assert.are.equal(0, require("moonbox.proc").run({ "mount", "-t", "tmpfs", "none", base .. "/m" }).code)
    local f = assert(io.open(base .. "/m/keep", "w"))
    f:close()
    local ok, err = pcall(sys.remove_tree, base)
    local kept = io.open(base .. "/m/keep") ~= nil
    sys.umount(base .. "/m", true)
    sys.remove_tree(base)
    assert.is_false(ok)
    assert.truthy(tostring(err):find(base .. "/m", 1, true))
    assert.is_true(kept)
  end))
end)
