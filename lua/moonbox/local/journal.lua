--- moonbox.local.journal — the request journal of `moonbox local` (GET /_moonbox/journal).
--
-- Tests read it to see exactly what a client sent. It only ever holds authenticated requests
-- (the server answers the others before their body is read), with secrets redacted: the
-- Authorization value, and the values of a create's env. It is bounded twice, by entries and by
-- bytes, so a client cannot grow the backend's memory through it; the oldest entries go first.
-- An entry holds strings only, and its size counts every one of them (path, query, headers,
-- body): a body is kept as its (redacted) JSON text when it is at most BODY_MAX bytes, and
-- decoded again only when the journal is read. Keeping the decoded table instead cost up to ten
-- times the text (a 16 KB array of small numbers is a 128 KB table) outside the byte count.
local core = require "moonbox.core"
local json = require "moonbox.json"

local M = {}
local Journal = {}
Journal.__index = Journal

local REDACTED = "<redacted>"
local BODY_MAX = 16 * 1024

--- Journal.new{max_entries = n, max_bytes = n} -> Journal.
function M.new(opts)
  opts = opts or {}
  return setmetatable({ entries = {}, first = 1, last = 0, bytes = 0, seq = 0,
    max_entries = opts.max_entries or 10000, max_bytes = opts.max_bytes or 16 * 1024 * 1024 }, Journal)
end

-- A copy of a decoded request body with env values redacted.
local function redact_body(body)
  if type(body) ~= "table" then return body end
  local out = {}
  for k, v in pairs(body) do
    if k == "env" and type(v) == "table" then
      local env = {}
      for name in pairs(v) do env[name] = REDACTED end
      out[k] = env
    else
      out[k] = v
    end
  end
  return out
end

local function size_of(e)
  local n = 200 + #(e.path or "") + #(e.query or "") + #(e.body_json or "") + #(e.body_text or "")
  for k, v in pairs(e.headers) do n = n + #k + #v + 40 end
  return n
end

--- j:record(req, decoded_body) -> entry. Adds an entry for req (method, path, query, a few
-- headers, the body as JSON text when it is small, else its size) and evicts the oldest
-- beyond the bounds. The caller fills in entry.status (and entry.fault) later.
function Journal:record(req, body)
  self.seq = self.seq + 1
  local headers = {}
  for _, h in ipairs({ "content-type", "accept", "content-encoding", "accept-encoding", "user-agent",
    "content-length" }) do
    headers[h] = req.headers[h]
  end
  if req.headers["authorization"] then
    headers.authorization = (req.headers["authorization"]:match("^(%S+)") or "") .. " " .. REDACTED
  end
  local entry = { seq = self.seq, at = os.date("!%Y-%m-%dT%H:%M:%SZ"), t = core.time(), method = req.method,
    path = req.path, query = req.query, headers = headers }
  if req.body_file then
    entry.body_bytes = req.body_size
  elseif req.body and req.body ~= "" then
    if type(body) == "table" and #req.body <= BODY_MAX then
      local ok, text = pcall(json.encode, redact_body(body))
      entry.body_json = ok and text or nil
    end
    if not entry.body_json then
      if body == nil and #req.body <= 4096 then entry.body_text = req.body end
      entry.body_bytes = #req.body
    end
  end
  entry.size = size_of(entry)
  self.last = self.last + 1
  self.entries[self.last] = entry
  self.bytes = self.bytes + entry.size
  while self.last - self.first + 1 > self.max_entries or self.bytes > self.max_bytes do
    local old = self.entries[self.first]
    self.entries[self.first] = nil
    self.first = self.first + 1
    self.bytes = self.bytes - old.size
  end
  return entry
end

--- j:since(seq) -> array of the entries after seq (oldest first), ready for JSON: a kept body
-- both as its text (body_json, exactly as journaled) and decoded (body).
function Journal:since(seq)
  local out = json.array()
  for i = self.first, self.last do
    local e = self.entries[i]
    if e.seq > seq then
      local copy = {}
      for k, v in pairs(e) do if k ~= "size" then copy[k] = v end end
      if e.body_json then copy.body = json.decode(e.body_json) end
      out[#out + 1] = copy
    end
  end
  return out
end

--- j:clear(): forgets every entry (sequence numbers go on).
function Journal:clear()
  self.entries, self.first, self.last, self.bytes = {}, 1, 0, 0
end

return M
