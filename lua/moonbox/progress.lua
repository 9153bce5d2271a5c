--- moonbox.progress — the one-line view of a run's sandboxes: how many are being created,
-- running, failed and terminated, and the time since the run started.
--
-- `moonbox run` shows it on stderr when stderr is a terminal (redrawn in place, ten times a
-- second, erased at the end) and, with --progress, also when it is not (then a plain line at
-- most once a second, only when a count changed, and a last line at the end).
local core = require "moonbox.core"
local task = require "moonbox.task"
local render = require "moonbox.render"

local M = {}
local Progress = {}
Progress.__index = Progress

local function line(p)
  local c = p.counts
  local waiting = c.creating - c.created - c.failed
  return string.format("moonbox: %d created (%d waiting), %d running, %d failed, %d terminated  %.1fs",
    c.created, math.max(waiting, 0), c.running, c.failed, c.terminated, core.now() - p.t0)
end

--- progress.start{tty = bool, stream = file} -> Progress (p:stop() ends it). tty defaults to
-- whether stderr is a terminal. [must run inside a task: it spawns the redraw task]
function M.start(opts)
  opts = opts or {}
  local p = setmetatable({ tty = opts.tty, stream = opts.stream or io.stderr, t0 = core.now(),
    counts = { creating = 0, created = 0, running = 0, failed = 0, terminated = 0 }, shown = nil,
    changed = false }, Progress)
  if p.tty == nil then p.tty = core.isatty(2) end
  local c = p.counts
  p.unobserve = render.observe(function(event)
    if event == "creating" then c.creating = c.creating + 1
    elseif event == "created" then c.created = c.created + 1
    elseif event == "running" then c.running = c.running + 1
    elseif event == "create_failed" then c.failed = c.failed + 1
    elseif event == "terminated" then
      c.terminated = c.terminated + 1
      if c.running > 0 then c.running = c.running - 1 end
    end
    p.changed = true
  end)
  p.ticker = task.spawn(function()
    while true do
      task.sleep(p.tty and 0.1 or 1)
      p:draw()
    end
  end)
  p.ticker.name = "progress line"
  return p
end

function Progress:draw()
  if self.counts.creating == 0 then return end
  if self.tty then
    self.stream:write("\r\27[K", line(self))
    self.shown = true
  elseif self.changed then
    self.stream:write(line(self), "\n")
  end
  self.changed = false
  self.stream:flush()
end

--- p:stop(): stops redrawing; on a terminal erases the line, else writes the last counts.
function Progress:stop()
  if self.unobserve then self.unobserve() end
  self.unobserve = nil
  if self.ticker then core.cancel(self.ticker) end
  self.ticker = nil
  if self.tty then
    if self.shown then self.stream:write("\r\27[K") end
  elseif self.counts.creating > 0 then
    self.stream:write(line(self), "\n")
  end
  self.stream:flush()
end

M._line = line
return M
