--- moonbox.db.postgres — moonbox's database on a PostgreSQL server, with the interface of a
-- moonbox.store Db (run, rows, row, value, each, tx, close), so the ledger and the schedule
-- store speak to either store the same way.
--
-- One connection (moonbox.pg, asynchronous on the loop: a call yields its task) shared by every
-- task of the process, one statement or transaction at a time: a lock held by the task whose
-- statement or db:tx is under way, reentrant for that task (statements inside its own tx).
-- SQL is written with `?` placeholders as for SQLite and sent with $1, $2, ... bound (never a
-- value in the text); an INSERT into a table with an id column returns that id as run()'s
-- second result, like SQLite's last_insert_rowid.
--
-- When the server goes away the call raises a structured error (op "db", code
-- "db_unavailable", retryable) and the connection is dropped; the next call connects again,
-- no sooner than a backoff (0.2 s doubling to 5 s) after the last failed attempt, and
-- db:wait_available() waits for the server with that backoff. Errors and logs name the URL
-- with its password replaced by "***" (db.redact).
local pg = require "moonbox.pg"
local core = require "moonbox.core"
local task = require "moonbox.task"
local schema = require "moonbox.db.schema"

local M = {}
local Db = {}
Db.__index = Db

local BACKOFF_MIN, BACKOFF_MAX = 0.2, 5
-- Any constant: the advisory lock migrations take, so that daemons starting at once migrate in
-- turn.
local MIGRATION_LOCK = 7262001
local ID_TABLES = { runs = true, intents = true, schedule_runs = true }

--- postgres.redact(url) -> url with the password (user:PASSWORD@ or password=...) replaced by ***.
function M.redact(url)
  local s = tostring(url)
  s = s:gsub("^(%a[%w+.-]*://[^/@:]*):[^/@]*@", "%1:***@")
  s = s:gsub("([?&]password=)[^&]*", "%1***")
  s = s:gsub("(password%s*=%s*)'[^']*'", "%1***")
  s = s:gsub("(password%s*=%s*)[^%s']+", "%1***")
  return s
end

local function unavailable(self, why)
  -- An outage is not a place in moonbox's code: no where, no traceback in what users read.
  return core.Error.new { op = "db", code = "db_unavailable", retryable = true, where = false,
    traceback = false, message = string.format("the database %s is unavailable: %s", self.shown, why) }
end

-- `?` placeholders -> $1, $2, ... (our SQL has no `?` inside literals).
local translated = setmetatable({}, { __mode = "k" })
local function translate(sql)
  local t = translated[sql]
  if t then return t end
  local n = 0
  t = sql:gsub("%?", function()
    n = n + 1
    return "$" .. n
  end)
  local tbl = t:match("^%s*[Ii][Nn][Ss][Ee][Rr][Tt]%s+[Ii][Nn][Tt][Oo]%s+([%w_]+)")
  if tbl and ID_TABLES[tbl] and not t:upper():find("RETURNING", 1, true) then
    t = t .. " RETURNING id"
  end
  translated[sql] = t
  return t
end

function Db:lock()
  local me = task.current() or "main"
  if self.holder == me then
    self.depth = self.depth + 1
    return
  end
  while self.holder do self.free:wait() end
  self.holder, self.depth = me, 1
end

function Db:unlock()
  self.depth = self.depth - 1
  if self.depth == 0 then
    self.holder = nil
    self.free:broadcast()
  end
end

-- The connection, connected now when needed; raises db_unavailable. Caller holds the lock.
function Db:conn()
  if self.c and self.c:ok() then return self.c end
  if self.c then
    pcall(self.c.close, self.c)
    self.c = nil
  end
  local now = core.time()
  if self.retry_at and now < self.retry_at then
    error(unavailable(self, self.last_error or "not reachable"), 0)
  end
  local ok, c = pcall(pg.connect, self.url)
  if not ok then
    -- The caller's cancellation or deadline is not the server's fault: it passes untouched.
    if type(c) ~= "table" or c.code ~= "connect_failed" then error(c, 0) end
    self.backoff = math.min(BACKOFF_MAX, (self.backoff or BACKOFF_MIN / 2) * 2)
    self.retry_at = core.time() + self.backoff
    self.last_error = (tostring(c.message or c):gsub("%s+", " "))
    error(unavailable(self, self.last_error), 0)
  end
  self.c, self.backoff, self.retry_at = c, nil, nil
  return c
end

