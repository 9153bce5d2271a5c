-- moonbox.pg and moonbox.db.postgres against a real PostgreSQL (Debian's package, a server of
-- the spec's own on a unix socket): typed results, parameters always bound (a value is never
-- SQL), a cancelled query abandons the connection without stalling the loop, the connection
-- comes back after a server restart, the URL's password never appears in an error, and the
-- schema migrates once under concurrent opens.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local core = require "moonbox.core"
local pg = require "moonbox.pg"
local PG = require "spec.support.postgres"

local server
setup(T.async(function() server = PG.start() end))
teardown(T.async(function() if server then server:destroy() end end))

describe("moonbox.pg", function()
  it("returns rows typed by column, NULL columns absent, and the row count", T.async(function()
    local c <close> = pg.connect(server.url)
    local rows, n = c:query("SELECT $1::int AS i, $2::float8 AS f, $3::text AS t, NULL::text AS z, $4::bool AS b, " ..
      "$5::bigint AS big", 42, 1.25, "x", true, math.maxinteger)
    assert.are.equal(1, n)
    assert.are.same({ i = 42, f = 1.25, t = "x", b = true, big = math.maxinteger }, rows[1])
    assert.is_true(math.type(rows[1].i) == "integer")
  end))

  it("binds a value as data, never as SQL", T.async(function()
    local c <close> = pg.connect(server.url)
    c:query("CREATE TABLE IF NOT EXISTS bound (v text)")
    local evil = "x'); DROP TABLE bound; --"
    local _, n = c:query("INSERT INTO bound (v) VALUES ($1)", evil)
    assert.are.equal(1, n)
    assert.are.equal(evil, c:query("SELECT v FROM bound")[1].v)
  end))

  it("raises sql_error with the sqlstate, and the connection stays usable", T.async(function()
    local c <close> = pg.connect(server.url)
    local ok, err = pcall(c.query, c, "SELECT * FROM no_such_table")
    assert.is_false(ok)
    assert.are.equal("sql_error", err.code, tostring(err))
    assert.are.equal("42P01", err.sqlstate)
    assert.is_true(c:ok())
    assert.are.equal(1, c:query("SELECT 1 AS one")[1].one)
  end))

  it("abandons a query whose task is cancelled; the loop keeps running meanwhile", T.async(function()
    local c <close> = pg.connect(server.url)
    local ticks = 0
    local ticker = task.spawn(function() while true do task.sleep(0.01) ticks = ticks + 1 end end)
    local ok, err = pcall(task.timeout, 0.3, function() return c:query("SELECT pg_sleep(30)") end)
    task.cancel(ticker)
    pcall(task.join, ticker)
    assert.is_false(ok)
    assert.is_true(task.is_timeout(err), tostring(err))
    assert.is_true(ticks > 3, "the loop stalled during the query")
    assert.is_false(c:ok())
    assert.has_error(function() c:query("SELECT 1") end)
  end))

  it("fails to connect with libpq's reason and no password", T.async(function()
    local ok, err = pcall(pg.connect, "postgresql://u:hunter2@/x?host=" .. server.dir .. "/nowhere")
    assert.is_false(ok)
    assert.are.equal("connect_failed", err.code)
    assert.is_nil(tostring(err):find("hunter2", 1, true))
  end))
end)

describe("moonbox.db on PostgreSQL", function()
  it("migrates once when three processes' worth of opens race, and answers like SQLite", T.async(function()
    local url = server:create_database("race")
    local db_mod = require "moonbox.db"
    local dbs, ts = {}, {}
    for i = 1, 3 do ts[i] = task.spawn(function() dbs[i] = db_mod.open(url) end) end
    for _, t in ipairs(ts) do task.join(t) end
    local db = dbs[1]
    assert.are.equal(#require("moonbox.db.schema").postgres, db:value("SELECT version FROM moonbox_schema"))
    assert.are.equal(1, db:value("SELECT count(*) AS n FROM moonbox_schema"))
    local n, id = db:run("INSERT INTO runs (pid, backend, started_at) VALUES (?, ?, ?)", 1, "b", core.time())
    assert.are.equal(1, n)
    assert.is_true(math.type(id) == "integer")
    assert.are.equal("b", db:row("SELECT * FROM runs WHERE id = ?", id).backend)
    for _, d in ipairs(dbs) do d:close() end
  end))

  it("says db_unavailable while the server is down, redacts the URL, and reconnects after", T.async(function()
    local url = server:create_database("outage") .. "&password=hunter2"
    local db = require("moonbox.db").open(url)
    server:stop_server("fast")
    local ok, err = pcall(db.value, db, "SELECT 1")
    server:start_server()
    assert.is_false(ok)
    assert.are.equal("db_unavailable", err.code)
    assert.is_nil(tostring(err):find("hunter2", 1, true))
    assert.matches("password=%*%*%*", tostring(err))
    db:wait_available()
    assert.are.equal(1, db:value("SELECT 1 AS one"))
    db:close()
  end))
end)

describe("a shared ledger", function()
  it("never reaps another machine's embedded-backend run from here, and judges runs by lease", T.async(function()
    local url = server:create_database("ledger")
    local db_mod = require "moonbox.db"
    db_mod.set_target(url)
    local ok, err = pcall(function()
      local ledger = require("moonbox.ledger").open()
      local now = ledger:now()
      local db = ledger.db
      local _, far = db:run([[INSERT INTO runs (pid, pid_start, recipe, backend, started_at, local_state, owner,
        lease_until) VALUES (?, ?, ?, ?, ?, ?, ?, ?)]], 4711, "1", "far.lua", "http://127.0.0.1:9/v1", now,
        "/nonexistent/local", "otherhost/4711/1", now - 5)
      db:run("INSERT INTO intents (run_id, created_at, label, sandbox_id) VALUES (?, ?, ?, ?)", far, now,
        "mb-1-" .. far, "sbx-far")
      local _, live = db:run([[INSERT INTO runs (pid, recipe, backend, started_at, owner, lease_until)
        VALUES (?, ?, ?, ?, ?, ?)]], 4712, "live.lua", "http://127.0.0.1:9/v1", now, "otherhost/4712/1", now + 60)
      db:run("INSERT INTO intents (run_id, created_at, label, sandbox_id) VALUES (?, ?, ?, ?)", live, now,
        "mb-2-" .. live, "sbx-live")
      local runs = {}
      for _, r in ipairs(ledger:runs()) do runs[r.id] = r end
      assert.is_false(runs[far].alive)
      assert.is_true(runs[live].alive)
      ledger:close()
      local lines = {}
      local res = require("moonbox.reap").reap({}, function(l) lines[#lines + 1] = l end)
      local text = table.concat(lines, "\n")
      assert.are.equal(1, res.runs, text) -- the live one is not touched
      assert.are.equal(1, res.failed, text)
      assert.matches("its embedded backend ran on otherhost: run `moonbox reap` there", text)
      local check = db_mod.open(url)
      assert.are.equal(2, check:value("SELECT count(*) AS n FROM intents WHERE released_at IS NULL"))
      check:close()
    end)
    db_mod.set_target(nil)
    assert(ok, err)
  end))
end)
