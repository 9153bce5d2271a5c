-- bench/exec_output.lua [MiB] — exec output end to end against the host pipe, in one run:
--   host: `yes … | head -c N > /dev/null` run by bash on this machine (the pipe's own speed);
--   moonbox: the same command through sb:exec against a `moonbox local` process, every byte
--   delivered to on_output (max_output = 0, so nothing is kept: the figure is the path, not
--   the memory), three times, the best kept.
-- Prints MB/s of both, their ratio and the client's CPU per MB (os.clock of this process, which
-- does not include the backend). Run: build/moonbox run bench/exec_output.lua [700] (root).
local core = require "moonbox.core"
local render = require "moonbox.render"
local L = require "spec.support.local_backend"

local mib = tonumber(arg and arg[1]) or 700
local total = mib * 1024 * 1024
local cmd = "yes 0123456789abcdefghijklmnopqrstuvwxyz 2>/dev/null | head -c " .. total

local function best_of(n, f)
  local best, best_cpu
  for _ = 1, n do
    local secs, cpu = f()
    if not best or secs < best then best, best_cpu = secs, cpu end
  end
  return best, best_cpu
end

local host = best_of(3, function()
  local t0 = core.time() -- the loop's clock stands still while os.execute blocks
  assert(os.execute("bash -c '" .. cmd .. " > /dev/null'"))
  return core.time() - t0
end)

local B = L.start()
B:connect_render()
local sb = render.sandboxes.create {}
local secs, cpu = best_of(3, function()
  local bytes = 0
  local c0, t0 = os.clock(), core.now()
  local r = sb:exec(cmd, { max_output = 0, on_output = function(_, data) bytes = bytes + #data end })
  local t, c = core.now() - t0, os.clock() - c0
  assert(r.code == 0 and bytes == total, "got " .. bytes .. " bytes, exit " .. tostring(r.code))
  return t, c
end)
sb:terminate()
B:destroy()

local function mbs(s) return total / s / 1e6 end
print(string.format("| host pipe into /dev/null | %.0f MB/s | |", mbs(host)))
print(string.format("| sb:exec, every byte to on_output | %.0f MB/s | %.2f× the host pipe; client CPU %.2f ms/MB |",
  mbs(secs), host / secs, cpu * 1000 / (total / 1e6)))
