--- moonbox.render.embedded — the embedded local backend: one `moonbox local` per state
-- directory, shared by every moonbox process that uses that directory, and alive exactly as long
-- as one of them is.
--
-- Three files in the state directory carry the protocol between processes:
--   embedded.lock   the start lock (sys.try_lock, exclusive): whoever holds it may look at,
--                   start, join or stop the backend; nobody else does any of that meanwhile;
--   embedded.users  every process using the backend holds a shared lock on it; the kernel
--                   drops it when the process ends, SIGKILL included;
--   embedded.pid    "PID START" of a backend started this way (written by the backend itself,
--                   `moonbox local --embedded`), which tells it from a `moonbox local` a person
--                   started by hand (that one is used, never stopped);
--   embedded.log    the backend's stderr (its complaints), rewritten at each start.
-- The backend's own watcher (lua/moonbox/cli.lua, `moonbox local --embedded`) takes the start
-- lock every 0.2 s and, when it can also take embedded.users exclusively — no process uses it
-- any more, e.g. its last user was SIGKILLed — stops the backend, keeping both locks until its
-- process has ended so that nobody joins a backend that is going away. A process that leaves
-- normally and finds itself the last user stops the backend at once (SIGTERM, then waits for it
-- to end), so `moonbox run` returns with its backend gone. Within one process, concurrent first
-- calls wait for a single join (single flight); later ones share it by reference count.
--
-- Rejected: a pid file of users (a SIGKILLed user leaves a stale entry that needs a liveness
-- check, and pids are reused); the backend as our child (closing the last handle of a child
-- SIGKILLs it, so a second run could not outlive the first). The backend is started through
-- `setsid -f`, which makes it nobody's child and the leader of its own session: a Ctrl-C at the
-- terminal reaches the recipe, never the backend its unwinding still needs.
local sys = require "moonbox.sys"
local proc = require "moonbox.proc"
local http = require "moonbox.http"
local task = require "moonbox.task"
local core = require "moonbox.core"
local build = require "moonbox.build"
local api = require "moonbox.render.api"

local M = {}

M.START_LOCK = "embedded.lock"
M.USERS_LOCK = "embedded.users"
M.PID_FILE = "embedded.pid"
M.LOG_FILE = "embedded.log"

-- How long a process waits for the start lock before it gives up (another process is starting
-- or stopping a backend on the same directory; stopping one with many sandboxes takes a while).
local START_LOCK_WAIT = 300
-- How long a stopped backend gets to end before it is killed.
local STOP_WAIT = 60

local read_file = require("moonbox.path").read_file
local ledger = require "moonbox.ledger"

local function pid_start(pid) return ledger.pid_start(pid) end

--- embedded.backend_pid(dir) -> pid, start of the embedded backend serving dir, or nil when
-- none runs there (or the one there was started by hand).
function M.backend_pid(dir)
  local pid, start = (read_file(dir .. "/" .. M.PID_FILE) or ""):match("^(%d+)%s+(%S+)")
  pid = tonumber(pid)
  if pid and pid_start(pid) == start then return pid, start end
  return nil
end

--- embedded.advertised(dir) -> url, key, workspace of the backend that serves dir, as its files
-- there say (endpoint: "URL WORKSPACE", written by `moonbox local` once it listens, before it
-- has recovered what its previous run left, and removed when it stops; api-key), or nil when
-- either is missing. Nothing is asked of the backend, so a
-- backend that died without removing its endpoint still answers here. Does not yield.
function M.advertised(dir)
  local key = (read_file(dir .. "/api-key") or ""):match("%S+")
  local url, ws = (read_file(dir .. "/endpoint") or ""):match("^(%S+)%s+(%S+)")
  if not (key and url) then return nil end
  return url, key, ws
end

-- Polls a condition with backoff (5 ms doubling to 100 ms) until it holds or `limit` seconds
-- pass; returns whether it held. Another process's lock or exit has no event we could wait on.
local function poll(limit, cond)
  local deadline = task.now() + limit
  local wait = 0.005
  while true do
    if cond() then return true end
    if task.now() >= deadline then return false end
    task.sleep(wait)
    wait = math.min(wait * 2, 0.1)
  end
end

--- Takes the start lock of dir, waiting while another process holds it. [yields]
local function start_lock(dir)
  local lk
  local got = poll(START_LOCK_WAIT, function()
    lk = sys.try_lock(dir .. "/" .. M.START_LOCK, "exclusive")
    return lk ~= nil
  end)
  if got then return lk end
  error(core.Error.new { op = "render.connect", code = "backend_busy", state_dir = dir,
    message = string.format("another moonbox process has held the start lock of the embedded backend " ..
      "(%s/%s) for %d s", dir, M.START_LOCK, START_LOCK_WAIT) }, 0)
end

-- Asks the backend at url how it is: "ready" (it answers /v1), "starting" (it listens but
-- is still recovering what its previous run left: 503 from /_moonbox/health, and /v1 answers
-- 503 too) or nil (nobody answers there). [yields]
local function health(url, key)
  local ok, r = pcall(http.request, { url = url .. "/_moonbox/health", timeout = 2, connect_timeout = 2,
    headers = api.headers(key) })
  if not ok and task.is_interruption(r) then error(r, 0) end
  if not ok then return nil end
  if r.status == 200 then return "ready" end
  if r.status == 503 then return "starting" end
  return nil
end

-- health(url, key), waiting while the backend is starting (up to START_LOCK_WAIT: a recovery
-- that frees many sandboxes takes a while). [yields]
local function healthy(url, key)
  local state = health(url, key)
  if state == "starting" then
    poll(START_LOCK_WAIT, function()
      state = health(url, key)
      return state ~= "starting"
    end)
  end
  return state == "ready"
