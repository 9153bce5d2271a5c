--- moonbox.render.sandbox — the Sandbox class and the sandboxes' lifecycle: create, get, list,
-- wait until running, terminate.
--
-- The class has this one file. Its methods come from the parts that implement them — this
-- file's lifecycle functions, moonbox.render.exec, moonbox.render.files and
-- moonbox.render.snapshots — through one explicit table (Sandbox.methods, below); no part adds
-- methods by itself. A part sees a sandbox only through its public face: sb.id, its fields, and
-- sb:connection().
--
-- Ownership, which is what this file is for: a sandbox is owned from the moment its create
-- answers. The create request runs to its end in a task of its own (api.shielded), so a caller
-- that is cancelled, or whose deadline passes, while the request is in flight does not lose
-- the answer: the sandbox it names is terminated before the cancellation goes on. A create
-- that waits for `running` and fails or is interrupted while waiting terminates the sandbox too:
-- it never reached its caller, so nobody else could. The ledger (moonbox.ledger) has an intent
-- for every create before it is sent, the id as soon as the answer names it, and a release only
-- when the backend confirms the sandbox is gone or was never made; every create carries a label
-- in its name so that one whose answer was lost can be found again — at once, by listing the
-- backend, and later by `moonbox reap`.
local api = require "moonbox.render.api"
local conn = require "moonbox.render.conn"
local events = require "moonbox.render.events"
local budget = require "moonbox.render.budget"
local object = require "moonbox.render.object"
local exec = require "moonbox.render.exec"
local files = require "moonbox.render.files"
local snapshots = require "moonbox.render.snapshots"
local ledger = require "moonbox.ledger"
local json = require "moonbox.json"
local http = require "moonbox.http"
local task = require "moonbox.task"
local core = require "moonbox.core"
local trace = require "moonbox.trace"
local ids = require "moonbox.ids"
local schema = require "moonbox.schema"
local guard = require "moonbox.guard"
local durable = require "moonbox.durable"

local M = {}

local Sandbox = { __name = "moonbox.render.Sandbox" }

local function wrap(c, data, guarded)
  return setmetatable({ _data = data, _conn = c, _kept = not guarded }, Sandbox)
end

-- ---- lifecycle methods -------------------------------------------------------------------------

--- sb:connection() -> the Conn this sandbox's calls go through (moonbox.render.conn).
local function connection(sb) return rawget(sb, "_conn") end

-- A sandbox is gone: record it, release it in the ledger, tell the observers.
local function terminated(sb_or_id, how)
  local id = sb_or_id
  if type(sb_or_id) == "table" then
    id = sb_or_id.id
    rawget(sb_or_id, "_data").status = "terminated"
  end
  ledger.release_anywhere(id, how)
  events.emit("terminated", id)
end

--- sandbox.terminate_request(c, id) -> "terminated", or "gone" when the backend no longer knows
-- the sandbox: the terminate request alone, over connection c (no ledger release, no event;
-- `moonbox reap` records what it settles itself). Raises the request's error otherwise. [yields]
local function terminate_request(c, id)
  local ok, err = pcall(api.call, c, "sandboxes.terminate", "POST", "/sandboxes/" .. id .. "/terminate",
    { idempotent = true, sandbox_id = id, journal_ahead = true })
  if ok then return "terminated" end
  if type(err) == "table" and err.status == 404 and err.code == "not_found" then return "gone" end
  error(err, 0)
end
M.terminate_request = terminate_request

--- sb:refresh() -> sb with its fields re-read from the API. [yields]
local function refresh(sb)
  rawset(sb, "_data", api.call(connection(sb), "sandboxes.get", "GET", "/sandboxes/" .. sb.id,
    { sandbox_id = sb.id }))
  return sb
end

