-- Pins moonbox.store: SQLite for moonbox's state. Files are private (0600) and in WAL mode, SQL
-- is bound never built, values round-trip byte-exact, errors are structured, transactions and
-- savepoints undo exactly what they should, migrations apply once, cursors never leave a
-- statement running, and closed databases refuse use.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local store = require "moonbox.store"
local files = require "spec.support.files"

local tmp
local seq = 0

local sh = files.sh

-- A fresh database path in the spec's temporary directory.
local function new_path()
  seq = seq + 1
  return string.format("%s/db-%d.sqlite", tmp, seq)
end

local function mode_of(path)
  return (sh("stat -c %a " .. path):gsub("%s+$", ""))
end

local errors_with = T.errors_with

local function misuse_error(fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok, "expected a misuse error")
  assert.are.equal("string", type(err), "misuse raises a plain error, got " .. tostring(err))
  return err
end

local function memory_db()
  local db = store.open(":memory:")
  db:exec([[CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT UNIQUE, v)]])
  return db
end

files.temp_dir(setup, teardown, "store", function(dir) tmp = dir end)

describe("store.open", function()
  it("creates a missing database file, and its WAL files, with mode 0600", function()
    local path = new_path()
    local db <close> = store.open(path)
    db:exec("CREATE TABLE x(a)")
    db:run("INSERT INTO x VALUES (1)")
    assert.are.equal("600", mode_of(path))
    assert.are.equal("600", mode_of(path .. "-wal"))
    assert.are.equal("600", mode_of(path .. "-shm"))
  end)

  it("turns on WAL, foreign keys and synchronous=NORMAL", function()
    local db <close> = store.open(new_path())
    assert.are.equal("wal", db:value("PRAGMA journal_mode"))
    assert.are.equal(1, db:value("PRAGMA foreign_keys"))
    assert.are.equal(1, db:value("PRAGMA synchronous")) -- 1 is NORMAL
  end)

  it("opens a private in-memory database for :memory:", function()
    local a <close> = store.open(":memory:")
    local b <close> = store.open(":memory:")
    a:exec("CREATE TABLE only_in_a(x)")
    assert.are.equal(1, a:value("SELECT count(*) FROM sqlite_master WHERE name = 'only_in_a'"))
    assert.are.equal(0, b:value("SELECT count(*) FROM sqlite_master WHERE name = 'only_in_a'"))
  end)

  it("raises open_failed naming the path and the reason", function()
    local path = tmp .. "/no/such/dir/x.db"
    local err = errors_with("open_failed", store.open, path)
    assert.are.equal("store.open", err.op)
    assert.truthy(err.message:find(path, 1, true), err.message)
    assert.matches("No such file or directory", err.message)
  end)

  it("raises open_failed for a file that is not a database", function()
    local path = new_path()
    local f = assert(io.open(path, "w"))
    f:write(string.rep("not sqlite at all ", 100))
    f:close()
    local err = errors_with("open_failed", store.open, path)
    assert.matches("not a database", err.message)
  end)

  it("rejects unknown and malformed options", function()
    assert.matches("unknown option busytimeout",
      misuse_error(store.open, ":memory:", { busytimeout = 10 }))
    assert.matches("busy_timeout must be a non%-negative integer",
      misuse_error(store.open, ":memory:", { busy_timeout = -1 }))
  end)
end)

