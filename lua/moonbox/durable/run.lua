--- moonbox.durable.run — what `moonbox run --durable`, `--resume`, `--record` and `--replay` do
-- around a recipe (docs/reference/durable.md): which journal the run keeps or reads, where, and
-- with which backend.
--
--   * durable: the run's record in the ledger is made before the recipe starts (durable = 1,
--     with the recipe's path and arguments), and the journal is kept in the run store beside it;
--   * resume: the run that died is claimed (ledger:claim_run: one claimer wins), its backend is
--     the one it recorded (an embedded backend is joined again on its state dir), its journal is
--     loaded, and the recipe runs again from the top with the same arguments; before the first
--     call that goes live, every sandbox the journal holds is looked up (lost_sandbox when one
--     is gone);
--   * record: the journal goes to a cassette file, with the recipe's own moonbox.http requests
--     and httpd servers besides;
--   * replay: no backend, no ledger, no state dir: every connection is a replay's, whose
--     transport refuses every request, and every call is answered from the cassette.
local durable = require "moonbox.durable"
local dstore = require "moonbox.durable.store"
local json = require "moonbox.json"
local core = require "moonbox.core"
local trace = require "moonbox.trace"
local conn = require "moonbox.render.conn"
local api = require "moonbox.render.api"
local sandbox = require "moonbox.render.sandbox"
local ledger = require "moonbox.ledger"
local sys = require "moonbox.sys"

local M = {}

local CLOUD = "https://api.render.com/v1"

-- ---- the recipe's own HTTP, in a cassette -----------------------------------------------------

local saved_http

local function http_sig(o)
  local body = o.body
  if body == nil and o.body_file then body = "file " .. o.body_file end
  return "http.request " .. tostring(o.method or (body and "POST" or "GET")) .. " " .. tostring(o.url) ..
    " " .. durable.digest(body)
end

-- A server of a replay: the cassette holds what it answered, not the server; its routes are
-- taken and never called.
local function replayed_server(a)
  local srv = { url = a.url, host = a.host, port = a.port }
  local known = { route = true, close = true, shutdown = true, set_key = true, token_put = true,
    token_drop = true }
  return setmetatable(srv, {
    __index = function(_, k)
      if known[k] then return function() end end
      if k == "stats" then return function() return {} end end
      return nil
    end,
    __close = function() end,
    __tostring = function() return "httpd server " .. tostring(a.url) .. " (replayed)" end,
  })
end

local function install_http(j)
  local http = require "moonbox.http" -- lazy: libcurl, already loaded by any run that records
  local httpd = require "moonbox.httpd" -- lazy: libmicrohttpd, only for a recording or a replay
  saved_http = { http = http, httpd = httpd, request = http.request, listen = httpd.listen }
  local request, listen = saved_http.request, saved_http.listen
  http.request = function(o)
    if type(o) ~= "table" then return request(o) end
    return j:call({ sig = http_sig(o), op = "http.request", repeatable = (o.method or "GET") == "GET",
      encode = function(r)
        return { status = r.status, headers = r.headers, body = durable.bin(r.body), url = r.url }
      end,
      decode = function(a)
        return { status = a.status, headers = a.headers or {}, body = durable.unbin(a.body), url = a.url }
      end,
    }, function() return request(o) end)
  end
  httpd.listen = function(o)
    return j:call({ sig = "httpd.listen " .. tostring(type(o) == "table" and o.host or "127.0.0.1"),
      op = "httpd.listen", repeatable = true,
      encode = function(srv) return { url = srv.url, host = srv.host, port = srv.port } end,
      decode = replayed_server,
    }, function() return listen(o) end)
  end
end

local function uninstall_http()
  if not saved_http then return end
  saved_http.http.request = saved_http.request
  saved_http.httpd.listen = saved_http.listen
  saved_http = nil
end

-- ---- a resume's check of the sandboxes it holds ----------------------------------------------

local GONE = { terminated = true, terminating = true, failed = true, error = true, errored = true }