--- sb:terminate(): terminates it (idempotent; a sandbox the backend no longer knows counts as
-- terminated); afterwards sb.status is "terminated" and the ledger has released it. The request
-- runs to its end even if the calling task is cancelled meanwhile (the cancellation is raised
-- afterwards). Raises structured errors (op "sandboxes.terminate") once the retries are
-- spent. [yields]
local function terminate(sb)
  local interruption, ok, how = api.shielded(terminate_request, connection(sb), sb.id)
  if ok then terminated(sb, how) end
  if interruption then error(interruption, 0) end
  if not ok then error(how, 0) end
end

--- sb:suspend(): asks for an idle suspend now (it resumes on the next exec or file transfer).
-- [yields]
local function suspend(sb)
  local data = api.call(connection(sb), "sandboxes.suspend", "POST", "/sandboxes/" .. sb.id .. "/suspend",
    { idempotent = true, sandbox_id = sb.id })
  if type(data) == "table" then rawset(sb, "_data", data) end
end

--- sb:keep() -> sb: leaving its scope will no longer terminate it (it stays in the ledger, so
-- `moonbox reap` ends it once the run is over).
local function keep(sb)
  rawset(sb, "_kept", true)
  events.emit("kept", sb)
  return sb
end

--- sb:adopt() -> sb: makes a sandbox obtained by get/list a guard (terminated on scope exit).
local function adopt(sb)
  rawset(sb, "_kept", false)
  return sb
end

-- ---- waiting for a status ---------------------------------------------------------------------

-- The poll schedule of wait_running: without an event stream the interval doubles from POLL_FAST
-- up to 1 s (a local create runs in ~20 ms, a cloud one in seconds: 10 ms first catches the
-- first without flooding the second); while the sandbox's log stream is open the poll is only
-- a safety net and starts at POLL_NET (an event wakes the wait at once).
local POLL_FAST, POLL_NET, POLL_MAX = 0.01, 0.25, 1

--- Follows the sandbox's log stream (GET /sandboxes/{id}/logs, SSE) and calls poke(type) for
-- every lifecycle event it carries (the stream replays the sandbox's history first, then
-- follows). Calls opened() once the stream answers 2xx. Returns quietly when the stream cannot
-- be opened, fails or ends: the caller's poll goes on regardless. [yields]
local function follow_lifecycle(sb, opened, poke)
  local c = connection(sb)
  -- A dry run's simulated backend has no log stream: its poll on the simulated clock is exact.
  if c.transport then return end
  local path = "/sandboxes/" .. sb.id .. "/logs"
  -- A request like any other: counted, and one span (cat "api") in a trace.
  api.calls_made = api.calls_made + 1
  local info = {}
  local _span <close> = api.span("sandboxes.wait_running.logs", "GET", path, { sandbox_id = sb.id }, info)
  local ok, resp = pcall(http.stream, { url = c.base .. path,
    headers = api.headers(c.api_key, { Accept = "text/event-stream" }), connect_timeout = 10,
    idle_timeout = 120 })
  if not ok then
    if task.is_cancelled(resp) then
      _span:close_with(nil) -- the wait ended: the normal end of this request
      error(resp, 0)
    end
    info.status = type(resp) == "table" and resp.code or nil
    return
  end
  local _ <close> = resp
  info.status, info.request_id = resp.status, resp.headers["render-request-id"]
  c:note("sandboxes.wait_running.logs", "GET", path, resp.status, 1)
  if resp.status < 200 or resp.status >= 300 then return end
  opened()
  while true do
    local rok, ev = pcall(resp.read_event, resp)
    if not rok then
      if task.is_cancelled(ev) then
        _span:close_with(nil) -- the wait ended: the normal end of this request
        error(ev, 0)
      end
      return
    end
    if not ev then return end
    if ev.event == "lifecycle" then
      local dok, d = pcall(json.decode, ev.data)
      if dok and type(d) == "table" and type(d.type) == "string" then poke(d.type) end
    end
  end
end