describe("db:run parameters", function()
  it("binds positional ? parameters from the arguments", function()
    local db <close> = memory_db()
    local changes, rowid = db:run("INSERT INTO t(name, v) VALUES (?, ?)", "a", 42)
    assert.are.same({ 1, 1 }, { changes, rowid })
    assert.are.same({ id = 1, name = "a", v = 42 }, db:row("SELECT * FROM t WHERE name = ?", "a"))
  end)

  it("binds :name, @name and $name from one table's fields, missing fields as NULL", function()
    local db <close> = memory_db()
    db:run("INSERT INTO t(name, v) VALUES (:name, @v)", { name = "a", v = 1, extra = "ignored" })
    db:run("INSERT INTO t(name, v) VALUES ($name, :v)", { name = "b" })
    assert.are.same({ { name = "a", v = 1 }, { name = "b" } },
      db:rows("SELECT name, v FROM t ORDER BY name"))
  end)

  it("treats SQL-looking values as data, never as SQL", function()
    local db <close> = memory_db()
    local evil = "x'); DROP TABLE t; --"
    db:run("INSERT INTO t(name) VALUES (?)", evil)
    assert.are.equal(evil, db:value("SELECT name FROM t"))
  end)

  it("reports rows changed by this statement, and 0 for statements that change none", function()
    local db <close> = memory_db()
    for i = 1, 3 do db:run("INSERT INTO t(name) VALUES (?)", "n" .. i) end
    assert.are.equal(2, (db:run("UPDATE t SET v = 1 WHERE id > 1")))
    assert.are.equal(0, (db:run("CREATE TABLE other(x)")))
    assert.are.equal(0, (db:run("SELECT * FROM t")))
  end)

  it("raises a plain error naming the counts when the parameter count is wrong", function()
    local db <close> = memory_db()
    assert.matches("the statement has 2 parameter%(s%) but 1 value%(s%) were given",
      misuse_error(db.run, db, "INSERT INTO t(name, v) VALUES (?, ?)", "a"))
    assert.matches("has 0 parameter%(s%) but 1 value",
      misuse_error(db.run, db, "SELECT 1", 5))
  end)

  it("raises a plain error for a value SQLite cannot store", function()
    local db <close> = memory_db()
    assert.matches("parameter 1 is a function",
      misuse_error(db.run, db, "INSERT INTO t(v) VALUES (?)", print))
    assert.matches("parameter :v is a table",
      misuse_error(db.run, db, "INSERT INTO t(v) VALUES (:v)", { v = {} }))
    assert.matches("is positional",
      misuse_error(db.run, db, "INSERT INTO t(v) VALUES (?)", { 1 }))
    assert.are.equal(0, db:stats().lent)
  end)

  it("refuses several statements in one call and points to exec", function()
    local db <close> = memory_db()
    assert.matches("more than one statement; run scripts with exec",
      misuse_error(db.run, db, "INSERT INTO t(name) VALUES ('a'); DELETE FROM t"))
    assert.are.equal(0, db:value("SELECT count(*) FROM t"))
    assert.are.equal(1, db:value("SELECT 1; -- a trailing comment is fine"))
  end)

  it("raises a plain error for exec with parameters", function()
    local db <close> = memory_db()
    assert.matches("db:exec takes no parameters", misuse_error(db.exec, db, "SELECT ?", 1))
  end)
end)

