--- moonbox.local.http.memory — moonbox local's routes served in memory: a server object with
-- the part of moonbox.httpd's interface the routes use (srv:route, set_key, token_put,
-- token_drop; req and res as httpd builds them), and a transport with moonbox.http's
-- request/stream interface that hands each request straight to those routes. No socket, no
-- thread, no process: the dry run (moonbox.dryrun) runs the real wire (moonbox.local.http) and
-- service over it.
--
-- What it does as httpd does: routes tried in the order added (":name" captures a segment, a
-- final "*" the rest; "*" as method takes any, a GET route answers HEAD); the API key of auth =
-- "key" routes and the single-use connect tokens of auth = "token" routes checked before the
-- handler runs, refused with the server's own 401/403 answers; each handler in a task of its
-- own; a handler that fails or answers nothing is a 500. Query values and the path are
-- percent-decoded; header names lower-cased.
-- What it does otherwise: a "file" body route gets req.body_file = the client's body_file (a
-- host path, never removed here) or {data = bytes} for a body given as a string (moonbox.local.
-- engine.sim reads both); nothing is bounded by max_body or free space; a stream's writer never
-- waits for the reader.
-- What only it carries: opts.intent of a request (the client's structured command, moonbox.
-- render.exec) becomes req.intent, which the runs routes hand to the service; the real
-- transport sends only the wire body.
local task = require "moonbox.task"
local core = require "moonbox.core"
local json = require "moonbox.json"

local M = {}

local Server = {}
Server.__index = Server
M.Server = Server

--- memory.new(clock) -> Server: no routes yet. clock.now() (monotonic seconds) times the
-- connect tokens. Does not yield.
function M.new(clock)
  return setmetatable({ routes = {}, tokens = {}, clock = clock or { now = core.now }, requests = 0 }, Server)
end

