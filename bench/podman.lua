-- bench/podman.lua — `moonbox local` side by side with podman (runc) and with the floors, in one
-- run on this machine, on the same Debian 12 image (the local backend's, imported into podman
-- once as `moonbox-debian-12`):
--   exec round trip  an exec `true` over the API (mint a stream token, POST, read the SSE to its
--                    exit) in a running deny-all sandbox; `podman exec` of `true` in a running
--                    `--network none` container; `nsenter --all` into the same sandbox's init
--                    and `true` (the floor of entering a running sandbox). p50 and p90 wall.
--   a life           create, exec `true`, terminate: deny-all against `podman run --rm
--                    --network none IMAGE true`, allow-all against `--network slirp4netns`; and
--                    `bwrap --unshare-all` of the same image running `true` (the floor of making
--                    one). p50 wall, and machine CPU per life.
-- podman runs with `--ulimit nofile=1024:1024 --ulimit nproc=1024:1024`: its defaults are above
-- what runc may set where root lacks CAP_SYS_RESOURCE (as in this machine's container), and the
-- limits play no part in the cost.
-- CPU, two measures. Per process (the one to trust on a shared machine): what the processes of
-- the thing measured ran, from the kernel's precise per-task runtime — for moonbox the
-- backend's utime + stime and its reaped children's (keepers, inits, exec helpers, slirp4netns,
-- the commands: a sandbox's processes are reaped into its keeper's, so every phase ends with its
-- sandboxes terminated); for nsenter and bwrap our own reaped children's; for podman a small
-- Python driver that makes itself a child subreaper (PR_SET_CHILD_SUBREAPER), so that conmon,
-- runc and podman's cleanup processes, which leave podman's tree, are reparented to it, reaped
-- and counted in its RUSAGE_CHILDREN. Machine: every task of the machine (the root cpuacct
-- cgroup's usage, else /proc/stat) over the phase and a settle, less this process's CPU and the
-- idle background measured before; meaningful only on a quiet machine (the background is
-- printed). Ratios are within this one run; tests never time things, this does.
-- Run (root): build/moonbox run bench/podman.lua [N_MOONBOX] [N_PODMAN]   (defaults 100 and 20);
-- BASELINE=other/build/moonbox also compares that build with this one, interleaved (below).
-- Needs podman with runc (Debian's), bubblewrap, nsenter (util-linux), slirp4netns and the
-- default image (`moonbox image build`).
local path = require "moonbox.path"
local proc = require "moonbox.proc"
local task = require "moonbox.task"
local image = require "moonbox.local.image"
local L = require "spec.support.local_backend"
local measure = require "bench.support.measure"

local N = tonumber(arg and arg[1]) or 100
local NP = tonumber(arg and arg[2]) or 20
local SETTLE = tonumber(os.getenv("SETTLE")) or 2
local IMAGE = image.path()
local TAG = "moonbox-debian-12"
local read = path.read_file

local function run(argv, what)
  local r = proc.run(argv)
  assert(r.code == 0, (what or argv[1]) .. " failed (" .. tostring(r.code) .. "): " .. r.stderr .. r.stdout)
  return r.stdout
end

-- ---- the measures --------------------------------------------------------------------------------

-- Seconds every task of the machine has run (the busy ticks of /proc/stat without a cgroup
-- that counts them).
local function machine() return measure.machine_cpu() or measure.ticks() end
local function own()
  local st = measure.proc_stat("self")
  return st.self
end
local function settle() proc.run { "sleep", tostring(SETTLE) } end

local i0, m0, o0 = task.now(), machine(), own()
proc.run { "sleep", "5" }
local BG = (machine() - m0 - (own() - o0)) / (task.now() - i0) -- CPU-seconds per second, idle

-- The per-process CPU of pid so far: its own (unless pid is "self") and its reaped children's.
local function tree_cpu(pid)
  local st = measure.proc_stat(pid)
  return (pid == "self" and 0 or st.self) + st.children
end

-- Runs fn(i) count times, then done() (which ends what must be reaped); returns the walls
-- (seconds each), the per-process CPU of pid's tree per run and the machine CPU per run
-- (seconds, the settle included, less our own CPU and the background).
local function phase(count, pid, fn, done)
  local walls = {}
  local a, ao, at, pa = machine(), own(), task.now(), tree_cpu(pid)
  for i = 1, count do
    local s = task.now()
    fn(i)
    walls[#walls + 1] = task.now() - s
  end
  if done then done() end
  settle()
  local cpu = (machine() - a - (own() - ao) - BG * (task.now() - at)) / count
  return walls, (tree_cpu(pid) - pa) / count, cpu
end

-- podman argv, count times, from a subreaper driver (see the top): walls, per-process CPU per run,
-- machine CPU per run.
local DRIVER = [[
import ctypes, os, resource, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
n, argv = int(sys.argv[1]), sys.argv[2:]
def used():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime
def reap(until):
    while time.monotonic() < until:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.005)
u0 = used()
for i in range(n):
    t = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    print("wall", time.monotonic() - t, flush=True)
reap(time.monotonic() + 20)
print("cpu", (used() - u0) / n)
]]
local function podman_phase(count, argv)
  local walls, per
  local cmd = { "python3", "-c", DRIVER, tostring(count) }
  for _, a in ipairs(argv) do cmd[#cmd + 1] = a end
  local a, ao, at = machine(), own(), task.now()
  local out = run(cmd, "the podman driver")
  settle()
  local cpu = (machine() - a - (own() - ao) - BG * (task.now() - at)) / count
  walls = {}
  for w in out:gmatch("wall (%S+)") do walls[#walls + 1] = tonumber(w) end
  per = tonumber(out:match("cpu (%S+)"))
  return walls, per, cpu
end

local function ms(x) return string.format("%.1f ms", x * 1000) end
local results = {}
local function note(name, walls, per, cpu)
  local p50, p90 = measure.pct(walls, 0.5), measure.pct(walls, 0.9)
  results[name] = { p50 = p50, p90 = p90, per = per, cpu = cpu }
  io.stderr:write(string.format("%s: p50 %s p90 %s per process %s machine %s\n", name, ms(p50), ms(p90),
    ms(per), ms(cpu)))
end

-- ---- set-up ----------------------------------------------------------------------------------------

assert(path.read_file(IMAGE .. "/bin/sh"), "the default image is missing at " .. IMAGE .. " (moonbox image build)")
if proc.run({ "podman", "image", "exists", TAG }).code ~= 0 then
  io.stderr:write("importing ", IMAGE, " into podman as ", TAG, "\n")
  run({ "sh", "-c", "tar -C '" .. IMAGE .. "' -cf - . | podman import - " .. TAG }, "podman import")
end
local runtime = run({ "podman", "info", "--format", "{{.Host.OCIRuntime.Name}}" }):gsub("%s+$", "")
io.stderr:write("podman runtime: ", runtime, "; background ", string.format("%.0f ms/s", BG * 1000), "\n")

-- ---- before and after, interleaved ------------------------------------------------------------------
-- BASELINE=other/build/moonbox: first, that build's backend and this one's side by side, each
-- exec and each life alternating between the two (so both see the same load): p50 wall and
-- per-process CPU of each. Then the comparison below, on this build.

local baseline = os.getenv("BASELINE")
if baseline then
  local default = L.BIN
  L.BIN = baseline
  local A = L.start()
  L.BIN = default
  local Bn = L.start()
  local pair = { { name = "before", b = A }, { name = "after", b = Bn } }
  local out = {}
  for _, x in ipairs(pair) do
    x.id = measure.create(x.b, { networkPolicy = { default = "deny-all" } })
    for _ = 1, 10 do measure.exec(x.b, x.id, "true") end
    x.walls, x.cpu0 = {}, tree_cpu(x.b.p.pid)
  end
  for _ = 1, N do
    for _, x in ipairs(pair) do
      local t = task.now()
      assert(measure.exec(x.b, x.id, "true") == 0)
      x.walls[#x.walls + 1] = task.now() - t
    end
  end
  for _, x in ipairs(pair) do
    measure.terminate(x.b, x.id)
    out[#out + 1] = string.format("| exec `true`, %s | %s | %s |", x.name, ms(measure.pct(x.walls, 0.5)),
      ms((tree_cpu(x.b.p.pid) - x.cpu0) / N))
  end
  for _, net in ipairs({ "deny-all", "allow-all" }) do
    for _, x in ipairs(pair) do
      for _ = 1, 5 do measure.life(x.b, { networkPolicy = { default = net } }) end
      x.walls, x.cpu0 = {}, tree_cpu(x.b.p.pid)
    end
    for _ = 1, N do
      for _, x in ipairs(pair) do
        local t = task.now()
        measure.life(x.b, { networkPolicy = { default = net } })
        x.walls[#x.walls + 1] = task.now() - t
      end
    end
    for _, x in ipairs(pair) do
      out[#out + 1] = string.format("| life %s, %s | %s | %s |", net, x.name, ms(measure.pct(x.walls, 0.5)),
        ms((tree_cpu(x.b.p.pid) - x.cpu0) / N))
    end
  end
  A:destroy()
  Bn:destroy()
  print("| interleaved with " .. baseline .. " | p50 wall | CPU per process |")
  print("|---|---:|---:|")
  for _, line in ipairs(out) do print(line) end
  print()
end

-- ---- exec round trips --------------------------------------------------------------------------------

local B = L.start()
local function keeper_and_init(backend_pid, id)
  for _, name in ipairs(require("moonbox.sys").listdir("/proc")) do
    if name:match("^%d+$") then
      local st = read("/proc/" .. name .. "/stat") or ""
      local cmd = read("/proc/" .. name .. "/cmdline") or ""
      if st:match("%) %S+ (%d+)") == tostring(backend_pid) and cmd:find("--id=" .. id, 1, true) then
        for _, c in ipairs(require("moonbox.sys").listdir("/proc")) do
          local cs = c:match("^%d+$") and read("/proc/" .. c .. "/stat") or ""
          if cs:match("%) %S+ (%d+)") == name then return tonumber(name), tonumber(c) end
        end
      end
    end
  end
end

-- The exec's CPU counts the sandbox's end: the commands are the init's children, reaped into the
-- keeper's and the backend's times when the sandbox ends. The life it adds is made up for by
-- terminating a fresh sandbox (a create and a terminate) outside the phase's count.
local id = measure.create(B, { networkPolicy = { default = "deny-all" } })
for _ = 1, 10 do measure.exec(B, id, "true") end
local _, init = keeper_and_init(B.p.pid, id)
assert(init, "could not find the sandbox's init")
note("moonbox exec true", phase(N, B.p.pid, function() assert(measure.exec(B, id, "true") == 0) end,
  function() measure.terminate(B, id) end))
id = measure.create(B, { networkPolicy = { default = "deny-all" } })
_, init = keeper_and_init(B.p.pid, id)
local enter = { "nsenter", "--target", tostring(init), "--all", "true" }
run(enter, "nsenter")
note("nsenter into its init + true", phase(N, "self", function() run(enter, "nsenter") end))
measure.terminate(B, id)

local LIMITS = { "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024" }
local cid = run({ "podman", "run", "-d", "--rm", LIMITS[1], LIMITS[2], LIMITS[3], LIMITS[4], "--network", "none",
  TAG, "sleep", "infinity" }):gsub("%s+$", "")
for _ = 1, 3 do run({ "podman", "exec", cid, "true" }) end
note("podman exec true", podman_phase(NP, { "podman", "exec", cid, "true" }))
run({ "podman", "rm", "-f", "-t", "0", cid })

-- ---- lives -------------------------------------------------------------------------------------------

-- A life by its steps, wall: the create answered, the exec (token, stream to its exit), the
-- terminate answered.
local steps = {}
local function life(net)
  local t0 = task.now()
  local s, sb = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, networkPolicy = { default = net } } })
  assert(s == 201, "create failed: " .. tostring(s))
  local t1 = task.now()
  assert(measure.exec(B, sb.id, "true") == 0, "exec `true` did not exit 0")
  local t2 = task.now()
  measure.terminate(B, sb.id)
  local t3 = task.now()
  local st = steps[net] or { create = {}, exec = {}, terminate = {} }
  steps[net] = st
  st.create[#st.create + 1], st.exec[#st.exec + 1], st.terminate[#st.terminate + 1] = t1 - t0, t2 - t1, t3 - t2
end
for _, net in ipairs({ "deny-all", "allow-all" }) do
  for _ = 1, 5 do life(net) end
  steps[net] = nil
  note("moonbox life " .. net, phase(N, B.p.pid, function() life(net) end))
end
B:destroy()
for _, net in ipairs({ "none", "slirp4netns" }) do
  local argv = { "podman", "run", "--rm", LIMITS[1], LIMITS[2], LIMITS[3], LIMITS[4], "--network", net, TAG, "true" }
  run(argv)
  note("podman run --rm --network " .. net, podman_phase(NP, argv))
end
local bwrap = { "bwrap", "--unshare-all", "--ro-bind", IMAGE, "/", "--dev", "/dev", "--proc", "/proc", "true" }
run(bwrap, "bwrap")
note("bwrap --unshare-all (the image) true", phase(N, "self", function() run(bwrap, "bwrap") end))

-- ---- the report ----------------------------------------------------------------------------------------

local r = results
local function ratio(a, b) return string.format("%.3f×", a / b) end
print(string.format("background %.0f ms/s; podman %s", BG * 1000, runtime))
print("| measure | p50 wall | p90 wall | CPU per run: per process | machine |")
print("|---|---:|---:|---:|---:|")
for _, k in ipairs({ "moonbox exec true", "nsenter into its init + true", "podman exec true",
  "moonbox life deny-all", "podman run --rm --network none", "moonbox life allow-all",
  "podman run --rm --network slirp4netns", "bwrap --unshare-all (the image) true" }) do
  print(string.format("| %s | %s | %s | %s | %s |", k, ms(r[k].p50), ms(r[k].p90), ms(r[k].per), ms(r[k].cpu)))
end
print()
print("| a moonbox life's steps, p50 wall | create | exec `true` | terminate |")
print("|---|---:|---:|---:|")
for _, net in ipairs({ "deny-all", "allow-all" }) do
  local st = steps[net]
  print(string.format("| %s | %s | %s | %s |", net, ms(measure.pct(st.create, 0.5)), ms(measure.pct(st.exec, 0.5)),
    ms(measure.pct(st.terminate, 0.5))))
end
print()
print("| ratio | wall (p50) | CPU per process | CPU machine | goal |")
print("|---|---:|---:|---:|---|")
local function row(name, a, b, goal)
  print(string.format("| %s | %s | %s | %s | %s |", name, ratio(r[a].p50, r[b].p50), ratio(r[a].per, r[b].per),
    ratio(r[a].cpu, r[b].cpu), goal))
end
row("exec: moonbox / podman exec", "moonbox exec true", "podman exec true", "≤ 0.03× (p50 wall)")
row("exec: moonbox / nsenter", "moonbox exec true", "nsenter into its init + true", "≤ 2× (p50 wall)")
row("life deny-all / podman --network none", "moonbox life deny-all", "podman run --rm --network none",
  "≤ 0.05× wall and CPU")
row("life allow-all / podman slirp4netns", "moonbox life allow-all", "podman run --rm --network slirp4netns",
  "≤ 0.05× wall and CPU")
row("life deny-all / bwrap", "moonbox life deny-all", "bwrap --unshare-all (the image) true", "≤ 1.5× CPU")
row("life allow-all / bwrap", "moonbox life allow-all", "bwrap --unshare-all (the image) true", "≤ 1.5× CPU")