--- sb:wait_running{timeout = 120, interval} -> sb once it is running. Learns the transition
-- from the sandbox's log stream, whose lifecycle events wake the wait as soon as the backend
-- records them; each wake (an event, or a poll) re-reads the sandbox, and that answer decides
-- (the stream replays old transitions first). The poll goes on beside the stream as a safety
-- net, in case the stream says nothing (or cannot be opened): from `interval` (default 10 ms,
-- or 0.25 s once the stream is open), doubling up to 1 s. Raises code "sandbox_not_running"
-- if it becomes errored or terminated, and "timeout" after the deadline (the sandbox is then
-- left as it is: whoever owns it decides). Does not wake a suspended sandbox. [yields]
local function wait_running(sb, opts)
  opts = opts or {}
  local limit = schema.seconds(opts.timeout) or 120
  local deadline = task.now() + limit
  local function check()
    local s = sb.status
    if s == "running" then
      if not rawget(sb, "_seen_running") then
        rawset(sb, "_seen_running", true)
        events.emit("running", sb)
      end
      return true
    end
    if s == "errored" or s == "terminated" then
      error(api.error { op = "sandboxes.wait_running", code = "sandbox_not_running", sandbox_id = sb.id,
        message = "sandbox " .. sb.id .. " became " .. s .. " instead of running" }, 0)
    end
    if task.now() >= deadline then
      error(api.error { op = "sandboxes.wait_running", code = "timeout", sandbox_id = sb.id,
        message = string.format("sandbox %s still %s after %g s", sb.id, tostring(s), limit) }, 0)
    end
    return false
  end
  if check() then return sb end
  -- A wake is pending until the wait has re-read the sandbox, so none is lost while it does.
  local wake, pending = core.cond(), false
  local function poke()
    pending = true
    wake:broadcast()
  end
  local streaming = false
  local follower = task.spawn(follow_lifecycle, sb, function() streaming = true end, poke)
  core.observe(follower)
  local poller = task.spawn(function()
    local interval = opts.interval or POLL_FAST
    while true do
      task.sleep(math.max(0, math.min(interval, deadline - task.now())))
      poke()
      interval = math.min(interval * 2, POLL_MAX)
      if streaming and not opts.interval and interval < POLL_NET then interval = POLL_NET end
    end
  end)
  local ok, err = pcall(function()
    while true do
      if not pending then wake:wait() end
      pending = false
      refresh(sb)
      if check() then return end
    end
  end)
  task.cancel(poller)
  task.cancel(follower)
  if not ok then error(err, 0) end
  return sb
end

--- The methods of every Sandbox, each from the part that implements it. This table is the one
-- place where the class is assembled; the REPL completes from it.
Sandbox.methods = {
  -- lifecycle (this file)
  connection = connection, refresh = refresh, terminate = terminate, suspend = suspend, keep = keep,
  adopt = adopt, wait_running = wait_running,
  -- commands (moonbox.render.exec)
  exec = exec.exec, spawn = exec.spawn, run_sync = exec.run_sync,
  -- files (moonbox.render.files)
  read = files.read, write = files.write, copy_in = files.copy_in, copy_out = files.copy_out, ls = files.ls,
  stat = files.stat, exists = files.exists, remove = files.remove, mkdir = files.mkdir, rename = files.rename,
  -- snapshots (moonbox.render.snapshots)
  snapshot = snapshots.capture,
}
-- The old files names (sb:upload, ...) raise an error naming the new call; found through the
-- metatable, so the REPL does not offer them.
setmetatable(Sandbox.methods, { __index = files.renamed })

Sandbox.__index = object.index(Sandbox.methods)
Sandbox.__tostring = function(sb)
  return string.format("Sandbox %s (%s, %s)", sb.id, sb.status or "?", sb.plan or "?")
end

-- What a failed terminate's message ends with: `moonbox reap` retries it — unless the sandbox
-- lives only in a dry run or a replay (no backend made it: there is nothing to reap).
local function reap_hint(sb)
  local c = connection(sb)
  local kind = c and c.kind
  if kind == "dry-run" or kind == "replay" then
    return " (a " .. kind .. ": nothing was made, nothing is left)"
  end
  return " (`moonbox reap` retries it)"
end

