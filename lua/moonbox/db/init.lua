--- moonbox.db — the one owner of moonbox's database: where it is, its schema, and a handle
-- with the same interface on both stores.
--
-- The ledger (moonbox.ledger), the schedule state and run history (moonbox.schedule.store)
-- live in one database:
--   * SQLite (the embedded default): $XDG_STATE_HOME/moonbox/moonbox.db (created 0600), or
--     the file `--state PATH` names. One machine; liveness of a run is its process (pid and
--     process start time).
--   * PostgreSQL: `--state postgres://...` or MOONBOX_DATABASE_URL (a postgres:// or
--     postgresql:// URL). Shared by every machine that names it; liveness of a run is a lease
--     its process renews (moonbox.db.lease).
-- db.open migrates the schema to the newest version (moonbox.db.schema owns the migrations of
-- both stores) before it returns.
--
-- The handle answers run/rows/row/value/each/tx/close as a moonbox.store Db does; SQL uses `?`
-- placeholders and the subset both stores understand. Its fields: kind ("sqlite" or
-- "postgres"), shared (true on PostgreSQL: other machines' daemons use the same rows), and
-- describe() (the path, or the URL with its password redacted). On SQLite no call yields; on
-- PostgreSQL every call may yield its task (and raises code "db_unavailable" while the server
-- is away).
local path_mod = require "moonbox.path"
local schema = require "moonbox.db.schema"

local M = {}

local explicit -- set by --state (db.set_target), wins over MOONBOX_DATABASE_URL

--- db.is_url(s) -> whether s names a PostgreSQL database (postgres:// or postgresql://).
function M.is_url(s)
  return type(s) == "string" and (s:match("^postgres://") or s:match("^postgresql://")) ~= nil
end

--- db.redact(s) -> s with a URL's password replaced by *** (safe in errors and logs).
function M.redact(s)
  return require("moonbox.db.postgres").redact(s) -- lazy: moonbox.db.postgres loads libpq (moonbox.pg)
end

--- db.set_target(s): the database this process uses from now on: a postgres:// URL or a
-- SQLite file path (`--state`); nil goes back to the default. Does not yield.
function M.set_target(s)
  explicit = s
end

--- db.target() -> kind, where: ("postgres", URL) or ("sqlite", path), from --state, else
-- MOONBOX_DATABASE_URL, else the state dir's moonbox.db. Does not yield.
function M.target()
  local s = explicit
  if s == nil or s == "" then s = os.getenv("MOONBOX_DATABASE_URL") end
  if s ~= nil and s ~= "" then
    if M.is_url(s) then return "postgres", s end
    if s:match("^%a[%w+.-]*://") then
      error(string.format("moonbox: the database %s is not a postgres:// URL nor a file path",
        M.redact(s)), 0)
    end
    return "sqlite", s
  end
  return "sqlite", nil
end

-- A SQLite database through moonbox.store, with the same methods as a PostgreSQL one.
local Sqlite = {}
Sqlite.__index = Sqlite
for _, m in ipairs { "run", "rows", "row", "value", "each", "tx", "exec" } do
  Sqlite[m] = function(self, ...) return self.h[m](self.h, ...) end
end
function Sqlite:close()
  if self.h then self.h:close() end
  self.h = nil
end
function Sqlite:describe() return self.path end
function Sqlite.wait_available() end

local function open_sqlite(path)
  if not path then
    local dir = path_mod.state_home()
    os.execute("mkdir -p -m 0700 '" .. dir:gsub("'", "'\\''") .. "'")
    path = dir .. "/moonbox.db"
  end
  local h = require("moonbox.store").open(path) -- lazy: SQLite, which a PostgreSQL database never needs
  h:migrate(schema.sqlite)
  return setmetatable({ h = h, path = path, kind = "sqlite", shared = false }, Sqlite)
end

--- db.open([where]) -> Db, migrated. where: a postgres:// URL, a SQLite path, or nil for
-- db.target(). [yields] on PostgreSQL.
function M.open(where)
  local kind
  if where == nil then
    kind, where = M.target()
  else
    kind = M.is_url(where) and "postgres" or "sqlite"
  end
  -- lazy: moonbox.db.postgres loads libpq (moonbox.pg), which a SQLite database never needs
  if kind == "postgres" then return require("moonbox.db.postgres").open(where) end
  return open_sqlite(where)
end

return M
