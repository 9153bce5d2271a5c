--- spec/support/tmux.lua — drives an interactive program through a real pseudo-terminal: a
-- private tmux server (its own socket, so nothing touches a user's tmux), keys sent with
-- send-keys, the screen read with capture-pane. Waits poll the screen against a deadline; no
-- fixed sleeps. Every call here [yields] (tmux runs through moonbox.proc).
local proc = require "moonbox.proc"
local task = require "moonbox.task"

local M = {}
local Term = {}
Term.__index = Term

local function tmux(self, args)
  local argv = { "tmux", "-S", self.socket }
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  return proc.run(argv)
end

--- M.start{command = "...", env = {K = V}, dir = DIR, width = 150, height = 50} -> Term: runs
-- command (a shell command line) in a new detached session; when it ends, the pane prints
-- "EXIT=<status>" and stays, so its status can be read.
function M.start(opts)
  local self = setmetatable({ socket = opts.dir .. "/tmux.sock" }, Term)
  local args = { "new-session", "-d", "-x", tostring(opts.width or 150), "-y", tostring(opts.height or 50) }
  local names = {}
  for k in pairs(opts.env or {}) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do
    args[#args + 1] = "-e"
    args[#args + 1] = k .. "=" .. opts.env[k]
  end
  args[#args + 1] = opts.command .. "; echo EXIT=$?; sleep 600"
  local r = tmux(self, args)
  assert(r.code == 0, "tmux new-session failed: " .. tostring(r.stderr))
  return self
end

--- term:type(text): types text literally (no key names, no Enter).
function Term:type(text)
  local r = tmux(self, { "send-keys", "-l", text })
  assert(r.code == 0, "tmux send-keys failed: " .. tostring(r.stderr))
end

--- term:key(name, ...): presses keys by tmux name ("Enter", "Tab", "C-c", "C-d", "Up").
function Term:key(...)
  local r = tmux(self, { "send-keys", ... })
  assert(r.code == 0, "tmux send-keys failed: " .. tostring(r.stderr))
end

--- term:line(text): types text and presses Enter.
function Term:line(text)
  self:type(text)
  self:key("Enter")
end

--- term:screen() -> the pane's text with its scrollback, wrapped lines joined, trailing blank
-- lines removed.
function Term:screen()
  local r = tmux(self, { "capture-pane", "-p", "-J", "-S", "-2000" })
  assert(r.code == 0, "tmux capture-pane failed: " .. tostring(r.stderr))
  return (r.stdout:gsub("%s+$", ""))
end

--- term:wait_for(pattern, timeout = 30, plain) -> screen, elapsed seconds: polls until the
-- screen contains pattern (a Lua pattern; plain text with plain = true); raises with the
-- screen's text when the deadline passes.
function Term:wait_for(pattern, timeout, plain)
  local t0 = task.now()
  local screen
  repeat
    screen = self:screen()
    if screen:find(pattern, 1, plain) then return screen, task.now() - t0 end
    task.sleep(0.02)
  until task.now() - t0 > (timeout or 30)
  error(string.format("the terminal did not show %q within %g s; it shows:\n%s", pattern, timeout or 30,
    screen), 2)
end

--- term:kill(): stops the tmux server and everything running in it.
function Term:kill()
  tmux(self, { "kill-server" })
end

return M
