--- spec/support/raw_http.lua — raw HTTP/1.1 on loopback for the framing specs: the bytes a
-- hostile client sends, exactly (NULs, bare LFs, two Content-Lengths), through
-- spec/support/raw_http.py (Debian's python3), and what came back, split into answers.
--
--   raw.send(port, bytes[, opts]) -> {bytes, closed, answers = {{status, head, body}, ...},
--                                     statuses = "400 200" (the status lines, in order)}
--     opts.ca: speak TLS, trusting this CA file (the nginx edge of spec/support/edge.lua)
--     opts.idle: seconds of silence that end the read (default 2; a closed connection ends it
--                at once, so a spec that expects a close does not wait)
local proc = require "moonbox.proc"

local M = {}

M.PYTHON = "/usr/bin/python3"
M.SCRIPT = (debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "raw_http.py"

-- Splits a stream of HTTP/1.1 answers into {status, head, body} (Content-Length or chunked bodies).
local function answers(bytes)
  local out, pos = {}, 1
  while pos <= #bytes do
    local hs, he = bytes:find("\r\n\r\n", pos, true)
    if not hs then
      out[#out + 1] = { status = tonumber(bytes:match("^HTTP/1%.%d (%d%d%d)", pos)), head = bytes:sub(pos), body = "" }
      break
    end
    local head = bytes:sub(pos, hs - 1)
    local a = { status = tonumber(head:match("^HTTP/1%.%d (%d%d%d)")), head = head }
    pos = he + 1
    local cl = head:lower():match("\r\ncontent%-length:%s*(%d+)")
    if cl then
      a.body = bytes:sub(pos, pos + tonumber(cl) - 1)
      pos = pos + tonumber(cl)
    elseif head:lower():find("\r\ntransfer%-encoding:%s*chunked") then
      local parts = {}
      while true do
        local ls, le, size = bytes:find("^(%x+)[^\r]*\r\n", pos)
        if not ls then break end
        size = tonumber(size, 16)
        pos = le + 1
        if size == 0 then
          local te = bytes:find("\r\n", pos, true)
          pos = (te or #bytes) + 2
          break
        end
        parts[#parts + 1] = bytes:sub(pos, pos + size - 1)
        pos = pos + size + 2
      end
      a.body = table.concat(parts)
    else
      a.body = ""
    end
    out[#out + 1] = a
  end
  return out
end
M.answers = answers

--- raw.send(port, bytes[, opts]) -> result (see the header). [yields]
function M.send(port, bytes, opts)
  opts = opts or {}
  local argv = { M.PYTHON, M.SCRIPT, "127.0.0.1", tostring(port), tostring(opts.idle or 2), opts.ca, input = bytes }
  local r = proc.run(argv)
  assert(r.code == 0 or r.code == 3, "raw_http.py failed (exit " .. tostring(r.code) .. "): " .. r.stderr)
  local list = answers(r.stdout)
  local statuses = {}
  for line in r.stdout:gmatch("HTTP/1%.%d (%d%d%d) ") do statuses[#statuses + 1] = line end
  return { bytes = r.stdout, closed = r.code == 0, answers = list, statuses = table.concat(statuses, " ") }
end

return M