describe("values", function()
  it("round-trips every type and keeps integers integers", function()
    local db <close> = store.open(":memory:")
    db:exec("CREATE TABLE v(i, f, s, b, yes, no, n)")
    db:run("INSERT INTO v VALUES (?, ?, ?, ?, ?, ?, ?)",
      math.maxinteger, 1.0, "text", store.blob("\0\1\2"), true, false, nil)
    db:run("INSERT INTO v(i, f) VALUES (?, ?)", math.mininteger, -0.5)
    local rows = db:rows("SELECT * FROM v ORDER BY rowid")
    assert.are.same({ i = math.maxinteger, f = 1.0, s = "text", b = "\0\1\2", yes = 1, no = 0 }, rows[1])
    assert.are.equal("integer", math.type(rows[1].i))
    assert.are.equal("float", math.type(rows[1].f))
    assert.are.equal("integer", math.type(rows[1].yes))
    assert.are.equal(math.mininteger, rows[2].i)
    assert.are.equal(-0.5, rows[2].f)
    assert.are.same({ "integer", "real", "text", "blob", "null" },
      { db:value("SELECT typeof(i) FROM v LIMIT 1"), db:value("SELECT typeof(f) FROM v LIMIT 1"),
        db:value("SELECT typeof(s) FROM v LIMIT 1"), db:value("SELECT typeof(b) FROM v LIMIT 1"),
        db:value("SELECT typeof(n) FROM v LIMIT 1") })
  end)

  it("stores bytes with NULs and invalid UTF-8 exactly, as text and as blob", function()
    local db <close> = store.open(":memory:")
    db:exec("CREATE TABLE bytes(k TEXT, x)")
    local weird = "a\0b\255\254\0\xc3\x28end\0"
    db:run("INSERT INTO bytes VALUES ('text', ?)", weird)
    db:run("INSERT INTO bytes VALUES ('blob', ?)", store.blob(weird))
    db:run("INSERT INTO bytes VALUES ('empty', ?)", store.blob(""))
    assert.are.equal(weird, db:value("SELECT x FROM bytes WHERE k = 'text'"))
    assert.are.equal(weird, db:value("SELECT x FROM bytes WHERE k = 'blob'"))
    assert.are.equal(#weird, db:value("SELECT length(x) FROM bytes WHERE k = 'blob'"))
    assert.are.equal("", db:value("SELECT x FROM bytes WHERE k = 'empty'"))
    assert.are.equal("blob", db:value("SELECT typeof(x) FROM bytes WHERE k = 'empty'"))
  end)

  it("round-trips 1 MB strings and blobs", function()
    local db <close> = store.open(new_path())
    db:exec("CREATE TABLE big(x)")
    local chunk = {}
    for i = 0, 255 do chunk[#chunk + 1] = string.char(i) end
    local mb = string.rep(table.concat(chunk), 4096)
    assert.are.equal(1024 * 1024, #mb)
    db:run("INSERT INTO big VALUES (?)", store.blob(mb))
    db:run("INSERT INTO big VALUES (?)", (mb:gsub("%z", "0")))
    local rows = db:rows("SELECT x FROM big ORDER BY rowid")
    assert.is_true(rows[1].x == mb)
    assert.is_true(rows[2].x == (mb:gsub("%z", "0")))
  end)

  it("leaves NULL columns out of rows, and row/value give nil when nothing matches", function()
    local db <close> = memory_db()
    db:run("INSERT INTO t(name) VALUES ('only name')")
    assert.are.same({ id = 1, name = "only name" }, db:row("SELECT * FROM t"))
    assert.is_nil(db:value("SELECT v FROM t"))
    assert.is_nil(db:row("SELECT * FROM t WHERE id = 99"))
    assert.is_nil(db:value("SELECT id FROM t WHERE id = 99"))
    assert.are.same({}, db:rows("SELECT * FROM t WHERE id = 99"))
  end)
end)

describe("store errors", function()
  it("raises code constraint with SQLite's message and the SQL", function()
    local db <close> = memory_db()
    db:run("INSERT INTO t(name) VALUES (?)", "dup")
    local err = errors_with("constraint", db.run, db, "INSERT INTO t(name) VALUES (?)", "dup")
    assert.are.equal("store", err.op)
    assert.matches("UNIQUE constraint failed: t%.name", err.message)
    assert.truthy(err.message:find("INSERT INTO t(name) VALUES (?)", 1, true), err.message)
    assert.is_false(err.retryable)
    assert.matches("store_spec%.lua:%d+: store: UNIQUE constraint failed", tostring(err))
  end)

  it("raises code constraint for a foreign key violation", function()
    local db <close> = store.open(":memory:")
    db:exec([[CREATE TABLE parent(id INTEGER PRIMARY KEY);
              CREATE TABLE child(pid REFERENCES parent(id))]])
    local err = errors_with("constraint", db.run, db, "INSERT INTO child VALUES (?)", 7)
    assert.matches("FOREIGN KEY constraint failed", err.message)
  end)

  it("raises code sqlite_error for a syntax error, quoting the first 120 characters", function()
    local db <close> = memory_db()
    local long = "SELEC    * FROM t WHERE\n name = ? " .. string.rep("AND 1 = 1 ", 30)
    local err = errors_with("sqlite_error", db.rows, db, long, "x")
    assert.matches('near "SELEC": syntax error', err.message)
    assert.is_true(#err.sql <= 123, err.sql) -- at most 120 characters and "..."
    assert.matches("AND 1 = 1%.%.%.$", err.sql)
    assert.are.equal("SELEC * FROM t WHERE name = ? AND", err.sql:sub(1, 33))
    assert.truthy(err.message:find(err.sql, 1, true))
  end)

  it("quotes the failing statement of an exec script", function()
    local db <close> = memory_db()
    local err = errors_with("sqlite_error", db.exec, db,
      "INSERT INTO t(name) VALUES ('ok');\nINSERT INTO nowhere VALUES (1);")
    assert.matches("no such table: nowhere", err.message)
    assert.are.equal("INSERT INTO nowhere VALUES (1);", err.sql)
    assert.are.equal(1, db:value("SELECT count(*) FROM t"), "statements before it stay applied")
  end)

  it("raises code busy, retryable, when another handle holds the write lock", function()
    local path = new_path()
    local a <close> = store.open(path)
    local b <close> = store.open(path, { busy_timeout = 0 })
    a:exec("CREATE TABLE x(v)")
    a:exec("BEGIN IMMEDIATE")
    local err = errors_with("busy", b.run, b, "INSERT INTO x VALUES (1)")
    assert.is_true(err.retryable)
    assert.matches("locked", err.message)
    a:exec("COMMIT")
    b:run("INSERT INTO x VALUES (1)")
  end)
end)

describe("db:tx", function()
  it("commits when fn returns and returns fn's results", function()
    local db <close> = memory_db()
    local a, b, c = db:tx(function(x)
      db:run("INSERT INTO t(name) VALUES ('in tx')")
      return x, nil, "three"
    end, "one")
    assert.are.same({ "one", nil, "three" }, { a, b, c })
    assert.are.equal(1, db:value("SELECT count(*) FROM t"))
    assert.are.equal(0, db:value("SELECT count(*) FROM t WHERE 0")) -- not left inside a tx
    db:exec("BEGIN; COMMIT") -- would fail inside an open transaction
  end)

  it("rolls back when fn raises and re-raises the same error value", function()
    local db <close> = memory_db()
    local mine = { reason = "mine" }
    local ok, err = pcall(db.tx, db, function()
      db:run("INSERT INTO t(name) VALUES ('lost')")
      error(mine)
    end)
    assert.is_false(ok)
    assert.are.equal(mine, err)
    assert.are.equal(0, db:value("SELECT count(*) FROM t"))
    db:exec("BEGIN; COMMIT")
  end)

  it("nests with savepoints: a caught inner failure undoes only the inner part", function()
    local db <close> = memory_db()
    db:tx(function()
      db:run("INSERT INTO t(name) VALUES ('outer')")
      local ok = pcall(db.tx, db, function()
        db:run("INSERT INTO t(name) VALUES ('inner')")
        error("inner fails")
      end)
      assert.is_false(ok)
      db:tx(function() db:run("INSERT INTO t(name) VALUES ('inner kept')") end)
    end)
    assert.are.same({ { name = "inner kept" }, { name = "outer" } },
      db:rows("SELECT name FROM t ORDER BY name"))
  end)

  it("undoes committed inner savepoints when the outer transaction fails", function()
    local db <close> = memory_db()
    pcall(db.tx, db, function()
      db:tx(function() db:run("INSERT INTO t(name) VALUES ('inner')") end)
      error("outer fails")
    end)
    assert.are.equal(0, db:value("SELECT count(*) FROM t"))
  end)

  it("raises a constraint error from inside fn and rolls everything back", function()
    local db <close> = memory_db()
    local err = errors_with("constraint", db.tx, db, function()
      db:run("INSERT INTO t(name) VALUES ('x')")
      db:run("INSERT INTO t(name) VALUES ('x')")
    end)
    assert.matches("UNIQUE", err.message)
    assert.are.equal(0, db:value("SELECT count(*) FROM t"))
  end)

  it("refuses a task wait inside the transaction and rolls it back", T.async(function()
    local db <close> = memory_db()
    local ok, err = pcall(db.tx, db, function()
      db:run("INSERT INTO t(name) VALUES ('never')")
      task.sleep(0.001)
    end)
    assert.is_false(ok)
    assert.matches("cannot wait here", tostring(err))
    assert.are.equal(0, db:value("SELECT count(*) FROM t"))
    task.sleep(0.001) -- outside the transaction the task waits as usual
    db:tx(function() db:run("INSERT INTO t(name) VALUES ('after')") end)
    assert.are.equal(1, db:value("SELECT count(*) FROM t"))
  end))

  it("takes the write lock at BEGIN, so a busy database fails before fn runs", function()
    local path = new_path()
    local a <close> = store.open(path)
    local b <close> = store.open(path, { busy_timeout = 0 })
    a:exec("CREATE TABLE x(v); BEGIN IMMEDIATE")
    local ran = false
    errors_with("busy", b.tx, b, function() ran = true end)
    assert.is_false(ran)
    a:exec("ROLLBACK")
  end)
end)

describe("db:each", function()
  it("iterates rows in order", function()
    local db <close> = memory_db()
    for i = 1, 5 do db:run("INSERT INTO t(name, v) VALUES (?, ?)", "n" .. i, i) end
    local seen = {}
    for row in db:each("SELECT v FROM t WHERE v > ? ORDER BY v", 2) do seen[#seen + 1] = row.v end
    assert.are.same({ 3, 4, 5 }, seen)
    assert.are.equal(0, db:stats().lent)
  end)

  it("gives the statement back on break, so VACUUM and COMMIT work right after", function()
    local db <close> = memory_db()
    for i = 1, 5 do db:run("INSERT INTO t(name) VALUES (?)", "n" .. i) end
    for row in db:each("SELECT * FROM t") do if row.id then break end end
    assert.are.equal(0, db:stats().lent)
    db:exec("VACUUM")
    db:exec("BEGIN")
    for row in db:each("SELECT * FROM t") do if row.id then break end end
    db:exec("COMMIT")
  end)

  it("gives the statement back when the loop body raises", function()
    local db <close> = memory_db()
    db:run("INSERT INTO t(name) VALUES ('a')")
    local ok = pcall(function()
      for _ in db:each("SELECT * FROM t") do error("body fails") end
    end)
    assert.is_false(ok)
    assert.are.equal(0, db:stats().lent)
    db:exec("VACUUM")
  end)

  it("lets the loop body write in transactions and wait on tasks", T.async(function()
    local db <close> = memory_db()
    for i = 1, 3 do db:run("INSERT INTO t(name, v) VALUES (?, 0)", "n" .. i) end
    for row in db:each("SELECT id FROM t ORDER BY id") do
      task.sleep(0.001)
      db:tx(function() db:run("UPDATE t SET v = ? WHERE id = ?", row.id * 10, row.id) end)
    end
    assert.are.equal(60, db:value("SELECT sum(v) FROM t"))
  end))

  it("runs the same query inside its own loop on a separate statement", function()
    local db <close> = memory_db()
    for i = 1, 3 do db:run("INSERT INTO t(name) VALUES (?)", "n" .. i) end
    local pairs_seen = 0
    for _ in db:each("SELECT id FROM t") do
      for _ in db:each("SELECT id FROM t") do pairs_seen = pairs_seen + 1 end
      assert.are.equal(3, #db:rows("SELECT id FROM t"))
    end
    assert.are.equal(9, pairs_seen)
    assert.are.equal(0, db:stats().lent)
  end)

  it("raises at the next step when the database was closed during the loop", function()
    local db = memory_db()
    db:run("INSERT INTO t(name) VALUES ('a')")
    db:run("INSERT INTO t(name) VALUES ('b')")
    local ok, err = pcall(function()
      for _ in db:each("SELECT * FROM t") do db:close() end
    end)
    assert.is_false(ok)
    assert.matches("was closed during the loop", err)
  end)
end)

describe("statement cache", function()
  it("compiles a repeated query once", function()
    local db <close> = memory_db()
    local before = db:stats()
    for i = 1, 1000 do db:run("INSERT INTO t(name, v) VALUES (?, ?)", "n" .. i, i) end
    for i = 1, 1000 do assert.are.equal(i, db:value("SELECT v FROM t WHERE name = ?", "n" .. i)) end
    local after = db:stats()
    assert.are.equal(before.prepares + 2, after.prepares)
    assert.is_true(after.hits - before.hits >= 1998)
  end)

  it("stays within its bound, evicting the least recently used statement", function()
    local db <close> = store.open(":memory:", { statement_cache = 4 })
    for i = 1, 10 do db:value("SELECT " .. i) end
    assert.are.equal(4, db:stats().cached)
    local p = db:stats().prepares
    db:value("SELECT 10") -- recent: still cached
    assert.are.equal(p, db:stats().prepares)
    db:value("SELECT 1") -- evicted long ago: compiled again
    assert.are.equal(p + 1, db:stats().prepares)
  end)

  it("can be turned off", function()
    local db <close> = store.open(":memory:", { statement_cache = 0 })
    for _ = 1, 3 do db:value("SELECT 1") end
    assert.are.same({ cached = 0, lent = 0, prepares = 3, hits = 0 }, db:stats())
  end)

  it("sees schema changes made after a statement was cached", function()
    local db <close> = memory_db()
    db:run("INSERT INTO t(name) VALUES ('a')")
    assert.are.same({ id = 1, name = "a" }, db:row("SELECT * FROM t"))
    db:exec("ALTER TABLE t ADD COLUMN extra DEFAULT 'new'")
    assert.are.same({ id = 1, name = "a", extra = "new" }, db:row("SELECT * FROM t"))
  end)
end)

describe("db:migrate", function()
  local migrations = {
    "CREATE TABLE runs(id INTEGER PRIMARY KEY, recipe TEXT NOT NULL)",
    "ALTER TABLE runs ADD COLUMN started REAL; CREATE INDEX runs_recipe ON runs(recipe)",
  }

  it("applies each script once, across reopening the file", function()
    local path = new_path()
    do
      local db <close> = store.open(path)
      assert.are.equal(2, db:migrate(migrations))
      db:run("INSERT INTO runs(recipe, started) VALUES (?, ?)", "r.lua", 1.5)
      assert.are.equal(2, db:migrate(migrations))
    end
    local db <close> = store.open(path)
    assert.are.equal(2, db:migrate(migrations))
    local more = { migrations[1], migrations[2], "ALTER TABLE runs ADD COLUMN outcome TEXT" }
    assert.are.equal(3, db:migrate(more))
    assert.are.same({ { id = 1, recipe = "r.lua", started = 1.5 } }, db:rows("SELECT * FROM runs"))
    assert.are.equal(3, db:value("PRAGMA user_version"))
  end)

  it("rolls back only the failing migration and names it", function()
    local db <close> = store.open(new_path())
    local err = errors_with("sqlite_error", db.migrate, db, {
      "CREATE TABLE a(x)",
      "CREATE TABLE b(x); INSERT INTO missing VALUES (1)",
    })
    assert.are.equal(2, err.migration)
    assert.matches("migration 2 failed: no such table: missing", err.message)
    assert.are.equal(1, db:value("PRAGMA user_version"))
    assert.are.equal(0, db:value("SELECT count(*) FROM sqlite_master WHERE name = 'b'"))
  end)

  it("runs function migrations in the transaction, re-raising their errors unchanged", function()
    local db <close> = store.open(":memory:")
    local list = {
      "CREATE TABLE kv(k PRIMARY KEY, v)",
      function(d) d:run("INSERT INTO kv VALUES (?, ?)", "seeded", 1) end,
    }
    assert.are.equal(2, db:migrate(list))
    assert.are.equal(1, db:value("SELECT v FROM kv WHERE k = 'seeded'"))
    local boom = { "boom" }
    list[3] = function(d)
      d:run("INSERT INTO kv VALUES ('half', 1)")
      error(boom)
    end
    local ok, err = pcall(db.migrate, db, list)
    assert.is_false(ok)
    assert.are.equal(boom, err)
    assert.is_nil(db:value("SELECT v FROM kv WHERE k = 'half'"))
    assert.are.equal(2, db:value("PRAGMA user_version"))
  end)

  it("refuses a database migrated further than the list knows", function()
    local db <close> = store.open(":memory:")
    db:migrate(migrations)
    local err = errors_with("schema_too_new", db.migrate, db, { migrations[1] })
    assert.are.equal(2, err.version)
  end)

  it("raises a plain error inside a transaction or for a malformed list", function()
    local db <close> = store.open(":memory:")
    assert.matches("migration 2 is a number", misuse_error(db.migrate, db, { "SELECT 1", 5 }))
    db:tx(function()
      assert.matches("cannot run inside a transaction", misuse_error(db.migrate, db, migrations))
    end)
  end)
end)

describe("two handles on one file", function()
  it("see each other's committed writes and not uncommitted ones", function()
    local path = new_path()
    local a <close> = store.open(path)
    local b <close> = store.open(path)
    a:exec("CREATE TABLE x(v)")
    a:run("INSERT INTO x VALUES (?)", "from a")
    assert.are.equal("from a", b:value("SELECT v FROM x"))
    b:tx(function()
      b:run("INSERT INTO x VALUES (?)", "from b")
      assert.are.equal(1, a:value("SELECT count(*) FROM x"))
    end)
    assert.are.equal(2, a:value("SELECT count(*) FROM x"))
  end)
end)

describe("db:close", function()
  it("makes every later use raise a plain error naming the path", function()
    local path = new_path()
    local db = store.open(path)
    db:close()
    db:close() -- idempotent
    assert.truthy(misuse_error(db.run, db, "SELECT 1"):find(path .. " is closed", 1, true))
    assert.matches("is closed", misuse_error(db.rows, db, "SELECT 1"))
    assert.matches("is closed", misuse_error(db.tx, db, function() end))
    assert.matches("closed", tostring(db))
  end)

  it("closes at the end of a <close> scope and finalizes unfinished cursors", function()
    local escaped, iter
    do
      local db <close> = memory_db()
      db:run("INSERT INTO t(name) VALUES ('a')")
      iter = db:each("SELECT * FROM t") -- never finished
      escaped = db
    end
    assert.matches("is closed", misuse_error(escaped.value, escaped, "SELECT 1"))
    assert.matches("was closed during the loop", misuse_error(iter))
  end)

  it("holds no registry references", function()
    local before = T.refs()
    do
      local db <close> = memory_db()
      for _ in db:each("SELECT * FROM t") do end
      db:tx(function() db:run("INSERT INTO t(name) VALUES ('x')") end)
    end
    assert.are.equal(before, T.refs())
  end)
end)
