-- Pins that a local sandbox's plan is a limit, enforced by the kernel through its cgroups:
-- memory beyond the plan is killed inside the sandbox (the exec reports 137) and the sandbox
-- takes the next exec; a fork bomb stops at the plan's process count; a busy loop gets about
-- the plan's CPUs. Uses the 1c-2g plan (1 CPU, 2 GiB, 1024 processes) through the engine, as
-- the service passes it. Needs root, the default image and cgroup v1 memory, cpu and pids
-- controllers (CI has them); their absence fails the first spec.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local Engine = require "moonbox.local.engine"
local image = require "moonbox.local.image"
local service = require "moonbox.local.service"
local files = require "spec.support.files"

local STATE = "/tmp/moonbox-limits-spec-" .. files.run_tag()
local eng = Engine.new { state_dir = STATE, image = image.path() }
local PLAN = service.PLANS["1c-2g"]
local ids = {}

local function sandbox(name)
  local id = "sbx-limits-" .. name
  ids[#ids + 1] = id
  eng:create(id, { network = "deny-all", limits = PLAN })
  return id
end

local read = files.read

describe("plans as limits", function()
  teardown(T.async(function()
    for _, id in ipairs(ids) do pcall(eng.terminate, eng, id) end
    pcall(eng.close, eng)
    require("spec.support.local_backend").remove_tree(STATE)
  end))

  it("has the controllers a plan needs on this machine", T.async(function()
    assert.are.same({}, eng.cg.missing, "cgroup controllers missing: " .. table.concat(eng.cg.missing, ", "))
  end))

  it("kills what grows past the plan's memory inside the sandbox (137) and takes the next exec",
    T.async(function()
      local id = sandbox("memory")
      assert.are.equal(tostring(PLAN.memory), read(eng.cg:path(id, nil, "memory") .. "/memory.limit_in_bytes"):match("%d+"))
      -- 3 GiB touched page by page: past 2 GiB the kernel's OOM killer ends it (no swap beyond)
      local r = eng:run(id, "python3 -c 'b = bytearray(3 << 30); print(len(b))'")
      assert.are.equal(137, r.code, "expected a kill by the OOM killer, got " .. tostring(r.code) .. ": " .. r.stderr)
      assert.are.equal("", r.stdout)
      assert.is_true((eng:oom_kills(id) or 0) >= 1)
      assert.is_true(eng:alive(id), "the OOM killer took the sandbox's init")
      local again = eng:run(id, "echo still here; python3 -c 'b = bytearray(256 << 20); print(len(b) >> 20)'")
      assert.are.equal(0, again.code, again.stderr)
      assert.are.equal("still here\n256\n", again.stdout)
    end))

  it("stops a fork bomb of 10,000 processes at the plan's process count", T.async(function()
    local id = sandbox("pids")
    local script = [[
import os, sys, time
n = 0
for i in range(10000):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    n += 1
print(n)
sys.stdout.flush()
os.killpg(0, 9)
]]
    local r = eng:run(id, "setsid -w python3 -c '" .. script .. "'")
    local n = tonumber(r.stdout:match("%d+"))
    assert.is_number(n, r.stdout .. r.stderr)
    assert.is_true(n < PLAN.pids, "forked " .. n .. " processes on a plan of " .. PLAN.pids)
    assert.is_true(n > PLAN.pids / 2, "only " .. n .. " forks: something else stopped them")
    -- the bomb is gone and the sandbox works
    local deadline = task.now() + 20
    while #eng:processes(id) > 3 and task.now() < deadline do task.sleep(0.05) end
    local again = eng:run(id, "echo ok")
    assert.are.equal("ok\n", again.stdout)
  end))

  it("holds two busy loops on a 1-CPU plan to about one core", T.async(function()
    local id = sandbox("cpu")
    local stat = eng.cg:path(id, nil, "cpu") .. "/cpu.stat"
    local before = tonumber((read(stat) or ""):match("nr_throttled (%d+)"))
    assert.is_number(before, "no cpu.stat for the sandbox at " .. stat)
    -- `times` prints the CPU time the shell's children used: two loops for 2 s of wall time
    -- use 4 s of CPU on two free cores, 2 s at most on a quota of one
    local r = eng:run(id, "(timeout 2 sh -c 'while :; do :; done' & timeout 2 sh -c 'while :; do :; done' & wait); times")
    local lines = {}
    for line in r.stdout:gmatch("[^\n]+") do lines[#lines + 1] = line end
    local um, us, sm, ss = lines[2]:match("(%d+)m([%d.]+)s%s+(%d+)m([%d.]+)s")
    local cpu = tonumber(um) * 60 + tonumber(us) + tonumber(sm) * 60 + tonumber(ss)
    assert.is_true(cpu < 2.6, string.format("two busy loops used %.2f s of CPU in 2 s on a 1-CPU plan", cpu))
    -- Whether the kernel had to throttle depends on what else the machine runs (two loops that
    -- get less than one core between them never reach the quota), so the quota itself is what
    -- is checked: one CPU per period (cgroup v1: cfs_quota_us / cfs_period_us; v2: cpu.max).
    local dir = eng.cg:path(id, nil, "cpu")
    local quota, period = (read(dir .. "/cpu.max") or ""):match("^(%d+) (%d+)")
    if not quota then
      quota = (read(dir .. "/cpu.cfs_quota_us") or ""):match("^(%-?%d+)")
      period = (read(dir .. "/cpu.cfs_period_us") or ""):match("^(%d+)")
    end
    assert.is_truthy(quota and period, "no CPU quota readable under " .. dir)
    assert.are.equal(1.0, tonumber(quota) / tonumber(period),
      string.format("the 1-CPU plan's quota is %s per %s", tostring(quota), tostring(period)))
    local after = tonumber(read(stat):match("nr_throttled (%d+)"))
    assert.is_true(after >= before, "cpu.stat went backwards")
  end))
end)
