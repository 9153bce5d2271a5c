--- bench/support/measure.lua — what the local backend benches share: percentiles, a process's
-- CPU and memory from /proc, one sandbox life over real HTTP (create, exec, terminate) against a
-- backend from spec/support/local_backend.lua, and the markdown table a bench reports in.
local json = require "moonbox.json"
local http = require "moonbox.http"
local core = require "moonbox.core"
local read_file = require("moonbox.path").read_file

local M = {}

--- measure.pct(list, p) -> the p-quantile of list (sorts it in place): the element at
-- ceil(#list * p), the first for p = 0.
function M.pct(list, p)
  table.sort(list)
  return list[math.max(1, math.ceil(#list * p))]
end

--- measure.median(list) -> pct(list, 0.5).
function M.median(list) return M.pct(list, 0.5) end

--- measure.proc_stat(pid) -> {self, children, rss, anon, hwm} of process pid ("self": this
-- one): self = utime + stime and children = cutime + cstime (its reaped children) in seconds,
-- from /proc/PID/stat; rss = VmRSS, anon = RssAnon and hwm = VmHWM (the peak RSS) in KiB, from
-- /proc/PID/status.
function M.proc_stat(pid)
  local s = assert(read_file("/proc/" .. pid .. "/stat"), "no process " .. pid)
  local fields = {}
  for x in s:match("%) (.*)$"):gmatch("%S+") do fields[#fields + 1] = tonumber(x) or x end
  local status = read_file("/proc/" .. pid .. "/status") or ""
  return { self = (fields[12] + fields[13]) / 100, children = (fields[14] + fields[15]) / 100,
    rss = tonumber(status:match("\nVmRSS:%s+(%d+)")),
    anon = tonumber(status:match("\nRssAnon:%s+(%d+)")), hwm = tonumber(status:match("\nVmHWM:%s+(%d+)")) }
end

--- measure.CPUACCT: the root cpuacct cgroup's usage file (cgroup v1), or nil without one. It
-- counts every task's measured runtime, kernel threads included, steal excluded.
for _, p in ipairs({ "/sys/fs/cgroup/cpuacct/cpuacct.usage", "/sys/fs/cgroup/cpu,cpuacct/cpuacct.usage" }) do
  if read_file(p) then
    M.CPUACCT = p
    break
  end
end

--- measure.ticks() -> all CPUs' busy seconds from /proc/stat (user nice system irq softirq
-- steal), tick-sampled.
function M.ticks()
  local v = {}
  for x in read_file("/proc/stat"):match("^cpu (.-)\n"):gmatch("%d+") do v[#v + 1] = tonumber(x) end
  return (v[1] + v[2] + v[3] + v[6] + v[7] + (v[8] or 0)) / 100
end

--- measure.machine_cpu() -> seconds every task of the machine has run: the root cpuacct cgroup
-- (v1), else cgroup v2's root cpu.stat; nil with neither.
function M.machine_cpu()
  if M.CPUACCT then return tonumber(read_file(M.CPUACCT)) / 1e9 end
  local stat = read_file("/sys/fs/cgroup/cpu.stat")
  local usec = stat and stat:match("usage_usec (%d+)")
  return usec and tonumber(usec) / 1e6 or nil
end

--- measure.token(B, id, command) -> a stream run token for command in sandbox id (the mint
-- waits for the sandbox's boot). [yields]
function M.token(B, id, command)
  local s, tok = B:req("POST", "/v1/sandboxes/" .. id .. "/runs/stream/token",
    { body = { command = command } })
  assert(s == 201, "mint failed " .. s .. " " .. json.encode(tok))
  return tok
end

--- measure.exec(B, id, command[, opts]) -> the exit code of command run in sandbox id through
-- a stream token and SSE, read to the stream's end (nil when it ends without an exit).
-- opts.on_event(ev) sees every event; opts.buffer: the stream's read buffer. [yields]
function M.exec(B, id, command, opts)
  opts = opts or {}
  local tok = M.token(B, id, command)
  local body = json.encode({ command = command })
  local resp <close> = http.stream { method = "POST", url = tok.uri, body = body,
    headers = { Authorization = "Bearer " .. tok.token, Accept = "text/event-stream" }, buffer = opts.buffer }
  local code
  while true do
    local ev = resp:read_event()
    if not ev then break end
    if opts.on_event then opts.on_event(ev) end
    if ev.event == "exit" then code = json.decode(ev.data).exit_code end
  end
  return code
end

--- measure.create(B[, body]) -> id, seconds: creates a sandbox (body, ownerId added) and waits
-- until it could run a command (a run token mint waits for the boot): the create → running
-- time a client sees. [yields]
function M.create(B, body)
  body = body or {}
  body.ownerId = B.workspace
  local t0 = core.now()
  local s, sb = B:req("POST", "/v1/sandboxes", { body = body })
  assert(s == 201, "create failed: " .. s .. " " .. json.encode(sb))
  M.token(B, sb.id, "true")
  return sb.id, core.now() - t0
end

--- measure.terminate(B, id): terminates sandbox id; raises unless the backend answers 204. [yields]
function M.terminate(B, id)
  local s = B:req("POST", "/v1/sandboxes/" .. id .. "/terminate")
  assert(s == 204, "terminate " .. id .. " failed: " .. tostring(s))
end

--- measure.life(B[, body]): one sandbox lifecycle: create (body), exec `true` to its exit,
-- terminate; raises when a step fails. [yields]
function M.life(B, body)
  body = body or {}
  body.ownerId = B.workspace
  local s, sb = B:req("POST", "/v1/sandboxes", { body = body })
  assert(s == 201, "create failed: " .. s .. " " .. json.encode(sb))
  assert(M.exec(B, sb.id, "true") == 0, "exec `true` in " .. sb.id .. " did not exit 0")
  M.terminate(B, sb.id)
end

local Report = {}
Report.__index = Report

--- measure.report() -> report: report:row(name, value[, note]) adds a row (and says it on
-- stderr as it goes); report:finish([out_file]) prints the markdown table and writes it to
-- out_file when given.
function M.report() return setmetatable({ rows = {} }, Report) end

function Report:row(name, value, note)
  self.rows[#self.rows + 1] = string.format("| %s | %s | %s |", name, value, note or "")
  io.stderr:write(name, ": ", value, "\n")
end

function Report:finish(out_file)
  local text = "| measurement | result | notes |\n|---|---:|---|\n" .. table.concat(self.rows, "\n") .. "\n"
  io.stdout:write(text)
  if out_file then
    local f = assert(io.open(out_file, "w"))
    f:write(text)
    f:close()
  end
end

return M
