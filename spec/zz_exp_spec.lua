local T = require "moonbox.testing"
local task = require "moonbox.task"
local render = require "moonbox.render"
local api = require "moonbox.render.api"
local L = require "spec.support.local_backend"
local B, sb
setup(T.async(function() B = L.start { edge = true }; B:connect_render(); sb = render.sandboxes.create {}:keep() end))
teardown(T.async(function() sb:terminate(); B:destroy() end))
describe("exp", function()
  it("timeout kill", T.async(function()
    local orig = api.data
    api.data = function(conn, op, mint, req, opts)
      local t0 = task.now()
      local ok, a, b, c = pcall(orig, conn, op, mint, req, opts)
      print(op, ok, ok and (a.status or "") or (a.code .. " " .. tostring(a.message)), task.now() - t0, task.remaining())
      if not ok then error(a, 0) end
      return a, b, c
    end
    local ok, err = pcall(sb.exec, sb, "sleep 3000", { timeout = 1 })
    print(ok, err and err.code)
    api.data = orig
    task.sleep(1)
    print(sb:exec("pgrep -fa 'sleep 3000' || true").stdout)
  end))
end)
