--- moonbox.local.http.public — the base URL of the connect URIs `moonbox local` hands out (run
-- and file tokens' `uri`), built from the address the client used, so that exec streams and
-- file transfers cross the same proxy or TLS edge as the control plane did.
--
-- First match wins:
--   1. the backend's public URL (`moonbox local --public-url URL`), as given;
--   2. X-Forwarded-Proto (http|https, default http) and X-Forwarded-Host, from a peer on
--      loopback (the backend listens on loopback only, so that is a proxy on this machine);
--      the first entry of each when a chain of proxies sent a list;
--   3. http:// and the request's Host;
--   4. the backend's own URL (a request without Host: HTTP/1.0).
-- A Host or X-Forwarded-Host that is not exactly a host name, an IPv4 address or a bracketed
-- IPv6 address with an optional port is refused with 400: nothing a client sends reaches a URL
-- unchecked.
local service = require "moonbox.local.service"
local M = {}

local function loopback(addr)
  addr = tostring(addr or "")
  return addr == "::1" or addr:match("^127%.%d+%.%d+%.%d+$") ~= nil or
    addr:match("^::ffff:127%.%d+%.%d+%.%d+$") ~= nil
end
M.loopback = loopback

--- public.valid_authority(s) -> whether s is "host[:port]" with host a DNS name, an IPv4
-- address or "[IPv6]", and port 1..65535 (no user info, path, spaces or anything else).
function M.valid_authority(s)
  if type(s) ~= "string" or #s == 0 or #s > 260 then return false end
  local host, port = s:match("^(%[[%x:%.]+%])(.*)$")
  if not host then
    host, port = s:match("^([%w%.%-]+)(.*)$")
    if not host or host:sub(1, 1) == "-" or host:sub(1, 1) == "." or host:find("..", 1, true) then
      return false
    end
  elseif not host:find(":", 1, true) then
    return false
  end
  if port ~= "" then
    local p = port:match("^:(%d%d?%d?%d?%d?)$")
    if not p or tonumber(p) < 1 or tonumber(p) > 65535 then return false end
  end
  return true
end

--- public.valid_url(s) -> s without a trailing slash, or nil and why: an http(s) URL with a
-- valid authority and an optional path of plain characters (no query, no fragment).
function M.valid_url(s)
  if type(s) ~= "string" then return nil, "it must be a string" end
  local scheme, authority, path = s:match("^(https?)://([^/?#]+)([^?#]*)$")
  if not scheme then return nil, "it must be http:// or https:// followed by host[:port][/path]" end
  if not M.valid_authority(authority) then
    return nil, "its host[:port] '" .. authority .. "' is not valid"
  end
  if not path:match("^[%w%-%._~/]*$") then
    return nil, "its path may hold only letters, digits and - . _ ~ /"
  end
  return (scheme .. "://" .. authority .. path):gsub("/+$", "")
end

local function first(v)
  return (v:match("^%s*([^,]-)%s*,") or v:match("^%s*(.-)%s*$"))
end

--- public.base(backend, req) -> the base URL (no trailing slash) for connect URIs answered to req.
-- Raises the service's invalid error (400) on a malformed Host or X-Forwarded-* header.
function M.base(backend, req)
  if backend.public_url then return backend.public_url end
  local h = req.headers or {}
  local fail = service.fail
  local fhost = h["x-forwarded-host"]
  if fhost and loopback(req.remote) then
    fhost = first(fhost)
    if not M.valid_authority(fhost) then fail("invalid", "the X-Forwarded-Host header is not host[:port]") end
    local proto = first(h["x-forwarded-proto"] or "http"):lower()
    if proto ~= "http" and proto ~= "https" then
      fail("invalid", "the X-Forwarded-Proto header must be http or https")
    end
    return proto .. "://" .. fhost
  end
  local host = h.host
  if host then
    if not M.valid_authority(host) then fail("invalid", "the Host header is not host[:port]") end
    return "http://" .. host
  end
  return backend.url
end

return M
