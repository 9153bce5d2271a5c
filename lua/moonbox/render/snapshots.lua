--- moonbox.render.snapshots — snapshots and sandbox groups (docs/wire.md, "Snapshots", "Groups"), and
-- sb:snapshot, the part of the Sandbox class that captures one (lua/moonbox/render/sandbox.lua
-- lists it as the method `snapshot`).
--
--   local snap = sb:snapshot { name = "py-base" }                  -- waits until available
--   local copy <close> = render.sandboxes.create { snapshot = snap } -- restore = create
--   local newest = render.snapshots.latest("py-base")
--
-- Snapshots are group-scoped: every call that names a snapshot by id alone resolves the group
-- from the workspace's default group (what Render's CLI does). Restoring is
-- render.sandboxes.create{ snapshot = snap }, which takes the group and plan from the snapshot.
local api = require "moonbox.render.api"
local conn = require "moonbox.render.conn"
local object = require "moonbox.render.object"
local task = require "moonbox.task"
local schema = require "moonbox.schema"
local ids = require "moonbox.ids"

local M = {}

-- ---- objects ----------------------------------------------------------------------------------

local field_index = object.index

local snapshot_methods = {}
local Snapshot = { __name = "moonbox.render.Snapshot", __index = field_index(snapshot_methods) }
Snapshot.__tostring = function(s)
  return string.format("Snapshot %s (%s, %s, %s)", s.id, s.name or "unnamed", s.status or "?", s.kind or "?")
end

local group_methods = {}
local Group = { __name = "moonbox.render.Group", __index = field_index(group_methods) }
Group.__tostring = function(g)
  return string.format("Group %s (%s, %s%s)", g.id, g.name or "?", g.region or "?",
    g.is_default and ", default" or "")
end

local function wrap_snapshot(c, data)
  return setmetatable({ _data = data, _conn = c }, Snapshot)
end

local function wrap_group(data)
  return setmetatable({ _data = data }, Group)
end

-- ---- groups -----------------------------------------------------------------------------------

local groups = {}

--- render.groups.list(opts) -> iterator over every Group (fields in snake_case: g.id, g.name,
-- g.region, g.is_default, g.concurrency_limit, ...), all pages, fetched as the loop reaches them
-- (the same shape as render.sandboxes.list and render.snapshots.list). Yields nothing before the
-- workspace's first sandbox. opts: page_size, limit (as render.sandboxes.list); any other key
-- raises. Raises structured errors (op "groups.list"). [yields]
function groups.list(opts)
  local c = conn.default()
  local items = api.pages(c, "groups.list", "/sandbox-groups", { ownerId = c:owner() }, opts,
    "render.groups.list")
  return function()
    local item = items()
    return item and wrap_group(item.sandboxGroup)
  end
end

--- render.groups.default() -> the workspace's default Group, or nil when it has none yet (the
-- first sandbox creates it; this function never does). [yields]
function groups.default()
  for g in groups.list() do
    if g.is_default then return g end
  end
  return nil
end

--- render.groups.create{name, concurrency_limit, region} -> the new Group. name is required;
-- concurrency_limit and region are sent only when given. Not re-sent on failure (a lost answer
-- raises "unknown_outcome"). Raises structured errors (op "groups.create"). [yields]
function groups.create(opts)
  opts = opts or {}
  if opts.name == nil then
    schema.invalid("render.groups.create", { option = "name",
      message = "option `name` (a string) is required" })
  end
  local c = conn.default()
  local data = api.call(c, "groups.create", "POST", "/sandbox-groups", {
    body = { ownerId = c:owner(), name = opts.name, concurrencyLimit = opts.concurrency_limit,
      region = opts.region },
    idempotent = false })
  return wrap_group(data)
end

--- render.groups.delete(group): deletes a sandbox group (a Group or its id). Its snapshots go
-- with it. Raises "not_found" (no such group, or deleted already), "conflict" (it still has
-- sandboxes that are not terminated, or it is the default group: the message says which, with
-- the ids). Also g:delete(). [yields]
function groups.delete(g)
  local id = type(g) == "table" and g.id or g
  if type(id) ~= "string" then
    error("render.groups.delete: expected a Group or a group id, got " .. type(g), 2)
  end
  local c = conn.default()
  api.call(c, "groups.delete", "DELETE", "/sandbox-groups/" .. id, { query = { ownerId = c:owner() },
    idempotent = true, group_id = id })
