--- spec/support/http_server.lua — moonbox's own HTTP server (moonbox.httpd) on 127.0.0.1 for
-- the specs of the HTTP client: the same process and loop, a port of its own per test.
local T = require "moonbox.testing"
local httpd = require "moonbox.httpd"

local M = {}

--- http_server.with(fn) -> a test body that runs fn(srv) as a task with a fresh server on
-- 127.0.0.1, closed when fn returns or raises.
function M.with(fn)
  return T.async(function()
    local srv <close> = httpd.listen { host = "127.0.0.1", port = 0 }
    fn(srv)
  end)
end

return M
