--- moonbox.local.engine.host — small host-side helpers of the local sandbox engine.
--
-- Owns nothing; it is the engine's toolbox: structured errors, running host commands to
-- completion, reading and writing /proc, /sys and cgroup files, and the signal table. Every
-- command runs through moonbox.proc, never os.execute or io.popen: those block the event loop
-- and lose their exit status to libev's SIGCHLD reaper. Reading and writing /proc and /sys
-- files with io.open is fine: they are served by the kernel from memory and never block.
-- Only moonbox.local.engine and its parts call this module.
local core = require "moonbox.core"
local proc = require "moonbox.proc"
local sys = require "moonbox.sys"

local M = {}

--- host.DEFAULT_PATH: the PATH commands see inside a sandbox unless its create env sets one;
-- host.ENV: the whole environment of every host-side helper and command the engine runs.
M.DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
M.ENV = { PATH = M.DEFAULT_PATH, LC_ALL = "C" }

-- Signal numbers on Linux (x86-64 and arm64 agree on these), for exit codes of killed commands.
M.SIGNALS = {
  HUP = 1, INT = 2, QUIT = 3, ILL = 4, TRAP = 5, ABRT = 6, BUS = 7, FPE = 8, KILL = 9,
  USR1 = 10, SEGV = 11, USR2 = 12, PIPE = 13, ALRM = 14, TERM = 15, STKFLT = 16, CHLD = 17,
  CONT = 18, STOP = 19, TSTP = 20, TTIN = 21, TTOU = 22, URG = 23, XCPU = 24, XFSZ = 25,
  VTALRM = 26, PROF = 27, WINCH = 28, IO = 29, PWR = 30, SYS = 31,
}

--- host.signal_number(sig) -> n. Accepts "TERM", "sigterm", "SIG15"-style names from
-- moonbox.proc, or a number. Raises a plain error for an unknown name (misuse).
function M.signal_number(sig)
  if type(sig) == "number" then
    if sig ~= math.floor(sig) or sig < 0 or sig > 64 then error("signal out of range: " .. sig, 3) end
    return math.tointeger(sig)
  end
  if type(sig) ~= "string" then error("expected a signal name or number, got " .. type(sig), 3) end
  local bare = sig:upper():gsub("^SIG", "")
  local n = M.SIGNALS[bare] or tonumber(bare)
  if not n then error("unknown signal '" .. sig .. "'", 3) end
  return math.tointeger(n)
end

--- host.fail(fn, code, id, message[, fields]): raises a structured error with
-- op "local.engine.<fn>", the code, sandbox_id = id and the message (which names the sandbox).
-- fields are copied into the error. Never returns.
function M.fail(fn, code, id, message, fields)
  local e = { op = "local.engine." .. fn, code = code, sandbox_id = id, message = message }
  for k, v in pairs(fields or {}) do e[k] = v end
  error(core.Error.new(e), 0)
end

--- host.trim(s) -> s without surrounding whitespace, at most 2000 characters (for messages).
function M.trim(s)
  s = tostring(s or ""):gsub("^%s+", ""):gsub("%s+$", "")
  if #s > 2000 then s = s:sub(1, 2000) .. " [...]" end
  return s
end

