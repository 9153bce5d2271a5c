--- moonbox.local.state — the local backend's records and their persistence.
--
-- Every record lives in SQLite (moonbox.store, WAL), one JSON document per record plus the
-- columns queries need (status, name, group, parent), and is written through on every change.
-- Only the records that can still change are also kept in memory: groups and snapshots not
-- deleted, sandboxes not terminated. A record that ends (a sandbox terminated, a snapshot or a
-- group deleted) leaves the memory tables and stays in a weak cache, so the backend's memory
-- follows what is live, not its history; looking one up (st.sandboxes[id]) reads it back from
-- the database. Exec records are never kept in memory beyond the weak cache: whoever runs an
-- exec holds its record. Iterating a table with pairs() therefore visits the live records only.
-- Lists are keyset pages on indexes ((kind, status, seq) and friends): a page costs
-- O(limit + statuses) reads whatever the history holds. Ordering ("newest first") uses a
-- monotonically increasing sequence number, which is also what list cursors encode.
-- After a restart every record is still there (the live ones are loaded back).
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
  -- Columns for indexed lists: status is the sandbox's or snapshot's status, or "deleted" for
  -- a deleted group or snapshot; grp the sandbox's group; name the sandbox's name.
  [[
  ALTER TABLE records ADD COLUMN status TEXT;
  ALTER TABLE records ADD COLUMN grp TEXT;
  ALTER TABLE records ADD COLUMN name TEXT;
  UPDATE records SET
    status = CASE WHEN json_extract(doc, '$._deleted') THEN 'deleted' ELSE json_extract(doc, '$.status') END,
    grp = CASE kind WHEN 'sandbox' THEN json_extract(doc, '$.sandboxGroupId') END,
    name = CASE kind WHEN 'sandbox' THEN json_extract(doc, '$.name') END;
  CREATE INDEX records_by_status ON records (kind, status, seq);
  CREATE INDEX records_by_group ON records (kind, grp, status, seq);
  CREATE INDEX records_by_name ON records (kind, name, status, seq);
  ]],
}

-- Whether a record of this kind stays in memory: it can still change.
local function live(kind, rec)
  if kind == "sandbox" then return rec.status ~= "terminated" end
  if kind == "exec" then return false end
  return not rec._deleted
end

local function status_of(kind, rec)
  if rec._deleted then return "deleted" end
  if kind == "sandbox" or kind == "snapshot" then return rec.status end
  return nil
end

local function decode(row)
  local rec = json.decode(row.doc)
  if type(rec) ~= "table" then return nil end
  rec._seq = row.seq
  return rec
end

-- A table of one kind: the live records as its own fields, the others looked up in the weak
-- cache, then in the database (and cached there) when indexed by an id that is not live.
local function kind_table(self, kind)
  local cache = setmetatable({}, { __mode = "v" })
  self.cache[kind] = cache
  return setmetatable({}, { __index = function(_, id)
    if type(id) ~= "string" then return nil end
    local rec = cache[id]
    if rec then return rec end
    local row = self.db:row("SELECT seq, doc FROM records WHERE kind = ? AND id = ?", kind, id)
    rec = row and decode(row)
    if rec then cache[id] = rec end
    return rec
  end })
end

