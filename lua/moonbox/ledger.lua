--- moonbox.ledger — what every run created, written down before it exists (DESIGN.md §6).
--
-- `$XDG_STATE_HOME/moonbox/moonbox.db` (SQLite, WAL) holds one row per `moonbox run` (pid,
-- process start time, recipe, backend, start, end, outcome) and one row per sandbox create:
-- the *intent* is written before the request goes out, the sandbox id as soon as the answer
-- names it, and the release when it is terminated. A run that died (SIGKILL, power loss)
-- therefore leaves exactly what it held behind in the ledger, and `moonbox reap` can finish
-- its cleanup; a create whose answer was lost is an intent without an id, which reap
-- reconciles by the name label every create carries ("mb-<intent id>").
local store = require "moonbox.store"
local core = require "moonbox.core"

local M = {}
local Ledger = {}
Ledger.__index = Ledger

local MIGRATIONS = {
  [[
  CREATE TABLE runs (
    id INTEGER PRIMARY KEY, pid INTEGER NOT NULL, pid_start TEXT, recipe TEXT,
    backend TEXT NOT NULL, workspace TEXT, started_at REAL NOT NULL, ended_at REAL, outcome TEXT
  );
  CREATE TABLE intents (
    id INTEGER PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES runs(id),
    created_at REAL NOT NULL, label TEXT NOT NULL, sandbox_id TEXT, released_at REAL, outcome TEXT
  );
  CREATE INDEX intents_by_run ON intents (run_id);
  CREATE INDEX intents_by_sandbox ON intents (sandbox_id);
  ]],
}

local state_home = require("moonbox.path").state_home

--- The start time of process pid (field 22 of /proc/PID/stat), so a reused pid is not mistaken
-- for the run that died.
local function pid_start(pid)
  local f = io.open("/proc/" .. pid .. "/stat")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  local rest = s:match("%) (.*)$")
  if not rest then return nil end
  local i = 2 -- rest starts at field 3
  for field in rest:gmatch("%S+") do
    i = i + 1
    if i == 22 then return field end
  end
end
M.pid_start = pid_start

--- ledger.open(path) -> Ledger (default path: the state dir's moonbox.db, created 0600).
function M.open(path)
  if not path then
    local dir = state_home()
    os.execute("mkdir -p -m 0700 '" .. dir:gsub("'", "'\\''") .. "'")
    path = dir .. "/moonbox.db"
  end
  local db = store.open(path)
  db:migrate(MIGRATIONS)
  return setmetatable({ db = db, path = path }, Ledger)
end

--- ledger:begin_run{recipe, backend, workspace} -> run id: a run record for this process.
function Ledger:begin_run(info)
  local pid = M.self_pid()
  local _, id = self.db:run([[INSERT INTO runs (pid, pid_start, recipe, backend, workspace, started_at)
    VALUES (?, ?, ?, ?, ?, ?)]], pid, pid_start(pid), info.recipe, info.backend, info.workspace, core.time())
  self.run_id = id
  return id
end

--- ledger:end_run(outcome): marks this process's run finished ("ok", "failed", "interrupted").
function Ledger:end_run(outcome)
  if not self.run_id then return end
  self.db:run("UPDATE runs SET ended_at = ?, outcome = ? WHERE id = ?", core.time(), outcome, self.run_id)
end

--- ledger:intent() -> intent id, label: written before a create is sent; label goes into the
-- sandbox's name so a lost answer can still be attributed.
function Ledger:intent()
  local t = core.time()
  local _, id = self.db:run("INSERT INTO intents (run_id, created_at, label) VALUES (?, ?, '')",
    self.run_id, t)
  local label = "mb-" .. id .. "-" .. (self.run_id or 0)
  self.db:run("UPDATE intents SET label = ? WHERE id = ?", label, id)
  return id, label
end

--- ledger:bind(intent, sandbox_id): the create answered with this id.
function Ledger:bind(intent, sandbox_id)
  self.db:run("UPDATE intents SET sandbox_id = ? WHERE id = ?", sandbox_id, intent)
end

--- ledger:fail(intent, outcome): the create certainly did not create anything.
function Ledger:fail(intent, outcome)
  self.db:run("UPDATE intents SET released_at = ?, outcome = ? WHERE id = ?", core.time(), outcome, intent)
end

--- ledger:release(sandbox_id): the sandbox was terminated.
function Ledger:release(sandbox_id)
  self.db:run([[UPDATE intents SET released_at = ?, outcome = 'terminated'
    WHERE sandbox_id = ? AND released_at IS NULL]], core.time(), sandbox_id)
end

--- ledger:runs() -> array of runs with `alive` and `held` (unreleased intents) filled in.
function Ledger:runs()
  local out = {}
  for _, r in ipairs(self.db:rows("SELECT * FROM runs ORDER BY id")) do
    r.alive = r.ended_at == nil and pid_start(r.pid) ~= nil and pid_start(r.pid) == r.pid_start
    r.held = self.db:rows("SELECT * FROM intents WHERE run_id = ? AND released_at IS NULL ORDER BY id", r.id)
    out[#out + 1] = r
  end
  return out
end

function Ledger:close()
  if self.db then self.db:close() end
  self.db = nil
end

--- ledger.self_pid() -> this process's pid (from /proc/self).
function M.self_pid()
  local target = io.open("/proc/self/stat")
  local s = target:read("a")
  target:close()
  return tonumber(s:match("^(%d+)"))
end

M.Ledger = Ledger
return M
