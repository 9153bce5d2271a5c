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
-- Memory never runs ahead of the database: st:update(kind, rec, fields) writes the record as it
-- will be and changes rec only once that write is durable; a write that fails (a full disk)
-- raises and leaves rec, the memory tables and the database as they were.
local store = require "moonbox.store"
local json = require "moonbox.json"
local core = require "moonbox.core"

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

-- Writes doc (a record's fields; its _seq the row's sequence) as the row of kind doc.id.
-- Raises the store's error. Does not yield.
local function write(self, kind, doc, seq)
  local fields = {}
  for k, v in pairs(doc) do
    if k ~= "_seq" and type(v) ~= "function" and type(v) ~= "userdata" and type(v) ~= "thread" then
      fields[k] = v
    end
  end
  self.db:run([[INSERT INTO records (kind, id, seq, parent, doc, status, grp, name)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(kind, id) DO UPDATE SET doc = excluded.doc,
      parent = excluded.parent, status = excluded.status, grp = excluded.grp, name = excluded.name]],
    kind, doc.id, seq, parent_of(kind, doc), json.encode(fields), status_of(kind, doc),
    kind == "sandbox" and doc.sandboxGroupId or nil, kind == "sandbox" and doc.name or nil)
end

-- Keeps rec in memory while it is live, in the weak cache once it is not.
local function place(self, kind, rec)
  local tbl = self[TABLE[kind]]
  if live(kind, rec) then
    rawset(tbl, rec.id, rec)
  else
    rawset(tbl, rec.id, nil)
    self.cache[kind][rec.id] = rec
  end
end

--- state.write_error(err, kind, id) -> the error a failed record write raises: a structured
-- error (op "local.state", code "disk_full" when the disk or the database is full, else
-- "write_failed") whose message names the record and SQLite's reason (never the SQL or a
-- path); kind, id and cause (the store's error) are fields. Does not raise.
function M.write_error(err, kind, id)
  local sqlite_code = type(err) == "table" and tonumber(err.sqlite_code) or 0
  local msg = type(err) == "table" and tostring(err.message) or tostring(err)
  msg = msg:gsub("%s*%(SQL:.*$", "")
  local full = (sqlite_code & 0xff) == 13 or msg:find("disk is full", 1, true) or
    msg:find("No space left", 1, true)
  return core.Error.new { op = "local.state", code = full and "disk_full" or "write_failed", kind = kind,
    id = id, cause = err, message = string.format("cannot write the record of %s %s: %s", kind, tostring(id),
      full and "the disk is full" or msg) }
end

--- state.NONE: as a value in st:update's fields, removes the field.
M.NONE = setmetatable({}, { __name = "moonbox.local.state.NONE", __tostring = function() return "NONE" end })

--- state:update(kind, rec, fields) -> rec. Writes rec with fields applied (a value state.NONE
-- removes its field) and, once the write is durable, applies them to rec itself and keeps rec
-- in memory while it is live (a new record, rec._seq unset, gets its sequence then). When the
-- write fails nothing changes, rec included, and it raises state.write_error's error (code
-- disk_full or write_failed). Does not yield.
function M:update(kind, rec, fields)
  local doc = {}
  for k, v in pairs(rec) do doc[k] = v end
  for k, v in pairs(fields) do
    if v == M.NONE then doc[k] = nil else doc[k] = v end
  end
  local seq = rec._seq or self.seq + 1
  local ok, err = pcall(write, self, kind, doc, seq)
  if not ok then error(M.write_error(err, kind, rec.id), 0) end
  if not rec._seq then
    self.seq = math.max(self.seq, seq)
    rec._seq = seq
  end
  for k, v in pairs(fields) do
    if v == M.NONE then rec[k] = nil else rec[k] = v end
  end
  place(self, kind, rec)
  return rec
end

--- state:save(kind, rec): writes rec through to the database (rec._seq assigned if new) and
-- keeps it in memory while it is live, in the weak cache once it is not. A caller that changed
-- rec before the write raises the store's error with rec changed: use state:update, which
-- changes nothing unless the write succeeds.
function M:save(kind, rec)
  if not rec._seq then rec._seq = self:next_seq() end
  write(self, kind, rec, rec._seq)
  place(self, kind, rec)
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