--- Scope exit of a sandbox held in a `<close>` variable: terminates it unless kept. A failed
-- terminate never replaces the error being unwound: it is attached to it (err.cleanup_errors)
-- and reported on stderr; on a normal exit it raises "cleanup_failed".
Sandbox.__close = function(sb, err)
  if rawget(sb, "_kept") or sb.status == "terminated" then return end
  local ok, terr = pcall(terminate, sb)
  if ok then return end
  if err ~= nil then
    if not api.is_interruption(terr) then
      guard.attach(err, { { id = sb.id, label = "terminate " .. sb.id, error = terr } })
      io.stderr:write("moonbox: while unwinding ", tostring(err), ", terminating ", sb.id, " failed: ",
        tostring(terr), reap_hint(sb), "\n")
    end
    return
  end
  if api.is_interruption(terr) then error(terr, 0) end
  error(api.error { op = "sandbox:close", code = "cleanup_failed", sandbox_id = sb.id, cause = terr,
    message = "could not terminate " .. sb.id .. " at the end of its scope: " .. tostring(terr) ..
      reap_hint(sb) }, 0)
end

M.Sandbox = Sandbox

--- sandbox.discard(sb, err): terminates a sandbox that never reached the code it was made for
-- (its create or its start failed or was interrupted). A failure is attached to err
-- (err.cleanup_errors, when err is a table) and reported on stderr; it never replaces err, and
-- the ledger keeps the sandbox for `moonbox reap`. [yields]
function M.discard(sb, err)
  local ok, terr = pcall(terminate, sb)
  if ok or api.is_interruption(terr) then return end
  guard.attach(err, { { id = sb.id, label = "terminate " .. sb.id, error = terr } })
  io.stderr:write("moonbox: terminating ", sb.id, " after ", tostring(err), " failed: ", tostring(terr),
    reap_hint(sb), "\n")
end

-- ---- create ---------------------------------------------------------------------------------

--- The options of a sandbox's create, shared by render.sandboxes.create, render.restore
-- (moonbox.render.fleet) and the sandboxes of render.snapshots.rebuild (docs/reference/render.md,
-- "Names": `lifetime` is the server's, `wait_timeout` the client's wait).
M.CREATE_OPTIONS = {
  plan = { type = "string", doc = "the sandbox's plan (a restore from a snapshot takes the snapshot's)" },
  region = { type = "string", doc = "the region to create it in" },
  name = { type = "string",
    doc = "its name; without one moonbox's label (by which a lost answer is found again)" },
  lifetime = { type = "seconds", kind = "lifetime", removed = { "timeout", "timeout_seconds" },
    refusals = { timeout = "`timeout` was the sandbox's lifetime: write `lifetime`; the wait's deadline " ..
      "is `wait_timeout`" },
    doc = "how long the sandbox lives on the server (the API's timeoutSeconds); Render's default " ..
      "without it" },
  idle_lifetime = { type = "seconds", kind = "lifetime", removed = { "idle_timeout_seconds" },
    doc = "how long it may sit idle before the server suspends it (the API's idleTimeoutSeconds)" },
  group = { type = { "string", "Group" }, removed = { "sandbox_group_id" },
    doc = "the sandbox group (a Group or its id); default the snapshot's, else the workspace's default" },
  env = { type = "table", doc = "environment variables of the sandbox (values are kept out of logs)" },
  network = { type = "string", enum = { "allow-all", "deny-all" }, removed = { "network_policy" },
    refusals = { network_policy = "option `network_policy` was removed: write `network` (\"deny-all\" or " ..
      "\"allow-all\"), or `allow = {domains}` for an allow-list" },
    doc = "outbound network: \"allow-all\" or \"deny-all\"; Render's default (allow-all) without it" },
  allow = { type = "table", doc = "an allow-list of domains (outbound network to those only)" },
  snapshot = { type = { "string", "Snapshot" }, removed = { "snapshot_id", "snapshot_name" },
    doc = "restore from a snapshot: a Snapshot, an id (snp-...) or a name (the newest available one)" },
  wait = { type = "boolean", default = true, doc = "false: return at once, status \"creating\"" },
  wait_timeout = { type = "seconds", kind = "deadline", default = 120,
    doc = "the longest the wait for `running` takes; then `timeout`, and the sandbox is terminated" },
}