--- run.check_sandboxes(j): a resume's on_live (durable.new): raises lost_sandbox for the first
-- sandbox journal j holds that the backend (the default connection's) says is gone. [yields]
local function check_sandboxes(j)
  local c = conn.default()
  for id, e in pairs(j:sandboxes()) do
    local ok, d = pcall(api.call, c, "sandboxes.get", "GET", "/sandboxes/" .. id, { sandbox_id = id })
    if not ok then
      if type(d) == "table" and d.code == "not_found" then
        durable.lost_sandbox(id, e, "gone (its backend does not know it)")
      end
      error(d, 0)
    end
    if type(d) == "table" and GONE[d.status] then durable.lost_sandbox(id, e, tostring(d.status)) end
  end
end

-- What a resume ends holding without knowing it: the sandboxes its journal says the run holds
-- whose create the resumed recipe never reached (it failed before it, e.g. nondeterminism or
-- lost_sandbox, or went another way): no guard of the recipe knows them, and the run has ended,
-- so nothing would terminate them. They are terminated here (and released in the ledger: run
-- it in the task the run's ledger is attached to); failures go to say(line) (default: stderr),
-- and are left to `moonbox reap`. [yields]
local function terminate_unreached(j, say)
  for id, e in pairs(j:sandboxes()) do
    local q = j.streams[e.s] and j.streams[e.s].c
    if not q or e.n > q.n then
      local ok, err = pcall(sandbox.terminate, id)
      if not ok then
        local line = string.format("moonbox: terminating %s, which the resumed run never reached, " ..
          "failed: %s", id, tostring(err))
        if say then say(line) else io.stderr:write(line, "\n") end
      end
    end
  end
end
M.check_sandboxes = check_sandboxes
M.terminate_unreached = terminate_unreached

-- ---- the replay's connection ----------------------------------------------------------------

local function refuse(o)
  error(core.Error.new { op = "durable", code = "nondeterminism",
    message = "a replay has no backend, and this request was not answered from the cassette: " ..
      tostring(o and o.method or "GET") .. " " .. tostring(o and o.url) }, 0)
end

local REPLAY_TRANSPORT = { request = refuse, stream = refuse }

-- ---- begin and finish -------------------------------------------------------------------------

local function connect_for(r)
  if r.local_state and r.local_state ~= "" then
    return conn.set_default { backend = "local", state_dir = r.local_state, workspace = r.workspace }
  end
  if r.backend == CLOUD then return conn.set_default { backend = "render", workspace = r.workspace } end
  return conn.set_default { backend = r.backend, workspace = r.workspace }
end

local function absolute(file)
  if file:sub(1, 1) == "/" then return file end
  return sys.getcwd() .. "/" .. file
end

--- run.begin(o) -> ctx: sets up the journal of a run and makes it active, in the root task,
-- before the recipe runs. o: mode ("durable" | "record" | "replay"), file (the recipe; nil for a
-- resume, which takes the run's), args (the recipe's arguments), backend (--backend), run_key
-- (--run-id: a durable run's own name, resumed when it names a run that died), resume (a run id
-- or key: resume that run), cassette (the file of --record / --replay). ctx: file and args (what
-- the recipe is run with), run_id, resumed (a resume's row), journal. Raises a message for a run
-- that cannot be resumed (see ledger:claim_run) or a cassette that cannot be read. [yields]
function M.begin(o)
  local ctx = { file = o.file, args = o.args or {}, mode = o.mode }
  trace.keep_secrets()
  local j
  if o.mode == "durable" then
    local L = ledger.open()
    ledger.set_process(L)
    ctx.ledger = L
    local row
    if o.resume then
      row = math.tointeger(tonumber(o.resume)) and L.db:row("SELECT * FROM runs WHERE id = ?",
        math.tointeger(tonumber(o.resume)))
        or L.db:row("SELECT * FROM runs WHERE run_key = ?", tostring(o.resume))
      if not row then
        error(string.format("moonbox: no run %s in %s to resume", tostring(o.resume), L.path), 0)
      end
    elseif o.run_key then
      row = L.db:row("SELECT * FROM runs WHERE run_key = ?", o.run_key)
    end
    local entries = {}
    if row then
      -- A schedule's durable run belongs to the daemons: the one whose sweep finds it dead
      -- resumes it, and writes its history record.
      local srun = L.db:row("SELECT id, schedule FROM schedule_runs WHERE ledger_run = ? ORDER BY id LIMIT 1",
        row.id)
      if srun then
        error(string.format("moonbox: cannot resume: run %d is schedule '%s''s run (record %d): the " ..
          "`moonbox schedule` daemons resume it themselves (a daemon firing '%s' on this state " ..
          "resumes it once its own daemon is gone; `moonbox runs %s` shows it)", row.id, srun.schedule,
          srun.id, srun.schedule, srun.schedule), 0)
      end
      local claimed, why = L:claim_run(row.id)
      if not claimed then error("moonbox: cannot resume: " .. why, 0) end
      ctx.resumed = claimed
      L.run_id = claimed.id
      if L.shared then L:keep_alive() end
      ctx.file = ctx.file or claimed.recipe
      local args = claimed.args and json.decode(claimed.args)
      if type(args) == "table" and not o.args_given then ctx.args = args end
      connect_for(claimed)
      entries = dstore.db(L.db, claimed.id):load()
    else
      local c = conn.set_default { backend = o.backend }
      L:begin_run { recipe = absolute(ctx.file), backend = c.base, workspace = c.workspace,
        local_state = c.state_dir, durable = true, args = json.encode(json.array(ctx.args)),
        run_key = o.run_key }
      if L.shared then L:keep_alive() end
    end
    ctx.run_id = L.run_id
    j = durable.new { mode = "durable", store = dstore.db(L.db, L.run_id), entries = entries,
      on_live = ctx.resumed and check_sandboxes or nil }
    j.run_id = L.run_id
  elseif o.mode == "record" then
    local c = conn.set_default { backend = o.backend }
    ctx.cassette = dstore.cassette(o.cassette,
      { recipe = ctx.file, args = ctx.args, workspace = c.workspace })
    j = durable.new { mode = "record", store = ctx.cassette }
    install_http(j)
  elseif o.mode == "replay" then
    local header, entries = dstore.read_cassette(o.cassette)
    ctx.header = header
    ctx.file = ctx.file or header.recipe
    if not o.args_given and type(header.args) == "table" then ctx.args = header.args end
    -- The key is never sent (the transport refuses every request); shorter than 4 bytes, it is
    -- not registered as a secret, which would redact the word from every call compared.
    conn.simulate(function()
      return { url = "http://replay.invalid", api_key = "-", transport = REPLAY_TRANSPORT,
        workspace = header.workspace ~= json.null and header.workspace or nil, kind = "replay" }
    end)
    j = durable.new { mode = "replay", store = { put = function() end }, entries = entries,
      workspace = header.workspace }
    install_http(j)
  else
    error("moonbox.durable.run: unknown mode " .. tostring(o.mode), 2)
  end
  ctx.journal = j
  durable.start(j)
  return ctx
end

--- run.finish(ctx, ok) -> the journal's stats: ends the journal (what waits to be written is
-- written), puts moonbox.http and httpd back, completes the cassette of a recording, ends a
-- replay's simulated connections. Does not raise. [yields] on PostgreSQL.
function M.finish(ctx)
  local stats = durable.stop()
  if ctx.resumed then terminate_unreached(ctx.journal) end
  uninstall_http()
  if ctx.cassette then
    local ok, err = pcall(ctx.cassette.close, ctx.cassette, true)
    if not ok then io.stderr:write(tostring(err), "\n") end
  end
  if ctx.mode == "replay" then conn.simulate(nil) end
  return stats
end

--- run.describe(ctx, stats) -> one line for stderr about what the journal did (nil when there is
-- nothing to say: a fresh durable run or a recording). Does not yield.
function M.describe(ctx, stats)
  if not stats then return nil end
  if ctx.resumed then
    return string.format("moonbox: resumed run %d (resume %d): %d call(s) answered from its journal, " ..
      "%d in flight when it stopped, %d live", ctx.run_id, ctx.resumed.resumes or 1, stats.replayed,
      stats.in_flight, stats.live)
  end
  if ctx.mode == "replay" then
    return string.format("moonbox: replayed %d call(s) from %s", stats.replayed, tostring(ctx.cassette_path))
  end
  return nil
end

return M