end
group_methods.delete = groups.delete

--- The id of a group option (a Group or an id); nil means the default group, which is looked
-- up (nil when the workspace has none).
local function group_id(g)
  if type(g) == "table" then return g.id end
  if g ~= nil then return g end
  local d = groups.default()
  return d and d.id
end

-- ---- snapshots --------------------------------------------------------------------------------

local snapshots = {}

local function snapshot_path(gid, sid)
  return "/sandbox-groups/" .. gid .. "/snapshots/" .. sid
end

--- snap:refresh() -> snap with its fields re-read from the API. Raises "snapshot_not_found"
-- once it is deleted or expired. [yields]
function snapshot_methods.refresh(snap)
  local c = rawget(snap, "_conn")
  rawset(snap, "_data", api.call(c, "snapshots.get", "GET", snapshot_path(snap.sandbox_group_id, snap.id),
    { query = { ownerId = c.workspace }, snapshot_id = snap.id }))
  return snap
end

-- The poll of wait_available. Render's API has no event for a snapshot's capture, so the wait
-- polls, adaptively: its first look is at the backend's typical capture time, learned from the
-- last capture this process waited for (FIRST_LOOK before there is one); after that each look
-- comes SLACK of the time since the request after the previous one (at least MIN_STEP, at most
-- MAX_STEP apart). A capture that ends between two looks is therefore seen at most 5% of its
-- own duration late plus one GET — within 10% of it even when the GET costs as much again —
-- and a capture of T seconds costs about log(T / first look) / log(1.05) GETs, not
-- T / interval. What is learned is a lower bound of the
-- capture's time: the last look that still saw "creating"; when the very first look already
-- saw "available" the capture may have been much quicker, and the next first look comes at
-- EARLIER of this one, so the estimate follows quicker captures down within a few.
local FIRST_LOOK, SLACK, MIN_STEP, MAX_STEP, EARLIER = 0.05, 0.05, 0.002, 2, 0.6
local learned -- seconds from request to the end of the last capture waited for (see above)

--- snapshots.learned_capture_seconds() -> how long the next capture is expected to take at
-- least, from the last one this process waited for (see above), or nil before the first.
function M.learned_capture_seconds() return learned end