end

local function say(fmt, ...)
  io.stderr:write("moonbox: ", string.format(fmt, ...), "\n")
end

--- Starts `moonbox local --embedded` on dir and returns its URL, key and workspace once it is
-- ready: `moonbox local` prints them only after its recovery, when /v1 answers. Its stderr
-- goes to dir/embedded.log, not to ours: a backend that outlives this process must not hold the
-- pipe a caller may be reading our output from until its end. [yields]
local function start_backend(dir)
  local log = dir .. "/" .. M.LOG_FILE
  local p <close> = proc.spawn { "setsid", "-f", build.exe, "local", "--embedded", "--quiet", "--port", "0",
    "--state", dir, stderr = { file = log } }
  local lines = p:lines("stdout")
  local env = {}
  for _ = 1, 3 do
    local line = lines()
    if not line then
      local tail = (read_file(log) or ""):sub(-2000):gsub("%s+$", "")
      error(core.Error.new { op = "render.connect", code = "backend_failed", state_dir = dir,
        message = "could not start the embedded local backend on " .. dir ..
          (tail ~= "" and (": " .. tail) or " (" .. log .. " is empty)") }, 0)
    end
    local k, v = line:match("^([%w_]+)=(.*)$")
    if k then env[k] = v end
  end
  p:wait() -- setsid itself, which exited once it had forked the backend
  return env.RENDER_LOCAL_DEV_URL, env.RENDER_API_KEY, env.RENDER_WORKSPACE_ID
end

--- Joins (or starts) the backend of dir for this process, holding the start lock. [yields]
local function join_process(dir)
  sys.mkdir_p(dir, tonumber("700", 8))
  local _start <close> = start_lock(dir)
  -- Nobody can hold embedded.users exclusively now: whoever does holds the start lock too, until
  -- it has let go of both (a last user) or its process has ended (a stopping backend).
  local users = sys.try_lock(dir .. "/" .. M.USERS_LOCK, "shared")
  if not users then
    error(core.Error.new { op = "render.connect", code = "backend_busy", state_dir = dir,
      message = "the users lock " .. dir .. "/" .. M.USERS_LOCK .. " is held exclusively by a process " ..
        "that does not hold the start lock: something else than moonbox uses that file" }, 0)
  end
  local ok, res = pcall(function()
    local url, key, ws = M.advertised(dir)
    if url and healthy(url, key) then
      local pid = M.backend_pid(dir)
      if pid then
        say("sharing the embedded local backend at %s (pid %d, state in %s) with the run that started it",
          url, pid, dir)
      else
        say("using the moonbox local already serving at %s (state in %s)", url, dir)
      end
      return { dir = dir, url = url, key = key, workspace = ws, users = users, managed = pid ~= nil }
    end
    url, key, ws = start_backend(dir)
    say("started an embedded local backend at %s (state in %s); it stops when the last moonbox " ..
      "process using it ends", url, dir)
    return { dir = dir, url = url, key = key, workspace = ws, users = users, managed = true, started = true }
  end)
  if not ok then
    users:unlock() -- a backend we just started sees no user and stops by itself
    error(res, 0)
  end
  return res
end

local members = {} -- state dir -> the join this process holds: {refs, users, url, key, ...}
local joining = {} -- state dir -> cond signalled when a join in progress has finished

--- embedded.join(dir) -> member {dir, url, key, workspace, managed, started}: makes this process
-- a user of the embedded backend serving dir, starting it when none runs there (a one-line
-- notice on stderr says which). Concurrent calls in one process wait for one join and share it
-- (counted: each needs its own embedded.leave). Raises code "backend_failed" when the backend
-- cannot start, "backend_busy" when the start lock stays taken. [yields]
function M.join(dir)
  while joining[dir] do joining[dir]:wait() end
  local m = members[dir]
  if m then
    m.refs = m.refs + 1
    return m
  end
  local done = core.cond()
  joining[dir] = done
  local ok, res = pcall(join_process, dir)
  joining[dir] = nil
  done:broadcast()
  if not ok then error(res, 0) end
  res.refs = 1
  members[dir] = res
  return res
end

--- Stops the backend of dir (SIGTERM, then SIGKILL after STOP_WAIT) and waits until its
-- process has ended. The caller holds the start lock and is the last user. [yields]
local function stop_backend(dir)
  local pid, start = M.backend_pid(dir)
  if not pid then return end
  local function gone() return pid_start(pid) ~= start end
  pcall(sys.kill, pid, 15)
  if poll(STOP_WAIT, gone) then return end
  say("the embedded local backend (pid %d) did not stop within %d s of SIGTERM; killing it", pid, STOP_WAIT)
  pcall(sys.kill, pid, 9)
  poll(10, gone)
end

--- embedded.leave(member): this process stops using the backend (once per join). The last user
-- of a backend started this way stops it and waits until it has ended; a backend started by
-- hand is left running. A cancellation while it waits still lets go of the users lock, so the
-- backend's watcher stops it. [yields]
function M.leave(m)
  m.refs = m.refs - 1
  if m.refs > 0 then return end
  members[m.dir] = nil
  local ok, err = pcall(function()
    local _start <close> = start_lock(m.dir)
    m.users:unlock()
    local last = sys.try_lock(m.dir .. "/" .. M.USERS_LOCK, "exclusive")
    if last then
      if m.managed then stop_backend(m.dir) end
      last:unlock()
    end
  end)
  m.users:unlock()
  if not ok then error(err, 0) end
end

return M