--- host.describe(argv) -> a readable one-line rendering of a command for error messages.
-- Shell scripts passed as `sh -c SCRIPT` are shown by their first line only.
function M.describe(argv)
  local parts = {}
  for i, a in ipairs(argv) do
    a = tostring(a)
    if argv[i - 1] == "-c" then a = a:match("^%s*([^\n]*)") .. (a:find("\n") and " ..." or "") end
    if a:find("[%s'\"]") then a = "'" .. a:gsub("'", "'\\''") .. "'" end
    parts[#parts + 1] = a
  end
  return table.concat(parts, " ")
end

--- host.run(fn, id, argv[, opts]) -> proc.run's result {code, signal, stdout, stderr}. Runs a
-- host command to completion (argv and opts as for proc.run). Raises a structured error
-- (code opts.code or "command_failed") naming the sandbox, the command and its stderr when it
-- exits non-zero or is killed, unless opts.check == false. [yields]
function M.run(fn, id, argv, opts)
  opts = opts or {}
  local spec = { env = opts.env, env_mode = opts.env_mode, input = opts.input,
    stdin = opts.stdin, timeout = opts.timeout, cwd = opts.cwd }
  for i, a in ipairs(argv) do spec[i] = a end
  local r = proc.run(spec)
  if opts.check ~= false and r.code ~= 0 then
    local how = r.code and ("exit " .. r.code) or ("signal " .. tostring(r.signal))
    M.fail(fn, opts.code or "command_failed", id, string.format("%s%s failed (%s): %s",
      id and ("sandbox " .. id .. ": ") or "", opts.what or M.describe(argv), how,
      M.trim(r.stderr ~= "" and r.stderr or r.stdout)), { command = M.describe(argv) })
  end
  return r
end

--- host.read_stream(p, stream) -> everything left on stream ("stdout" or "stderr") of
-- moonbox.proc process p, up to its end. [yields]
function M.read_stream(p, stream)
  local parts = {}
  for chunk in function() return p:read(stream) end do parts[#parts + 1] = chunk end
  return table.concat(parts)
end

--- host.read(path) -> contents, or nil, message when it cannot be read.
function M.read(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s, rerr = f:read("a")
  f:close()
  if not s then return nil, rerr end
  return s
end

--- host.write(path, text) -> true, or nil, message. One write(2) for short texts, which is
-- what cgroup and /proc control files expect; errors of the write show up at close.
function M.write(path, text)
  local f, err = io.open(path, "wb")
  if not f then return nil, err end
  f:setvbuf("no")
  local ok, werr = f:write(text)
  local cok, cerr = f:close()
  if not ok then return nil, werr end
  if not cok then return nil, cerr end
  return true
end

--- host.exists(path) -> boolean: whether path can be opened for reading (files and
-- directories alike; Linux lets fopen open a directory read-only).
function M.exists(path)
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return false
end

--- host.proc_stat(pid) -> {state, ppid, pgrp, session} or nil when the process is gone. Parsed
-- from /proc/<pid>/stat, whose second field (the command name) may hold spaces and
-- parentheses, hence the greedy match up to the last ")".
function M.proc_stat(pid)
  local s = M.read("/proc/" .. pid .. "/stat")
  if not s then return nil end
  local state, ppid, pgrp, session = s:match("^%d+ %(.*%) (%S) (%d+) (%d+) (%d+)")
  if not state then return nil end
  return { state = state, ppid = tonumber(ppid), pgrp = tonumber(pgrp), session = tonumber(session) }
end

--- host.alive(pid) -> boolean: the process exists and is not a zombie.
function M.alive(pid)
  local st = M.proc_stat(pid)
  return st ~= nil and st.state ~= "Z" and st.state ~= "X"
end

-- Undoes the octal escapes (\040 for a space, ...) of /proc/self/mountinfo fields.
local function unescape_mountinfo(s)
  return (s:gsub("\\(%d%d%d)", function(o) return string.char(tonumber(o, 8)) end))
end

--- host.mounted(path) -> boolean: whether something is mounted exactly at path (absolute, no
-- trailing slash) in moonbox's own mount namespace.
function M.mounted(path)
  local info = M.read("/proc/self/mountinfo") or ""
  for line in info:gmatch("[^\n]+") do
    local mp = line:match("^%S+ %S+ %S+ %S+ (%S+)")
    if mp and unescape_mountinfo(mp) == path then return true end
  end
  return false
end

--- host.umount(path[, lazy]) -> "unmounted" or "detached". Unmounts path on a worker thread
-- (the kernel syncs a writable overlay's upper filesystem on unmount, which may take long);
-- with lazy, detaches it when it is busy (as `umount || umount -l`). Raises sys.umount's
-- structured error. [yields]
function M.umount(path, lazy) return sys.umount(path, lazy == true) end

--- host.remove_tree(path). `rm -rf --one-file-system path` on a worker thread (a sandbox's
-- upper directory may hold any number of files). A missing path is fine. Raises
-- sys.remove_tree's structured error naming the entry that could not be removed. [yields]
function M.remove_tree(path) sys.remove_tree(path) end

--- host.hash(s) -> 8 hex digits (FNV-1a, 32 bits). Names directories derived from a
-- configuration (not a security boundary: it only has to make accidental collisions rare).
function M.hash(s)
  local h = 0x811c9dc5
  for i = 1, #s do
    h = ((h ~ s:byte(i)) * 0x01000193) & 0xffffffff
  end
  return string.format("%08x", h)
end

return M