-- One statement under the lock. Connection loss becomes db_unavailable.
function Db:query(sql, ...)
  self:lock()
  local ok, rows, n = pcall(function(...)
    local c = self:conn()
    return c:query(translate(sql), ...)
  end, ...)
  if not ok then
    local err = rows
    if type(err) == "table" and err.code == "connection_lost" then
      if self.c then pcall(self.c.close, self.c) end
      self.c = nil
      self.backoff = BACKOFF_MIN
      self.retry_at = core.time() + BACKOFF_MIN
      self.last_error = (tostring(err.message or err):gsub("%s+", " "))
      err = unavailable(self, self.last_error)
    end
    self:unlock()
    error(err, 0)
  end
  self:unlock()
  return rows, n
end

--- db:run(sql, ...) -> changes, id (of a row an INSERT made, for tables with an id). [yields]
function Db:run(sql, ...)
  local rows, n = self:query(sql, ...)
  return n, rows[1] and rows[1].id
end

--- db:rows(sql, ...) -> array of rows (column -> value; NULL columns absent). [yields]
function Db:rows(sql, ...)
  return (self:query(sql, ...))
end

--- db:row(sql, ...) -> the first row or nil. [yields]
function Db:row(sql, ...)
  return (self:query(sql, ...))[1]
end

--- db:value(sql, ...) -> the first column of the first row, or nil. [yields]
function Db:value(sql, ...)
  local rows = self:query(sql, ...)
  local r = rows[1]
  if not r then return nil end
  local _, v = next(r)
  return v
end

--- db:each(sql, ...) -> iterator over the rows (all fetched first). [yields]
function Db:each(sql, ...)
  local rows, i = self:rows(sql, ...), 0
  return function()
    i = i + 1
    return rows[i]
  end
end

--- db:tx(fn, ...) -> fn's results: fn runs inside BEGIN .. COMMIT (ROLLBACK when it raises);
-- other tasks' statements wait until it ends. Nested: runs fn inside the outer transaction.
-- [yields]
function Db:tx(fn, ...)
  self:lock()
  if self.in_tx then
    local r = table.pack(pcall(fn, ...))
    self:unlock()
    if not r[1] then error(r[2], 0) end
    return table.unpack(r, 2, r.n)
  end
  local r = table.pack(pcall(function(...)
    self:query("BEGIN")
    self.in_tx = true
    return fn(...)
  end, ...))
  self.in_tx = false
  if r[1] then
    local ok, err = pcall(self.query, self, "COMMIT")
    if not ok then r = { false, err, n = 2 } end
  elseif self.c and self.c:ok() then
    pcall(self.query, self, "ROLLBACK")
  end
  self:unlock()
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

--- db:wait_available(on_wait): waits until the server answers, connecting again with the
-- backoff; on_wait(message) is called once when it has to wait. [yields]
function Db:wait_available(on_wait)
  local told = false
  while true do
    local ok, err = pcall(self.query, self, "SELECT 1")
    if ok then return end
    if type(err) ~= "table" or err.code ~= "db_unavailable" then error(err, 0) end
    if not told and on_wait then on_wait(tostring(err.message)) end
    told = true
    task.sleep(math.max(0.05, (self.retry_at or core.time()) - core.time()))
  end
end

--- db:migrate(): brings the schema to the newest version (moonbox.db.schema), under an
-- advisory lock so that processes starting at once migrate in turn. [yields]
function Db:migrate()
  local list = schema.postgres
  self:tx(function()
    self:query("SELECT pg_advisory_xact_lock(?)", MIGRATION_LOCK)
    self:query("CREATE TABLE IF NOT EXISTS moonbox_schema (version INTEGER NOT NULL)")
    local v = self:value("SELECT version FROM moonbox_schema")
    if v == nil then
      self:query("INSERT INTO moonbox_schema (version) VALUES (0)")
      v = 0
    end
    if v > #list then
      error(core.Error.new { op = "db", code = "schema_too_new", message = string.format(
        "the database %s has schema version %d, newer than this moonbox knows (%d)", self.shown, v,
        #list) }, 0)
    end
    for i = v + 1, #list do
      for _, stmt in ipairs(schema.statements(list[i])) do self:query(stmt) end
      self:query("UPDATE moonbox_schema SET version = ?", i)
    end
  end)
  return #list
end

function Db:close()
  if self.c and not self.holder then pcall(self.c.close, self.c) end
  self.c = nil
end

--- db:describe() -> the URL with its password redacted.
function Db:describe()
  return self.shown
end

--- postgres.open(url) -> Db, migrated; raises db_unavailable when the server cannot be
-- reached. [yields]
function M.open(url)
  local self = setmetatable({ url = url, shown = M.redact(url), kind = "postgres", shared = true,
    free = core.cond(), depth = 0 }, Db)
  self:migrate()
  return self
end

M.Db = Db
return M