--- state.open(path) -> State. Creates or opens the database and loads the live records.
function M.open(path)
  local db = store.open(path)
  db:migrate(MIGRATIONS)
  -- Reads map the file instead of copying pages through read(2): a page of a long history
  -- costs what a page of a short one does (the mapping is the kernel's page cache, shared).
  db:value("PRAGMA mmap_size = 268435456")
  local self = setmetatable({ db = db, seq = 0, cache = {} }, M)
  self.groups = kind_table(self, "group")
  self.sandboxes = kind_table(self, "sandbox")
  self.snapshots = kind_table(self, "snapshot")
  self.execs = kind_table(self, "exec")
  local tables = { group = self.groups, sandbox = self.sandboxes, snapshot = self.snapshots }
  for row in db:each([[SELECT kind, id, seq, doc FROM records WHERE kind IN ('group', 'sandbox', 'snapshot')
      AND (status IS NULL OR status NOT IN ('terminated', 'deleted')) ORDER BY seq]]) do
    local rec = decode(row)
    if rec then rawset(tables[row.kind], row.id, rec) end
  end
  self.seq = db:value("SELECT max(seq) FROM records") or 0
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

local TABLE = { group = "groups", sandbox = "sandboxes", snapshot = "snapshots", exec = "execs" }

--- state:save(kind, rec): writes rec through to the database (rec._seq assigned if new) and
-- keeps it in memory while it is live, in the weak cache once it is not.
function M:save(kind, rec)
  if not rec._seq then rec._seq = self:next_seq() end
  local doc = {}
  for k, v in pairs(rec) do
    if k ~= "_seq" and type(v) ~= "function" and type(v) ~= "userdata" and type(v) ~= "thread" then
      doc[k] = v
    end
  end
  self.db:run([[INSERT INTO records (kind, id, seq, parent, doc, status, grp, name)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(kind, id) DO UPDATE SET doc = excluded.doc,
      parent = excluded.parent, status = excluded.status, grp = excluded.grp, name = excluded.name]],
    kind, rec.id, rec._seq, parent_of(kind, rec), json.encode(doc), status_of(kind, rec),
    kind == "sandbox" and rec.sandboxGroupId or nil, kind == "sandbox" and rec.name or nil)
  local tbl = self[TABLE[kind]]
  if live(kind, rec) then
    rawset(tbl, rec.id, rec)
  else
    rawset(tbl, rec.id, nil)
    self.cache[kind][rec.id] = rec
  end
end

--- state:delete(kind, id): removes a record from the database and from memory.
function M:delete(kind, id)
  self.db:run("DELETE FROM records WHERE kind = ? AND id = ?", kind, id)
  rawset(self[TABLE[kind]], id, nil)
  self.cache[kind][id] = nil
end

-- The record for a row: the one in memory when there is one (the same table every caller
-- sees), else decoded (and cached weakly).
function M:_record(kind, row)
  local rec = rawget(self[TABLE[kind]], row.id) or self.cache[kind][row.id]
  if rec then return rec end
  rec = decode(row)
  if rec then self.cache[kind][row.id] = rec end
  return rec
end

--- state:page_sandboxes{statuses = array, group_id, name, after = seq|nil, limit} -> records
-- newest first with a sequence below after, at most limit of them. One indexed range read per
-- status, merged: O(limit × #statuses) whatever the history holds.
function M:page_sandboxes(q)
  local parts, args = {}, {}
  local where = "kind = 'sandbox' AND status = ? AND seq < ?"
  if q.group_id then where = where .. " AND grp = ?" end
  if q.name then where = where .. " AND name = ?" end
  for _, s in ipairs(q.statuses) do
    parts[#parts + 1] = "SELECT * FROM (SELECT id, seq, doc FROM records WHERE " .. where ..
      " ORDER BY seq DESC LIMIT ?)"
    args[#args + 1] = s
    args[#args + 1] = q.after or math.maxinteger
    if q.group_id then args[#args + 1] = q.group_id end
    if q.name then args[#args + 1] = q.name end
    args[#args + 1] = q.limit
  end
  if #parts == 0 then return {} end
  args[#args + 1] = q.limit
  local sql = table.concat(parts, " UNION ALL ") .. " ORDER BY seq DESC LIMIT ?"
  local out = {}
  for _, row in ipairs(self.db:rows(sql, table.unpack(args))) do
    out[#out + 1] = self:_record("sandbox", row)
  end
  return out
end

--- state:page_children(kind, parent, after, limit) -> records of kind whose parent column is
-- parent (an exec's sandbox), newest first, below sequence after, at most limit.
function M:page_children(kind, parent, after, limit)
  local out = {}
  for _, row in ipairs(self.db:rows([[SELECT id, seq, doc FROM records WHERE kind = ? AND parent = ?
      AND seq < ? ORDER BY seq DESC LIMIT ?]], kind, parent, after or math.maxinteger, limit)) do
    out[#out + 1] = self:_record(kind, row)
  end
  return out
end

--- state:each_with(kind, text) -> array of records of kind whose document contains text
-- (a migration's scan; reads the database, not only the live records).
function M:each_with(kind, text)
  local out = {}
  for _, row in ipairs(self.db:rows("SELECT id, seq, doc FROM records WHERE kind = ? AND instr(doc, ?) > 0",
    kind, text)) do
    out[#out + 1] = self:_record(kind, row)
  end
  return out
end

--- state.sorted(tbl, filter) -> array of the live records of tbl newest first (by sequence)
-- passing filter.
function M.sorted(tbl, filter)
  local out = {}
  for _, rec in pairs(tbl) do
    if not filter or filter(rec) then out[#out + 1] = rec end
  end
  table.sort(out, function(a, b) return a._seq > b._seq end)
  return out
end

return M
