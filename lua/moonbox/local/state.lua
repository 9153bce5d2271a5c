--- moonbox.local.state — the local backend's records and their persistence.
--
-- Records live in memory (the API answers from these tables) and are written through to
-- SQLite (moonbox.store, WAL) on every change, as one JSON document per record plus the
-- columns queries need. At start the database is read back, so after a restart every group,
-- sandbox, snapshot and exec record is still there. Ordering ("newest first") uses a
-- monotonically increasing sequence number, which is also what list cursors encode.
local store = require "moonbox.store"
local json = require "moonbox.json"

local M = {}
M.__index = M

local MIGRATIONS = {
  [[
  CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
  CREATE TABLE records (
    kind TEXT NOT NULL,            -- group | sandbox | snapshot | exec
    id   TEXT NOT NULL,
    seq  INTEGER NOT NULL,
    parent TEXT,                   -- sandbox id of an exec; group id of a snapshot
    doc  TEXT NOT NULL,            -- the record as JSON
    PRIMARY KEY (kind, id)
  );
  CREATE INDEX records_by_parent ON records (kind, parent, seq);
  ]],
}

--- state.open(path) -> State. Creates or opens the database and loads every record.
function M.open(path)
  local db = store.open(path)
  db:migrate(MIGRATIONS)
  local self = setmetatable({
    db = db, seq = 0,
    groups = {}, sandboxes = {}, snapshots = {}, execs = {},
  }, M)
  local tables = { group = self.groups, sandbox = self.sandboxes, snapshot = self.snapshots,
    exec = self.execs }
  for row in db:each("SELECT kind, id, seq, doc FROM records ORDER BY seq") do
    local rec = json.decode(row.doc)
    if rec and tables[row.kind] then
      rec._seq = row.seq
      tables[row.kind][row.id] = rec
    end
    if row.seq > self.seq then self.seq = row.seq end
  end
  return self
end

function M:close()
  if self.db then self.db:close() end
  self.db = nil
end

--- state:meta(key) -> value or nil; state:set_meta(key, value).
function M:meta(key)
  return self.db:value("SELECT value FROM meta WHERE key = ?", key)
end

function M:set_meta(key, value)
  self.db:run([[INSERT INTO meta (key, value) VALUES (?, ?)
    ON CONFLICT(key) DO UPDATE SET value = excluded.value]],
    key, value)
end

--- state:next_seq() -> a new sequence number (newer records get larger numbers).
function M:next_seq()
  self.seq = self.seq + 1
  return self.seq
end

local function parent_of(kind, rec)
  if kind == "exec" then return rec.sandboxId end
  if kind == "snapshot" then return rec.sandboxGroupId end
  return nil
end

--- state:save(kind, rec): writes rec through to the database (rec._seq assigned if new).
function M:save(kind, rec)
  if not rec._seq then rec._seq = self:next_seq() end
  local doc = {}
  for k, v in pairs(rec) do
    if k ~= "_seq" and type(v) ~= "function" and type(v) ~= "userdata" and type(v) ~= "thread" then
      doc[k] = v
    end
  end
  self.db:run([[INSERT INTO records (kind, id, seq, parent, doc) VALUES (?, ?, ?, ?, ?)
    ON CONFLICT(kind, id) DO UPDATE SET doc = excluded.doc, parent = excluded.parent]],
    kind, rec.id, rec._seq, parent_of(kind, rec), json.encode(doc))
end

--- state:delete(kind, id): removes a record from the database (the caller drops it from memory).
function M:delete(kind, id)
  self.db:run("DELETE FROM records WHERE kind = ? AND id = ?", kind, id)
end

--- state:sorted(tbl, filter) -> array of records newest first (by sequence) passing filter.
function M.sorted(tbl, filter)
  local out = {}
  for _, rec in pairs(tbl) do
    if not filter or filter(rec) then out[#out + 1] = rec end
  end
  table.sort(out, function(a, b) return a._seq > b._seq end)
  return out
end

return M