--- Builds the create body from recipe options (checked against M.CREATE_OPTIONS: the names of
-- docs/reference/render.md "Names"; the API's own names on the wire). Unset options are not
-- sent (the SDKs' rule). Raises nothing.
local function create_body(c, opts)
  local body = { ownerId = c:owner() }
  local function set(wire, v) if v ~= nil then body[wire] = v end end
  local function secs(v)
    v = schema.seconds(v)
    return v and (math.tointeger(v) or v)
  end
  set("plan", opts.plan)
  set("region", opts.region)
  set("name", opts.name)
  set("timeoutSeconds", secs(opts.lifetime))
  set("idleTimeoutSeconds", secs(opts.idle_lifetime))
  local g = opts.group
  set("sandboxGroupId", type(g) == "table" and g.id or g)
  set("env", opts.env)
  if type(opts.env) == "table" then
    for _, v in pairs(opts.env) do trace.secret(tostring(v)) end
  end
  local np
  if opts.network ~= nil then np = { default = opts.network } end
  if opts.allow ~= nil then
    np = { default = "allow-list", allowedDomains = json.array(opts.allow) }
  end
  set("networkPolicy", np)
  local snap = opts.snapshot
  if snap ~= nil then
    if type(snap) == "table" then
      body.snapshotId = snap.id
      body.sandboxGroupId = body.sandboxGroupId or snap.sandbox_group_id
      body.plan = body.plan or snap.plan
    elseif ids.valid("snp", snap) then
      body.snapshotId = snap
    else
      body.snapshotName = snap
    end
  end
  return body
end

--- sandbox.find_by_label(c, label) -> the API object of the non-terminated sandbox named label,
-- or nil (lists every page). [yields]
function M.find_by_label(c, label)
  local cursor
  repeat
    local page = api.call(c, "sandboxes.list", "GET", "/sandboxes",
      { query = { ownerId = c.workspace, cursor = cursor, limit = 100 } })
    for _, e in ipairs(page) do
      if e.sandbox and e.sandbox.name == label then return e.sandbox end
    end
    cursor = page[#page] and page[#page].cursor
  until #page < 100
  return nil
end

-- The ledger intent and the label of a create: written down before the request goes out, in the
-- run's ledger when it keeps one. A durable run resuming reuses the intent and label its
-- journal recorded for this create (moonbox.durable): the ledger row exists since the first
-- attempt, and the label is part of the journaled body.
local function name_create(L, run_id, body)
  local rec = durable.peek("sandboxes.create")
  local intent, label, reused
  if rec and rec.meta and (rec.meta.intent or rec.meta.label) then
    intent, label, reused = rec.meta.intent, rec.meta.label, true
  elseif L then
    intent, label = L:intent(run_id)
  else
    label = "mb-x" .. durable.fresh(function() return ids.token():sub(1, 16) end)
  end
  if body.name == nil then body.name = label else label = nil end
  return intent, label, reused
end

-- The create request and what its answer means for the ledger; runs in a task of its own.
-- A create a crash left in flight in a durable run is found by its label, or sent again.
local function create_request(c, body, L, run_id)
  local intent, label, reused = name_create(L, run_id, body)
  events.emit("creating", nil, { name = body.name, snapshot_id = body.snapshotId })
  local ok, data = pcall(api.call, c, "sandboxes.create", "POST", "/sandboxes",
    { body = body, idempotent = false, snapshot_id = body.snapshotId,
      journal = { intent = intent, label = label },
      in_flight = label and function()
        local found = M.find_by_label(c, label)
        if found then return true, found, 201, {} end
        return nil
      end or nil })
  if ok then
    if L then L:bind(intent, data.id) end
    return data
  end
  local err = data
  if api.is_interruption(err) or type(err) ~= "table" then error(err, 0) end
  if err.op == "durable" then
    -- A durable run's resume refused the call before sending it (nondeterminism, lost_sandbox):
    -- no lost answer, nothing to look for by label. A fresh intent was never used; one the
    -- journal recorded stays as the first attempt left it (the resume settles its sandbox).
    if L and not reused then L:fail(intent, err.code) end
    error(err, 0)
  end
  if api.definite(err) then
    -- The backend refused: nothing was made.
    if L then L:fail(intent, err.code or "refused") end
    error(err, 0)
  end
  -- A lost answer or a 5xx: the sandbox may exist. Its label finds it.
  if label then
    local found_ok, found = pcall(M.find_by_label, c, label)
    if found_ok and found then
      if L then L:bind(intent, found.id) end
      trace.instant("create recovered", "sandbox", { label = label, sandbox_id = found.id, code = err.code })
      return found
    end
    err.label = label
    err.message = tostring(err.message) .. (found_ok
      and string.format("; no sandbox carries its label %s yet", label)
      or string.format("; looking for its label %s failed too (%s)", label, tostring(found))) ..
      (L and " — the ledger keeps it for `moonbox reap`" or "")
  end
  error(err, 0)
end

--- render.sandboxes.create(opts) -> Sandbox, once it is running (opts.wait = false returns at
-- once, status "creating"). opts: M.CREATE_OPTIONS (plan, region, name, lifetime, idle_lifetime,
-- network ("deny-all"|"allow-all"), allow (domains), env, snapshot (a Snapshot, an id or a name),
-- group, wait, wait_timeout (seconds, default 120)), checked before anything is sent
-- (moonbox.schema: an unknown, removed or mistyped option raises invalid_option). The Sandbox is
-- a `<close>` guard: leaving its scope terminates it unless sb:keep() was called. Never re-sends
-- the create after an ambiguous failure (a 429 is a refusal and is). A lost answer or a 5xx is
-- reconciled by the label moonbox puts in the sandbox's name when opts.name is not given: a
-- sandbox carrying it is the one created (returned as if the answer had come); none found raises
-- the original error (code "unknown_outcome" for a lost answer). If the calling task is
-- cancelled, or its deadline passes, while the request is in flight or while waiting for
-- `running`, or the wait fails, the sandbox is terminated before the error is raised. Raises
-- structured errors (op "sandboxes.create", "sandboxes.wait_running"), and budget_exceeded before
-- sending anything when the run's budget is spent (moonbox.render.budget). [yields]
function M.create(opts)
  opts = opts or {}
  local c = conn.default()
  local body = create_body(c, opts)
  local b = budget.current()
  if b then b:before_create() end
  local L, run_id = ledger.for_create(c)
  local interruption, ok, data = api.shielded(create_request, c, body, L, run_id)
  if not ok then
    if b and api.definite(data) then b:create_refused() end
    events.emit("create_failed", nil, { name = body.name, error = data })
    error(interruption or data, 0)
  end
  local sb = wrap(c, data, true)
  events.emit("created", sb, { snapshot_id = body.snapshotId })
  if interruption then
    -- The caller stopped waiting while the request was in flight: this call still owns it.
    M.discard(sb, interruption)
    error(interruption, 0)
  end
  if opts.wait ~= false then
    local wok, werr = pcall(wait_running, sb, { timeout = schema.seconds(opts.wait_timeout) })
    if not wok then
      M.discard(sb, werr)
      error(werr, 0)
    end
  end
  return sb
end

--- render.sandboxes.get(id) -> Sandbox (not a guard: it is not terminated on scope exit
-- unless you adopt it with sb:adopt()). Raises code "not_found" for an unknown id. [yields]
function M.get(id)
  local c = conn.default()
  return wrap(c, api.call(c, "sandboxes.get", "GET", "/sandboxes/" .. id, { sandbox_id = id }), false)
end

--- render.sandboxes.list(opts) -> iterator over every Sandbox (all pages; not guards). opts.status:
-- a status or a list of them (default: Render's, which hides terminated); opts.page_size: how
-- many each request asks for (1..100, default 100); opts.limit: stop after that many sandboxes
-- (and ask for no more). Unknown options raise. [yields]
function M.list(opts)
  opts = opts or {}
  local c = conn.default()
  local status = opts.status
  if type(status) == "string" then status = { status } end
  local items = api.pages(c, "sandboxes.list", "/sandboxes", { ownerId = c.workspace, status = status }, opts,
    "render.sandboxes.list")
  return function()
    local item = items()
    return item and wrap(c, item.sandbox, false)
  end
end

--- render.sandboxes.terminate(id): terminates by id (idempotent; runs to its end as
-- sb:terminate does). Raises "not_found" for an id the backend does not know. [yields]
function M.terminate(id)
  local c = conn.default()
  local interruption, ok, err = api.shielded(api.call, c, "sandboxes.terminate", "POST",
    "/sandboxes/" .. id .. "/terminate", { idempotent = true, sandbox_id = id })
  if ok then terminated(id, "terminated") end
  if interruption then error(interruption, 0) end
  if not ok then error(err, 0) end
end

-- ---- the declared calls (moonbox.schema) -------------------------------------------------------

local LIST_OPTIONS = {
  status = { type = { "string", "table" },
    doc = "a status or a list of them; default Render's, which hides terminated" },
  page_size = { type = "integer", default = 100, doc = "how many each request asks for (1..100)" },
  limit = { type = "integer", doc = "stop after that many (and ask for no more)" },
}
M.LIST_OPTIONS = LIST_OPTIONS

local OPTS = { name = "opts", type = "table", optional = true }
local ID = { name = "id", type = "string" }

M.SCHEMA = {
  ["render.sandboxes.create"] = { summary = "creates a sandbox and waits until it runs", args = { OPTS },
    options = M.CREATE_OPTIONS, returns = "Sandbox", yields = true },
  ["render.sandboxes.get"] = { summary = "the sandbox of that id (not a guard until sb:adopt())",
    args = { ID },
    returns = "Sandbox", yields = true },
  ["render.sandboxes.list"] = { summary = "an iterator over the sandboxes (every page; not guards)",
    args = { OPTS }, options = LIST_OPTIONS, returns = "fun(): Sandbox?", yields = true },
  ["render.sandboxes.terminate"] = { summary = "terminates a sandbox by id (idempotent)", args = { ID },
    yields = true },
  ["sb:connection"] = { summary = "the connection this sandbox's calls go through", returns = "table" },
  ["sb:refresh"] = { summary = "re-reads its fields from the API", returns = "Sandbox", yields = true },
  ["sb:terminate"] = { summary = "terminates it (idempotent; runs to its end even when cancelled)",
    yields = true },
  ["sb:suspend"] = { summary = "asks for an idle suspend now", yields = true },
  ["sb:keep"] = { summary = "leaving its scope no longer terminates it", returns = "Sandbox" },
  ["sb:adopt"] = { summary = "makes a sandbox from get/list a guard (terminated on scope exit)",
    returns = "Sandbox" },
  ["sb:wait_running"] = { summary = "waits until the sandbox runs", args = { OPTS }, options = {
    timeout = { type = "seconds", kind = "deadline", default = 120,
      doc = "the longest the wait takes; then `timeout` (the sandbox is left as it is)" },
    interval = { type = "number", default = 0.01,
      doc = "the first poll's delay in seconds (doubling up to 1 s)" },
  }, returns = "Sandbox", yields = true },
}
schema.declare(M.SCHEMA)

M.create = schema.wrap("render.sandboxes.create", M.create)
M.get = schema.wrap("render.sandboxes.get", M.get)
M.list = schema.wrap("render.sandboxes.list", M.list)
M.terminate = schema.wrap("render.sandboxes.terminate", M.terminate)
for _, k in ipairs { "connection", "refresh", "terminate", "suspend", "keep", "adopt", "wait_running" } do
  Sandbox.methods[k] = schema.wrap("sb:" .. k, Sandbox.methods[k])
end

budget.terminate = M.terminate -- (budget.lua: what an exceeded budget ends sandboxes with)

return M
