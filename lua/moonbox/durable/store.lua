--- moonbox.durable.store — where a journal (moonbox.durable) is kept: the run store's table
-- `journal` (a durable run: SQLite or PostgreSQL, moonbox.db), or a cassette file (a recording).
--
-- Both keep entries as JSON text, one per (stream, kind, seq); writing an entry again replaces
-- it (a call's entry is written `started`, then `done`). Every entry is passed through
-- trace.redact before it is written. The cassette format (docs/reference/durable.md, "The
-- journal's format"): the first line is a header object {"moonbox_cassette": 1, recipe, args,
-- workspace, recorded_at, moonbox}; each further line one entry; a later line for the same
-- (s, k, n) replaces an earlier one.
local json = require "moonbox.json"
local trace = require "moonbox.trace"
local core = require "moonbox.core"

local M = {}

M.FORMAT = 1

local function encode(e)
  return trace.redact(json.encode(e))
end

local DbStore = {}
DbStore.__index = DbStore

--- store.db(db, run_id) -> a journal store over moonbox.db handle db for run run_id:
-- s:put(batch) upserts entries (in one transaction), s:load() -> every entry of the run.
-- [yields] on PostgreSQL (put and load).
function M.db(db, run_id)
  return setmetatable({ db = db, run_id = run_id }, DbStore)
end

function DbStore:put(batch)
  local db, run_id = self.db, self.run_id
  local now = core.time()
  db:tx(function()
    for _, e in ipairs(batch) do
      db:run([[INSERT INTO journal (run_id, stream, kind, seq, state, entry, written_at)
        VALUES (?, ?, ?, ?, ?, ?, ?)
        ON CONFLICT (run_id, stream, kind, seq)
        DO UPDATE SET state = excluded.state, entry = excluded.entry, written_at = excluded.written_at]],
        run_id, e.s, e.k, e.n, e.st, encode(e), now)
    end
  end)
end

function DbStore:load()
  local out = {}
  for _, r in ipairs(self.db:rows("SELECT entry FROM journal WHERE run_id = ? ORDER BY stream, kind, seq",
    self.run_id)) do
    local e = json.decode(r.entry)
    if type(e) == "table" then out[#out + 1] = e end
  end
  return out
end

--- store:count() -> how many entries the run's journal holds. [yields] on PostgreSQL.
function DbStore:count()
  return self.db:value("SELECT count(*) AS n FROM journal WHERE run_id = ?", self.run_id) or 0
end

local FileStore = {}
FileStore.__index = FileStore

--- store.cassette(path, header) -> a journal store writing a new cassette at path (replaced if it
-- exists; written to path .. ".part" and renamed into place by s:close(), so a cassette file is
-- always a whole recording). header: recipe, args, workspace. Raises when the file cannot be
-- made. Does not yield.
function M.cassette(path, header)
  local part = path .. ".part"
  local f, err = io.open(part, "wb")
  if not f then error("moonbox: cannot write the cassette: " .. tostring(err), 0) end
  local h = { moonbox_cassette = M.FORMAT, recipe = header.recipe, args = json.array(header.args or {}),
    workspace = header.workspace, recorded_at = os.date("!%Y-%m-%dT%H:%M:%SZ"), moonbox = core.version }
  f:write(encode(h), "\n")
  f:flush()
  return setmetatable({ f = f, path = path, part = part }, FileStore)
end

-- (no flush per entry: a recording cut short is never a cassette — it stays path .. ".part")
function FileStore:put(batch)
  for _, e in ipairs(batch) do self.f:write(encode(e), "\n") end
end

--- store:close(keep) -> the cassette is complete at its path (keep ~= false), or removed.
function FileStore:close(keep)
  if not self.f then return end
  self.f:close()
  self.f = nil
  if keep == false then
    os.remove(self.part)
    return
  end
  local ok, err = os.rename(self.part, self.path)
  if not ok then error("moonbox: cannot write the cassette: " .. tostring(err), 0) end
end

--- store.read_cassette(path) -> header, entries: a cassette's contents (later lines for the same
-- entry replace earlier ones). Raises a message naming path and line when it is not a cassette.
-- Does not yield.
function M.read_cassette(path)
  local f, err = io.open(path, "rb")
  if not f then error("moonbox: cannot read the cassette: " .. tostring(err), 0) end
  local header, byk, order = nil, {}, {}
  local lineno = 0
  for line in f:lines() do
    lineno = lineno + 1
    local v, why = json.decode(line)
    if type(v) ~= "table" then
      f:close()
      error(string.format("moonbox: %s:%d is not a cassette line: %s", path, lineno,
        tostring(why or "not an object")), 0)
    end
    if lineno == 1 then
      if v.moonbox_cassette ~= M.FORMAT then
        f:close()
        error(string.format("moonbox: %s:1 is not a moonbox cassette's header (format %s; this moonbox " ..
          "reads %d)", path, tostring(v.moonbox_cassette), M.FORMAT), 0)
      end
      header = v
    else
      local key = tostring(v.s) .. "\0" .. tostring(v.k) .. "\0" .. tostring(v.n)
      if not byk[key] then order[#order + 1] = key end
      byk[key] = v
    end
  end
  f:close()
  if not header then error("moonbox: " .. path .. " is empty: not a cassette", 0) end
  local entries = {}
  for i, key in ipairs(order) do entries[i] = byk[key] end
  return header, entries
end

return M
