-- `moonbox local`'s records as its history grows: list pages are keyset reads of the state
-- database (each record exactly once, newest first, under every filter, also across a
-- restart), terminated sandboxes are read back from the database when asked for, and each
-- sandbox's deadlines (timeoutSeconds, idle timeout) are kept by timers of its own.
-- The bulk of the history (terminated and errored records) is written into the state database
-- through moonbox.local.state while no backend runs, as a restarted backend finds records of
-- earlier runs; the live sandboxes are real. Needs root (real sandboxes).
local T = require "moonbox.testing"
local json = require "moonbox.json"
local ids = require "moonbox.ids"
local State = require "moonbox.local.state"
local L = require "spec.support.local_backend"

local function page_all(B, query, limit)
  local out, cursor = {}, nil
  repeat
    local q = { limit = limit, cursor = cursor }
    for k, v in pairs(query) do q[k] = v end
    local s, page = B:req("GET", "/v1/sandboxes", { query = q })
    assert.are.equal(200, s, json.encode(page))
    for _, item in ipairs(page) do out[#out + 1] = item.sandbox.id end
    cursor = page[#page] and page[#page].cursor
  until #page < limit
  return out
end

describe("moonbox local's state", function()
  local B
  local all = {} -- every sandbox, oldest first: {id, status, name, group}
  local groups = {}

  setup(T.async(function()
    B = L.start()
    -- a real lifecycle: the default group, and a terminated record to copy
    local first = B:create {}
    assert.are.equal(204, (B:req("POST", "/v1/sandboxes/" .. first.id .. "/terminate")))
    local _, g2 = B:req("POST", "/v1/sandbox-groups", { body = { ownerId = B.workspace, name = "second" } })
    groups = { first.sandboxGroupId, g2.id }
    all[1] = { id = first.id, status = "terminated", group = first.sandboxGroupId }
    B:stop()
    local st = State.open(B.state .. "/local.db")
    local proto
    for row in st.db:each("SELECT doc FROM records WHERE kind = 'sandbox'") do proto = json.decode(row.doc) end
    for i = 2, 290 do
      local rec = {}
      for k, v in pairs(proto) do rec[k] = v end
      rec.id = ids.new("sbx")
      rec.status = (i % 3 == 0) and "errored" or "terminated"
      rec.name = (i % 5 == 0) and "five" or nil
      rec.sandboxGroupId = groups[i % 2 + 1]
      st:save("sandbox", rec)
      all[i] = { id = rec.id, status = rec.status, name = rec.name, group = rec.sandboxGroupId }
    end
    st:close()
    B = L.start { state = B.state }
    for i = 1, 6 do
      local sb = B:create { name = (i % 2 == 0) and "five" or nil, sandboxGroupId = groups[i % 2 + 1] }
      all[#all + 1] = { id = sb.id, status = "running", name = sb.name, group = sb.sandboxGroupId }
    end
    for i = #all - 1, #all, 1 do
      B:req("POST", "/v1/sandboxes/" .. all[i].id .. "/suspend")
      B:wait_status(all[i].id, "suspended")
      all[i].status = "suspended"
    end
  end))

  teardown(T.async(function() if B then B:destroy() end end))

  -- What a filter should list, newest first.
  local function expected(statuses, name, group)
    local out = {}
    for i = #all, 1, -1 do
      local r = all[i]
      local st_ok
      if statuses then st_ok = statuses[r.status] else st_ok = r.status ~= "terminated" end
      if st_ok and (not name or r.name == name) and (not group or r.group == group) then out[#out + 1] = r.id end
    end
    return out
  end

  local function check_every_filter()
    local cases = {
      { {}, nil },
      { { status = "terminated" }, { terminated = true } },
      { { status = "errored,running" }, { errored = true, running = true } },
      { { status = "suspended" }, { suspended = true } },
      { { status = "terminated,errored,running,suspended" },
        { terminated = true, errored = true, running = true, suspended = true } },
    }
    for _, c in ipairs(cases) do
      for _, extra in ipairs({ {}, { name = "five" }, { sandboxGroupId = groups[2] },
        { name = "five", sandboxGroupId = groups[1] } }) do
        local q = {}
        for k, v in pairs(c[1]) do q[k] = v end
        for k, v in pairs(extra) do q[k] = v end
        local want = expected(c[2], extra.name, extra.sandboxGroupId)
        for _, limit in ipairs({ 7, 100 }) do
          assert.are.same(want, page_all(B, q, limit), "query " .. json.encode(q) .. " limit " .. limit)
        end
      end
    end
  end

  it("pages through 296 records of mixed statuses: each once, newest first, under every filter", T.async(function()
    check_every_filter()
  end))

  it("keeps list order and counts across a restart", T.async(function()
    -- the live sandboxes die with the backend and are errored after the restart
    B:stop()
    for _, r in ipairs(all) do
      if r.status == "running" or r.status == "suspended" then r.status = "errored" end
    end
    B = L.start { state = B.state }
    check_every_filter()
  end))

  it("reads a terminated sandbox of the history back, and its log stream ends", T.async(function()
    local old = all[4] -- terminated (4 % 3 ~= 0), written before this backend started
    assert.are.equal("terminated", old.status)
    local s, sb = B:req("GET", "/v1/sandboxes/" .. old.id)
    assert.are.equal(200, s)
    assert.are.equal("terminated", sb.status)
    local ls, body = B:req("GET", "/v1/sandboxes/" .. old.id .. "/logs", { timeout = 20 })
    assert.are.equal(200, ls)
    assert.matches('"type":"terminated"', body, 1, true)
  end))
end)

describe("moonbox local's sandbox timers", function()
  local B
  setup(T.async(function()
    -- idle timeouts scaled: 300 s → 1.5 s
    B = L.start { env = { MOONBOX_LOCAL_IDLE_SCALE = "0.005" } }
  end))
  teardown(T.async(function() if B then B:destroy() end end))

  it("suspends an idle sandbox by its own timer, never during an exec, and again after a wake", T.async(function()
    local sb = B:create { idleTimeoutSeconds = 300 }
    -- an exec longer than the idle timeout keeps it awake (a frozen sandbox would never finish it)
    local r = B:exec(sb.id, "sleep 3; echo done", { timeout = 60 })
    assert.are.equal("done\n", r.stdout)
    B:wait_status(sb.id, "suspended")
    -- a wake re-arms the timer
    assert.are.equal("again\n", B:exec(sb.id, "echo again").stdout)
    B:wait_status(sb.id, "suspended")
    B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
  end))

  it("terminates a sandbox at its timeoutSeconds by its own timer, suspended or not", T.async(function()
    local idle = B:create { idleTimeoutSeconds = 300, timeoutSeconds = 6 }
    local busy = B:create { idleTimeoutSeconds = 0, timeoutSeconds = 2 }
    B:wait_status(idle.id, "suspended")
    local got = B:wait_status(busy.id, "terminated")
    assert.is_string(got.terminatedAt)
    got = B:wait_status(idle.id, "terminated")
    assert.is_string(got.terminatedAt)
  end))
end)
