--- moonbox.http_schema — the declared calls of moonbox.http (a C module: bindings/http.c), and
-- the check that puts them in front of it.
--
-- libcurl's binding reads the options it knows and ignores any other key, so a misspelt
-- `timeuot = 5` would send a request with no timeout. This module declares http.request and
-- http.stream (moonbox.schema) and, once installed, every `require "moonbox.http"` returns the
-- C module with those two functions checked first: an unknown option raises invalid_option
-- ("did you mean `timeout`?") before anything is sent. `moonbox` installs it when it starts
-- (lua/moonbox/cli.lua); the C library itself is still loaded only by the first require.
local schema = require "moonbox.schema"

local M = {}

local REQUEST = {
  url = { type = "string", doc = "absolute URL (required)" },
  method = { type = "string", default = "GET", doc = "any method; HEAD asks for no body" },
  headers = { type = "table", doc = "{Name = \"value\"} or {\"Name: value\", ...}; CR/LF/NUL are refused" },
  body = { type = "string", doc = "the request body (may be binary)" },
  body_file = { type = "string", doc = "stream the request body from this file" },
  output_file = { type = "string", doc = "write the response body to this file (body is then \"\")" },
  timeout = { type = "number", kind = "deadline", doc = "the longest the whole transfer takes, in seconds" },
  connect_timeout = { type = "number", kind = "deadline", default = 300,
    doc = "the longest connecting takes, in seconds (libcurl's default)" },
  idle_timeout = { type = "number", kind = "deadline",
    doc = "abort when no byte moved for this many seconds" },
  max_body = { type = "bytes", default = 268435456,
    doc = "bytes of response body kept in memory; above it the request fails with body_too_large" },
  accept_encoding = { type = "string", doc = "e.g. \"gzip\": ask for and decode compressed bodies" },
  fresh_connect = { type = "boolean", default = false, doc = "true: a new connection for this request" },
  no_resend = { type = { "boolean", "string" }, default = false,
    doc = "true: never carried out twice (libcurl kept from re-sending it); \"reuse\": the same, " ..
      "never a connection of its own" },
  resolve = { type = "table", doc = "{\"host:port:address\", ...} (CURLOPT_RESOLVE)" },
}

local STREAM = {
  buffer = { type = "bytes", default = 65536, doc = "bytes held before the transfer pauses" },
  max_event = { type = "bytes", default = 16777216, doc = "the largest SSE event read_event accepts" },
}
for k, v in pairs(REQUEST) do STREAM[k] = v end

local OPTS = { name = "opts", type = "table" }

M.SCHEMA = {
  ["http.request"] = { summary = "one HTTP request; any status is a result", args = { OPTS },
    options = REQUEST, returns = "table", yields = true },
  ["http.stream"] = { summary = "a streamed HTTP response, once its headers arrived", args = { OPTS },
    options = STREAM, returns = "table", yields = true },
  ["http.curl_version"] = { summary = "libcurl's version", returns = "string" },
}
schema.declare(M.SCHEMA)

--- http_schema.patch(http) -> http: puts the checks in front of the C module's request and
-- stream (once; the table is changed in place). Does not yield.
function M.patch(http)
  if rawget(http, "_checked") then return http end
  http.request = schema.wrap("http.request", http.request)
  http.stream = schema.wrap("http.stream", http.stream)
  rawset(http, "_checked", true)
  return http
end

--- http_schema.install(): from now on `require "moonbox.http"` loads the C module as before
-- (built in, or found on package.cpath) and returns it patched; a module already loaded is
-- patched at once. Does not yield.
function M.install()
  local loaded = package.loaded["moonbox.http"]
  if type(loaded) == "table" then
    M.patch(loaded)
    return
  end
  local built_in = package.preload["moonbox.http"]
  package.preload["moonbox.http"] = function(name, extra)
    if built_in then return M.patch(built_in(name, extra)) end
    -- the searchers after preload's own (Lua files, then C libraries): what require would do
    local why = {}
    for i = 2, #package.searchers do
      local loader, data = package.searchers[i](name)
      if type(loader) == "function" then return M.patch(loader(name, data)) end
      if type(loader) == "string" then why[#why + 1] = loader end
    end
    error("module 'moonbox.http' not found:" .. table.concat(why), 2)
  end
end

return M