-- Compiles "/a/:x/*" into a matcher of paths: captures by name, rest for a final "*".
local function compile(pattern)
  local segs = {}
  for seg in pattern:gmatch("[^/]+") do segs[#segs + 1] = seg end
  return function(path)
    local parts = {}
    for seg in path:gmatch("[^/]+") do parts[#parts + 1] = seg end
    local caps = {}
    for i, seg in ipairs(segs) do
      if seg == "*" and i == #segs then
        caps.rest = table.concat(parts, "/", i)
        return caps
      end
      local part = parts[i]
      if not part then return nil end
      if seg:sub(1, 1) == ":" then
        caps[seg:sub(2)] = part
      elseif seg ~= part then
        return nil
      end
    end
    if #parts ~= #segs then return nil end
    return caps
  end
end

--- srv:route(method, pattern, handler, opts) -> srv: as moonbox.httpd's (auth, scope, body).
function Server:route(method, pattern, handler, opts)
  self.routes[#self.routes + 1] = { method = method:upper(), match = compile(pattern), handler = handler,
    opts = opts or {} }
  return self
end

--- srv:set_key(key) / srv:token_put(token, id, scope, ttl) / srv:token_drop(token): as
-- moonbox.httpd's. Do not yield.
function Server:set_key(key)
  self.key = key
  return self
end

-- (see srv:set_key)
function Server:token_put(token, id, scope, ttl)
  self.tokens[token] = { id = id, scope = scope, expires = self.clock.now() + ttl }
  return self
end

function Server:token_drop(token) self.tokens[token] = nil end

--- srv:close(): nothing is listening; later requests are refused as a closed server's. Does not yield.
function Server:close() self.closed = true end

-- ---- requests and answers -----------------------------------------------------------------

-- s with its %XX escapes decoded.
local function unescape(s)
  return (s:gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end))
end

-- The query string's {name, value} pairs in order, decoded ("+" is a space).
local function parse_query(q)
  local list = {}
  for pair in (q or ""):gmatch("[^&]+") do
    local k, v = pair:match("^([^=]*)=?(.*)$")
    list[#list + 1] = { unescape((k:gsub("+", " "))), unescape((v:gsub("+", " "))) }
  end
  return list
end

local Request = {}
Request.__index = Request

--- req:query_param(name) / req:query_all(name) / req:header(name): as moonbox.httpd's.
function Request:query_param(name)
  for _, kv in ipairs(self._query) do if kv[1] == name then return kv[2] end end
  return nil
end

function Request:query_all(name)
  local out = {}
  for _, kv in ipairs(self._query) do if kv[1] == name then out[#out + 1] = kv[2] end end
  return out
end

function Request:header(name) return self.headers[name:lower()] end

-- The bytes of a client's body_file; raises as moonbox.http does for one it cannot read.
local function read_file(path)
  local f = io.open(path, "rb")
  if not f then
    error(core.Error.new { op = "http.request", code = "file_error", message = "cannot read " .. path }, 0)
  end
  local s = f:read("a")
  f:close()
  return s
end

-- The answer a request is building: status, headers (lower-cased), body chunks or events, and
-- the cond its reader waits on.
local Response = {}
Response.__index = Response

-- A Response nobody has answered yet.
local function new_response()
  return setmetatable({ cond = core.cond(), chunks = {}, events = {}, head = 1 }, Response)
end

-- Sets the answer's status and headers (names lower-cased; default_type when the body has one
-- and no Content-Type was given); raises when an answer was sent already.
local function set_head(self, status, headers, default_type, has_body)
  if self.status then error("res: an answer was sent already", 3) end
  self.status = status
  local h = {}
  for k, v in pairs(headers or {}) do
    h[k:lower()] = type(v) == "table" and table.concat(v, ", ") or tostring(v)
  end
  if h["content-type"] == nil and (has_body or default_type ~= "text/plain; charset=utf-8") then
    h["content-type"] = default_type
  end
  self.headers = h
  self.cond:broadcast()
end

--- res:send(status, body, headers) -> true. [does not yield]
function Response:send(status, body, headers)
  set_head(self, status, headers, "text/plain; charset=utf-8", body ~= nil and body ~= "")
  self.chunks[1] = body or ""
  self.ended = true
  self.cond:broadcast()
  return true
end

--- res:drop() -> true: the client sees its connection reset. [does not yield]
function Response:drop()
  if self.status then error("res: an answer was sent already", 2) end
  self.dropped = true
  self.ended = true
  self.cond:broadcast()
  return true
end

--- res:send_file(status, path, headers) -> true: the file's bytes, read now. [does not yield]
function Response:send_file(status, path, headers)
  local data = read_file(path)
  set_head(self, status, headers, "application/octet-stream", true)
  self.chunks[1] = data
  self.ended = true
  self.cond:broadcast()
  return true
end

--- res:sent() -> whether an answer was started.
function Response:sent() return self.status ~= nil or self.dropped == true end

local Writer = {}
Writer.__index = Writer

-- Raises what a writer gets once its client has gone (code client_gone, as httpd's).
local function client_gone(w)
  error(core.Error.new { op = "w:write", code = "client_gone", message = "the client went away" }, 0)
  return w
end

-- Queues a body chunk (a string) or an event (a table) for the reader and wakes it.
local function push(w, item)
  local r = w.res
  if r.closed_by_client then client_gone(w) end
  if w.closed then error("w:write: the stream is closed", 3) end
  if type(item) == "string" then r.chunks[#r.chunks + 1] = item else r.events[#r.events + 1] = item end
  r.cond:broadcast()
end

--- res:stream(status, headers) -> Writer (write, sse, sse_output, comment, close, pending).
function Response:stream(status, headers)
  set_head(self, status, headers, "text/plain; charset=utf-8", true)
  self.streaming = true
  return setmetatable({ res = self }, Writer)
end

--- w:write(chunk), w:sse(event, data), w:sse_output(stream, data), w:comment(text),
-- w:pending() -> 0: as httpd's writers (an event is handed to the reader as it is, never
-- serialised; a comment is dropped). Raise client_gone once the reader closed. Do not yield.
function Writer:write(chunk) push(self, chunk) end
function Writer:sse(event, data) push(self, { event = event, data = data }) end
function Writer:sse_output(stream, data) push(self, { event = "output", stream = stream, data = data }) end
function Writer:comment() if self.res.closed_by_client then client_gone(self) end end
function Writer.pending() return 0 end

--- w:close(): ends the stream after what is queued. Idempotent. Does not yield.
function Writer:close()
  if self.closed then return end
  self.closed = true
  self.res.ended = true
  self.res.cond:broadcast()
end

-- ---- dispatch ------------------------------------------------------------------------------

-- Answers {"message": message} with status, as the server's own refusals are.
local function refuse(res, status, message)
  res:send(status, json.encode({ message = message }), { ["Content-Type"] = "application/json" })
end

-- The server's own checks of a route's auth (runtime/http_server.c, hs_check_auth): returns
-- nil, or the status and message of the refusal.
local function check_auth(self, rt, req)
  local o = rt.opts
  if not o.auth or o.auth == "none" then return nil end
  local bearer = (req.headers.authorization or ""):match("^[Bb]earer%s+(%S+)%s*$")
  if o.auth == "key" then
    if bearer and self.key and bearer == self.key then return nil end
    return 401, "unauthorized: send Authorization: Bearer <RENDER_API_KEY>"
  end
  local t = bearer and self.tokens[bearer]
  if not t then return 401, "invalid or missing connect token" end
  if t.expires < self.clock.now() then return 401, "connect token expired; mint a new one" end
  if req.captures.id ~= t.id or o.scope ~= t.scope then
    return 403, "this connect token is for another sandbox or operation"
  end
  if t.used then
    return 403, "this connect token was used already: a token opens its endpoint once; mint a new one"
  end
  t.used = true
  return nil
end

-- Starts the handling of one request (opts as moonbox.http's) in a task of its own; returns the
-- Response it fills.
function Server:dispatch(opts)
  self.requests = self.requests + 1
  local res = new_response()
  local method = (opts.method or "GET"):upper()
  local target = opts.url:match("^https?://[^/]+(/.*)$") or "/"
  local raw_path, q = target:match("^([^?]*)%??(.*)$")
  local path = unescape(raw_path)
  local headers = {}
  for k, v in pairs(opts.headers or {}) do headers[k:lower()] = tostring(v) end
  if opts.accept_encoding then headers["accept-encoding"] = opts.accept_encoding end
  headers.host = headers.host or opts.url:match("^https?://([^/]+)")
  local req = setmetatable({ method = method, path = path, target = target, query = q,
    _query = parse_query(q), remote = "127.0.0.1", remote_port = 0, headers = headers,
    intent = opts.intent }, Request)
  local params = {}
  for _, kv in ipairs(req._query) do if params[kv[1]] == nil then params[kv[1]] = kv[2] end end
  req.params = params
  local route
  for _, rt in ipairs(self.routes) do
    if rt.method == "*" or rt.method == method or (rt.method == "GET" and method == "HEAD") then
      local caps = rt.match(path)
      if caps then
        route, req.captures = rt, caps
        break
      end
    end
  end
  if self.closed then
    res:drop()
    return res
  end
  if not route then
    refuse(res, 404, "no route for " .. method .. " " .. path)
    return res
  end
  local status, message = check_auth(self, route, req)
  if status then
    refuse(res, status, message)
    return res
  end
  if route.opts.body == "file" then
    req.body_file = opts.body_file or { data = opts.body or "" }
    req.body_size = opts.body_file and #read_file(opts.body_file) or #(opts.body or "")
  else
    req.body = opts.body or (opts.body_file and read_file(opts.body_file)) or ""
  end
  local t = task.spawn(function()
    local ok, err = pcall(route.handler, req, res)
    if not res:sent() then
      if ok and type(err) == "number" then
        res:send(err, "", {})
      else
        refuse(res, task.is_cancelled(err) and 503 or 500, ok and "the handler sent no answer" or
          ("internal error: " .. tostring(err)))
      end
    elseif not res.ended then
      res.broken = not ok
      res.ended = true
      res.cond:broadcast()
    end
  end)
  core.observe(t)
  res.task = t
  return res
end

-- Waits until res has its status (or was dropped); raises a dropped one as moonbox.http would.
local function wait_head(res)
  while not res:sent() do res.cond:wait() end
  if res.dropped then
    error(core.Error.new { op = "http.request", code = "connection_reset", retryable = true,
      message = "the connection was closed before an answer came (moonbox local dropped it)" }, 0)
  end
end

--- srv:request(opts) -> {status, headers, body}: one request answered whole, as http.request
-- answers it (opts.output_file: the body goes there and body is ""). [yields] until the handler
-- has answered.
function Server:request(opts)
  local res = self:dispatch(opts)
  wait_head(res)
  while not res.ended do res.cond:wait() end
  local body = table.concat(res.chunks)
  if opts.output_file then
    local f = assert(io.open(opts.output_file, "wb"))
    f:write(body)
    f:close()
    body = ""
  end
  return { status = res.status, headers = res.headers, body = body }
end

--- srv:stream(opts) -> a response as http.stream gives it: status, headers, read() (the next
-- body chunk, nil at the end), read_event() ({event, data}), read_output() (an output event as
-- "output", stream, bytes; others as event, nil, data), close(). [yields] until the headers.
function Server:stream(opts)
  local res = self:dispatch(opts)
  wait_head(res)
  local r = { status = res.status, headers = res.headers }
  local function next_event()
    while true do
      local e = res.events[res.head]
      if e then
        res.events[res.head] = nil
        res.head = res.head + 1
        return e
      end
      if res.ended or res.closed_by_client then return nil end
      res.cond:wait()
    end
  end
  function r.read_event()
    local e = next_event()
    if not e then return nil end
    if e.stream then return { event = "output", data = json.encode({ stream = e.stream, data = e.data }) } end
    return { event = e.event, data = e.data }
  end
  function r.read_output()
    local e = next_event()
    if not e then return nil end
    if e.stream then return "output", e.stream, e.data end
    return e.event, nil, e.data
  end
  local taken = 0
  function r.read()
    while true do
      if taken < #res.chunks then
        taken = taken + 1
        local c = res.chunks[taken]
        res.chunks[taken] = ""
        if c ~= "" then return c end
      elseif res.ended or res.closed_by_client then
        return nil
      else
        res.cond:wait()
      end
    end
  end
  function r.close()
    res.closed_by_client = true
    res.cond:broadcast()
  end
  return setmetatable(r, { __close = function() r.close() end, __index = {} })
end

--- srv:transport() -> {request, stream}: what a connection's transport is (moonbox.render.conn).
function Server:transport()
  return { request = function(o) return self:request(o) end, stream = function(o) return self:stream(o) end }
end

return M