--- snap:wait_available{timeout = 300, interval} -> snap once its status is "available". Polls
-- adaptively (see above); interval, when given, is the first look's delay in seconds after the
-- capture was requested. Raises code "snapshot_failed" (message: the snapshot's error text)
-- if capture failed, "timeout" after the deadline. [yields]
function snapshot_methods.wait_available(snap, opts)
  opts = opts or {}
  local limit = schema.seconds(opts.timeout) or 300
  local start = task.now()
  local deadline = start + limit
  local requested = rawget(snap, "_requested") -- when this process asked for the capture
  local t0 = requested or start
  local first_look = opts.interval or learned or FIRST_LOOK
  local next_look = t0 + first_look
  local still_creating -- seconds after t0 of the last look that saw "creating"
  while true do
    local s = rawget(snap, "_data").status
    if s == "available" then
      if requested then learned = still_creating or first_look * EARLIER end
      return snap
    end
    if s == "failed" then
      error(api.error { op = "snapshots.wait_available", code = "snapshot_failed", snapshot_id = snap.id,
        sandbox_id = snap.source_sandbox_id,
        message = "snapshot " .. snap.id .. " failed: " .. tostring(snap.error or "no reason given") }, 2)
    end
    local now = task.now()
    if now >= deadline then
      error(api.error { op = "snapshots.wait_available", code = "timeout", snapshot_id = snap.id,
        message = string.format("snapshot %s still %s after %g s", snap.id, tostring(s), limit) }, 2)
    end
    task.sleep(math.max(0, math.min(next_look, deadline) - now))
    local looked = task.now() - t0
    snap:refresh()
    if snap.status == "creating" then still_creating = looked end
    local elapsed = task.now() - t0
    next_look = t0 + elapsed + math.min(math.max(elapsed * SLACK, MIN_STEP), MAX_STEP)
  end
end

--- snap:delete(): deletes it (idempotent: deleting a deleted or expired snapshot succeeds).
-- Sandboxes restored from it are unaffected. Raises "snapshot_creating" while it is being
-- captured, "snapshot_not_found" if it never existed in its group. [yields]
function snapshot_methods.delete(snap)
  local c = rawget(snap, "_conn")
  api.call(c, "snapshots.delete", "DELETE", snapshot_path(snap.sandbox_group_id, snap.id),
    { query = { ownerId = c.workspace }, snapshot_id = snap.id })
end


--- render.snapshots.get(snapshot_id[, {group = Group or id}]) -> Snapshot: the snapshot with
-- that id in the group (default: the workspace's default group). The one shape: a
-- get(group_id, snapshot_id) or a get(snap) raises, naming it (a Snapshot in hand is re-read
-- with snap:refresh()). Raises "snapshot_not_found" (deleted, expired, or in another group),
-- "invalid_snapshot_id", "not_found" (unknown group); an unknown option raises. [yields]
function snapshots.get(sid, opts)
  if type(sid) == "table" then
    error("render.snapshots.get: takes a snapshot id: render.snapshots.get(snap.id, {group = " ..
      "snap.sandbox_group_id}), or snap:refresh() to re-read a Snapshot", 2)
  end
  if type(sid) ~= "string" then
    error("render.snapshots.get: a snapshot id (a string) is required: " ..
      "render.snapshots.get(id[, {group = g}]), got " .. type(sid), 2)
  end
  if type(opts) == "string" then
    error("render.snapshots.get: takes the snapshot id first and the group as an option: " ..
      "render.snapshots.get(snapshot_id, {group = group_id}), not get(group_id, snapshot_id)", 2)
  end
  opts = schema.check("render.snapshots.get", opts or {}, 2)
  local gid = group_id(opts.group)
  local c = conn.default()
  if not gid then
    error(api.error { op = "snapshots.get", code = "snapshot_not_found", snapshot_id = sid,
      message = "the workspace has no sandbox group yet, so no snapshot " .. sid }, 2)
  end
  local data = api.call(c, "snapshots.get", "GET", snapshot_path(gid, sid),
    { query = { ownerId = c.workspace }, snapshot_id = sid, group_id = gid })
  return wrap_snapshot(c, data)
end

--- render.snapshots.list{group = Group or id (default: the default group), status = a status
-- or a list, page_size, limit (as render.sandboxes.list)} -> iterator over every Snapshot, all
-- pages, newest first (expired and deleted ones are omitted by Render). Yields nothing when the
-- workspace has no group yet. Raises "invalid_status", "not_found" (unknown group). [yields]
function snapshots.list(opts)
  local c = conn.default()
  local gid = group_id(opts.group)
  if gid == nil then return function() return nil end end
  local status = opts.status
  if type(status) == "string" then status = { status } end
  local items = api.pages(c, "snapshots.list", "/sandbox-groups/" .. gid .. "/snapshots",
    { ownerId = c:owner(), status = status }, opts, "render.snapshots.list")
  return function()
    local item = items()
    return item and wrap_snapshot(c, item.snapshot)
  end
end

--- render.snapshots.latest(name, {group}) -> the newest "available" Snapshot with that name in
-- the group (default: the default group), or nil. The same snapshot a restore by name picks.
-- [yields]
function snapshots.latest(name, opts)
  opts = opts or {}
  for snap in snapshots.list { group = opts.group, status = "available" } do
    if snap.name == name then return snap end
  end
  return nil
end

--- render.snapshots.delete(snap): deletes a Snapshot, or a snapshot id in the default group
-- (idempotent). Raises as snap:delete(). [yields]
function snapshots.delete(snap)
  if type(snap) ~= "table" then
    local gid = group_id(nil)
    if not gid then
      error(api.error { op = "snapshots.delete", code = "snapshot_not_found", snapshot_id = snap,
        message = "the workspace has no sandbox group yet, so no snapshot " .. tostring(snap) }, 2)
    end
    snap = { id = snap, sandboxGroupId = gid }
  end
  if getmetatable(snap) ~= Snapshot then snap = wrap_snapshot(conn.default(), snap) end
  return snapshot_methods.delete(snap)
end

--- render.snapshots.wait_available(snap, opts) -> snap once available; see
-- snap:wait_available. [yields]
function snapshots.wait_available(snap, opts)
  return snapshot_methods.wait_available(snap, opts)
end

-- ---- sb:snapshot ------------------------------------------------------------------------------

--- snapshots.find_capture(sb, kind, name, since) -> true, snapshot data, 202 when exactly one
-- snapshot of sb's group was captured from sb with that kind and name (nil: any) and requested
-- at or after `since` (unix seconds, whole seconds as Render's timestamps are); nil when none
-- was (the capture never happened: it may be sent again). Raises unknown_outcome when several
-- are candidates. What a durable run's resume asks of a capture a crash left in flight. [yields]
function M.find_capture(sb, kind, name, since)
  local gid = sb.sandbox_group_id
  if gid == nil then sb:refresh() gid = sb.sandbox_group_id end
  local c = sb:connection()
  local found = {}
  local items = api.pages(c, "snapshots.list", "/sandbox-groups/" .. gid .. "/snapshots",
    { ownerId = c.workspace }, {}, "render.snapshots.list")
  for item in items do
    local s = item.snapshot
    local at = s and ids.parse_iso(s.requestedAt)
    if s and s.sourceSandboxId == sb.id and s.kind == kind and (name == nil or s.name == name)
      and at and at >= math.floor(since) - 1 then
      found[#found + 1] = s
    end
  end
  if #found == 1 then return true, found[1], 202, {} end
  if #found == 0 then return nil end
  error(api.error { op = "sandbox:snapshot", code = "unknown_outcome", sandbox_id = sb.id,
    message = string.format("the run stopped while a capture of sandbox %s was in flight, and %d " ..
      "snapshots could be the one it made (%s, %s): name the capture to tell them apart", sb.id, #found,
      found[1].id, found[2].id) }, 0)
end

--- sb:snapshot{kind = "filesystem"|"runtime", name, expires_at, wait = true, wait_timeout = 300}
-- -> Snapshot, once available (wait = false: at once, status "creating"). kind is always sent
-- (default "filesystem": Render's default has changed between versions). expires_at is a unix
-- time or an RFC 3339 string. Never re-sent (a lost answer raises "unknown_outcome"). Raises
-- "invalid_snapshot_name", "sandbox_not_running" (e.g. suspended), and what wait_available
-- raises. [yields]
function M.capture(sb, opts)
  opts = opts or {}
  local kind = opts.kind or "filesystem"
  local expires = opts.expires_at
  if type(expires) == "number" then
    expires = os.date("!%Y-%m-%dT%H:%M:%SZ", math.floor(expires))
  end
  local c = sb:connection()
  local requested = task.now()
  local data = api.call(c, "sandbox:snapshot", "POST", "/sandboxes/" .. sb.id .. "/snapshots", {
    query = { ownerId = c.workspace },
    body = { kind = kind, name = opts.name, expiresAt = expires },
    idempotent = false, sandbox_id = sb.id,
    in_flight = function(e) return M.find_capture(sb, kind, opts.name, e.t0) end })
  local snap = wrap_snapshot(c, data)
  rawset(snap, "_requested", requested)
  if opts.wait ~= false then snap:wait_available { timeout = schema.seconds(opts.wait_timeout) } end
  return snap
end

-- render.snapshots.rebuild is moonbox.render.rebuild's, put here by moonbox.render (rebuild
-- requires this module: the reverse require would be a cycle).

-- ---- the declared calls (moonbox.schema) -------------------------------------------------------

local OPTS = { name = "opts", type = "table", optional = true }
local PAGES = {
  page_size = { type = "integer", default = 100, doc = "how many each request asks for (1..100)" },
  limit = { type = "integer", doc = "stop after that many (and ask for no more)" },
}
local GROUP = { type = { "string", "Group" },
  doc = "a Group or its id; default the workspace's default group" }
local STATUS = { type = { "string", "table" }, doc = "a status or a list of them" }

M.SCHEMA = {
  ["render.groups.list"] = { summary = "the workspace's sandbox groups (every page)", args = { OPTS },
    options = PAGES, returns = "Group[]", yields = true },
  ["render.groups.default"] = { summary = "the workspace's default group, or nil before its first sandbox",
    returns = "Group?", yields = true },
  ["render.groups.create"] = { summary = "creates a sandbox group", args = { { name = "opts",
    type = "table" } },
    options = {
      name = { type = "string", doc = "the group's name (required)" },
      concurrency_limit = { type = "integer", doc = "the most non-terminated sandboxes it allows" },
      region = { type = "string", doc = "its region" },
    }, returns = "Group", yields = true },
  ["render.groups.delete"] = { summary = "deletes a sandbox group and its snapshots",
    args = { { name = "group", type = { "string", "Group" } } }, yields = true },
  ["group:delete"] = { summary = "deletes this sandbox group and its snapshots", yields = true },
  ["render.snapshots.get"] = {
    summary = "the snapshot with that id, in the default group or the one given",
    -- "any": the call itself refuses the old shapes (get(group, id), get(snap)) naming the kept one
    args = { { name = "snapshot_id", type = "any" }, { name = "opts", type = "any", optional = true } },
    options = { group = GROUP }, returns = "Snapshot", yields = true },
  ["render.snapshots.list"] = { summary = "an iterator over a group's snapshots, newest first",
    args = { OPTS },
    options = { group = GROUP, status = STATUS, page_size = PAGES.page_size, limit = PAGES.limit },
    returns = "fun(): Snapshot?", yields = true },
  ["render.snapshots.latest"] = { summary = "the newest available snapshot of that name, or nil",
    args = { { name = "name", type = "string" }, OPTS }, options = { group = GROUP },
    returns = "Snapshot?", yields = true },
  ["render.snapshots.delete"] = { summary = "deletes a snapshot (idempotent)",
    args = { { name = "snapshot", type = { "string", "Snapshot", "table" } } }, yields = true },
  ["render.snapshots.wait_available"] = { summary = "waits until the snapshot is available",
    args = { { name = "snapshot", type = "Snapshot" }, OPTS }, options = nil, returns = "Snapshot",
      yields = true },
  ["snap:refresh"] = { summary = "re-reads its fields from the API", returns = "Snapshot", yields = true },
  ["snap:wait_available"] = { summary = "waits until the snapshot is available", args = { OPTS }, options = {
    timeout = { type = "seconds", kind = "deadline", default = 300,
      doc = "the longest the wait takes; then `timeout`" },
    interval = { type = "number", doc = "the first look's delay in seconds after the capture was requested" },
  }, returns = "Snapshot", yields = true },
  ["snap:delete"] = { summary = "deletes it (idempotent)", yields = true },
  ["sb:snapshot"] = { summary = "captures the sandbox as a snapshot and waits until it is available",
    args = { OPTS }, options = {
      kind = { type = "string", enum = { "filesystem", "runtime" }, default = "filesystem",
        doc = "what is captured (always sent)" },
      name = { type = "string", doc = "the snapshot's name (a restore by name takes the newest available)" },
      expires_at = { type = { "number", "string" },
        doc = "when it expires: a unix time or an RFC 3339 string" },
      wait = { type = "boolean", default = true, doc = "false: return at once, status \"creating\"" },
      wait_timeout = { type = "seconds", kind = "deadline", default = 300,
        doc = "the longest the wait for `available` takes; then `timeout`" },
    }, returns = "Snapshot", yields = true },
}
M.SCHEMA["render.snapshots.wait_available"].options = M.SCHEMA["snap:wait_available"].options
schema.declare(M.SCHEMA)

groups.list = schema.wrap("render.groups.list", groups.list)
groups.default = schema.wrap("render.groups.default", groups.default)
groups.create = schema.wrap("render.groups.create", groups.create)
groups.delete = schema.wrap("render.groups.delete", groups.delete)
group_methods.delete = schema.wrap("group:delete", group_methods.delete)
snapshots.get = schema.wrap("render.snapshots.get", snapshots.get)
snapshots.list = schema.wrap("render.snapshots.list", snapshots.list)
snapshots.latest = schema.wrap("render.snapshots.latest", snapshots.latest)
snapshots.delete = schema.wrap("render.snapshots.delete", snapshots.delete)
snapshots.wait_available = schema.wrap("render.snapshots.wait_available", snapshots.wait_available)
snapshot_methods.refresh = schema.wrap("snap:refresh", snapshot_methods.refresh)
snapshot_methods.wait_available = schema.wrap("snap:wait_available", snapshot_methods.wait_available)
snapshot_methods.delete = schema.wrap("snap:delete", snapshot_methods.delete)
M.capture = schema.wrap("sb:snapshot", M.capture)

M.Snapshot = Snapshot
M.Group = Group
M.snapshots = snapshots
M.groups = groups
return M
