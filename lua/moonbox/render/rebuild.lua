--- moonbox.render.rebuild — render.snapshots.rebuild: a named snapshot rebuilt, verified and
-- rolled forward, or left exactly as it was.
--
--   local snap, info = render.snapshots.rebuild("py-base", function(sb)
--     sb:exec("pip install -r /srv/requirements.txt"):check()
--   end, { keep = 3, verify = "python3 -c 'import requests'", timeout = "20m" })
--
-- Stages, in order: a fresh builder sandbox (from opts.base or empty), build_fn(builder), a
-- capture under the name (waited until available), a verifier restored from the new snapshot
-- running opts.verify, then the pruning of older snapshots of that name beyond opts.keep. The
-- builder and the verifier are terminated whatever happens (a moonbox.guard owns them from the
-- moment their create answers). Until the verify passes, the new snapshot is the rebuild's to
-- undo: any failure deletes it, so the previous snapshot stays the newest available one. The
-- only window where a restore by name can pick an unverified snapshot is between its capture
-- and the end of its verify (Render cannot rename a snapshot, so there is no staging name).
local sandbox = require "moonbox.render.sandbox"
local api = require "moonbox.render.api"
local snapshots = require("moonbox.render.snapshots").snapshots
local duration = require "moonbox.duration"
local task = require "moonbox.task"
local guard = require "moonbox.guard"
local core = require "moonbox.core"
local schema = require "moonbox.schema"

local M = {}

local CREATE = sandbox.CREATE_OPTIONS
-- render.snapshots.rebuild's options (docs/reference/render.md, "Names": `timeout` and
-- `capture_timeout` are deadlines, `lifetime` each sandbox's server-side lifetime).
local OPTIONS = {
  kind = { type = "string", enum = { "filesystem", "runtime" }, default = "filesystem",
    doc = "the new snapshot's kind" },
  keep = { type = "integer", default = 3,
    doc = "how many available snapshots of the name remain, the new one included" },
  verify = { type = { "string", "table", "function" },
    doc = "a command that must exit 0, or function(verifier, snap) that must not raise nor return false" },
  timeout = { type = "seconds", kind = "deadline",
    doc = "the longest the whole rebuild takes (task.timeout)" },
  capture_timeout = { type = "seconds", kind = "deadline", default = 3600,
    doc = "the longest the wait for the capture to be available takes" },
  lifetime = { type = "seconds", kind = "lifetime", removed = { "timeout_seconds" },
    doc = "each sandbox's server-side lifetime; default the rebuild's timeout plus 5 minutes, " ..
      "when there is one" },
  base = { type = { "string", "Snapshot" },
    doc = "the snapshot the builder starts from (a Snapshot, an id or a name); none: empty" },
  group = CREATE.group,
  plan = CREATE.plan, region = CREATE.region, network = CREATE.network, allow = CREATE.allow,
  env = { type = "table", doc = "environment variables of the builder (not the verifier)" },
  expires_at = { type = { "number", "string" },
    doc = "when the new snapshot expires: a unix time or an RFC 3339 string" },
}

-- How long a failed rebuild's cleanup waits for a capture still in progress to end before it
-- gives up deleting that snapshot (a snapshot being captured cannot be deleted).
local CAPTURE_END_WAIT = 600

--- Seconds from a number or a duration string ("90s", "20m", "1h30m": moonbox.duration's
-- syntax); nil when v is nil. Raises (misuse, at the caller of rebuild) for anything else.
local function seconds(v, what)
  if v == nil then return nil end
  local secs = duration.parse(v)
  if secs and secs > 0 then return secs end
  error("render.snapshots.rebuild: " .. what .. " must be seconds (> 0) or a duration like \"20m\", got " ..
    tostring(v), 3)
end

--- The text of an error for messages: a moonbox error without its "file:line: " prefix.
local function describe(err)
  if type(err) == "table" and err.op == "snapshots.rebuild" then return tostring(err.message) end
  return api.error_text(err)
end

local function stage_begin(st, name)
  st.stage, st.stage_started = name, task.now()
end

local function stage_end(st)
  st.summary.durations[st.stage] = task.now() - st.stage_started
end

--- Deletes the snapshot a failed rebuild made. A snapshot still being captured cannot be
-- deleted, so this waits (bounded) for its capture to end first. When the capture request's
-- answer was lost, the snapshot is found by its source sandbox (the builder, which only this
-- rebuild used). [yields]
local function delete_new_snapshot(st)
  local snap = st.snap
  if not snap then
    if not st.capture_sent then return end
    for s in snapshots.list { group = st.group_id } do
      if s.source_sandbox_id == st.summary.builder_id and s.name == st.name then snap = s end
    end
    if not snap then
      st.cleanup_note = "the capture's answer was lost and no snapshot of builder " ..
        tostring(st.summary.builder_id) .. " was found"
      return
    end
    st.snap = snap
    st.summary.snapshot_id = snap.id
  end
  local deadline = task.now() + CAPTURE_END_WAIT
  while true do
    local ok, err = pcall(snap.delete, snap)
    if ok then break end
    if not (type(err) == "table" and err.code == "snapshot_creating") or task.now() >= deadline then
      st.cleanup_note = "new snapshot " .. snap.id .. " could not be deleted: " .. describe(err)
      error(err, 0)
    end
    task.sleep(0.5)
  end
  st.deleted_new = true
end

--- Creates a sandbox without waiting, hands it to the guard at once, then waits until it
-- runs: a cancellation or a timeout while it boots still terminates it. [yields]
local function guarded_sandbox(g, create_opts, role)
  create_opts.wait = false
  local sb = sandbox.create(create_opts):keep()
  g:defer(function()
    if sb.status ~= "terminated" then sb:terminate() end
  end, "terminate " .. role .. " " .. sb.id)
  return sb
end

--- Whether err must keep unwinding whatever catches it: a cancellation or a deadline.
local function must_unwind(err)
  return task.is_cancelled(err) or (type(err) == "table" and err.code == "deadline")
end

--- Terminates a sandbox the guard also owns, as early as its work is done. A failure is left
-- to the guard, which tries again when it closes; a cancellation or a deadline is raised.
local function terminate_early(sb)
  local ok, err = pcall(sb.terminate, sb)
  if not ok and must_unwind(err) then error(err, 0) end
end

--- Runs opts.verify in the verifier. A command must exit 0; a function must not raise nor
-- return false. [yields]
local function run_verify(verify, sb, snap)
  if verify == nil then return end
  if type(verify) == "function" then
    if verify(sb, snap) == false then
      error(core.Error.new { op = "snapshots.rebuild", code = "verify_failed", sandbox_id = sb.id,
        message = "the verify function returned false" }, 0)
    end
    return
  end
  local r = sb:exec(verify)
  if r.code ~= 0 then
    local tail = r.stderr ~= "" and r.stderr or r.stdout
    tail = tail:sub(-300):gsub("%s+$", "")
    error(core.Error.new { op = "snapshots.rebuild", code = "verify_failed", sandbox_id = sb.id,
      exec_id = r.exec_id, exit_code = r.code,
      message = string.format("exit %s from `%s`%s", tostring(r.code), r.command_summary,
        tail ~= "" and ("; output: " .. tail) or "") }, 0)
  end
end

--- Records a pruning failure (id nil: the listing failed) in summary.prune_errors and on
-- stderr. Cancellations and deadlines are raised instead: they must unwind.
local function prune_failed(st, id, err)
  if must_unwind(err) then error(err, 0) end
  local summary = st.summary
  summary.prune_errors[#summary.prune_errors + 1] = { id = id, error = err }
  io.stderr:write("moonbox: rebuild of '", st.name, "': could not ",
    id and ("delete old snapshot " .. id) or "list the old snapshots", ": ", describe(err), "\n")
end

--- Deletes the snapshots named st.name in the new snapshot's group beyond the `keep` newest
-- available ones (newest by requested time, ties in the list's newest-first order), and the
-- failed ones of that name. The new snapshot is never deleted. A listing or a delete that
-- fails is recorded, not raised: the rebuild itself succeeded, and the next rebuild prunes what
-- this one could not. [yields]
local function prune(st, keep)
  local snap, summary = st.snap, st.summary
  local available, failed = {}, {}
  local ok, err = pcall(function()
    for s in snapshots.list { group = snap.sandbox_group_id, status = { "available", "failed" } } do
      if s.name == st.name then
        if s.status == "available" then
          available[#available + 1] = { s = s, i = #available, at = s.requested_at or s.created_at or "" }
        else
          failed[#failed + 1] = s
        end
      end
    end
  end)
  if not ok then return prune_failed(st, nil, err) end
  table.sort(available, function(a, b)
    if a.at ~= b.at then return a.at > b.at end
    return a.i < b.i
  end)
  local doomed = {}
  summary.kept = { snap.id }
  for _, e in ipairs(available) do
    if e.s.id ~= snap.id then
      if #summary.kept < keep then
        summary.kept[#summary.kept + 1] = e.s.id
      else
        doomed[#doomed + 1] = e.s
      end
    end
  end
  for _, s in ipairs(failed) do doomed[#doomed + 1] = s end
  for _, s in ipairs(doomed) do
    local dok, derr = pcall(s.delete, s)
    if dok then
      summary.deleted[#summary.deleted + 1] = s.id
    else
      prune_failed(st, s.id, derr)
    end
  end
end

--- One rebuild attempt: every stage, under a guard that terminates the sandboxes and, on
-- failure, deletes the new snapshot. [yields]
local function attempt(st, build_fn, opts)
  local summary = st.summary
  local g <close> = guard.new("rebuild of '" .. st.name .. "'")
  g:defer(function(err) st.cause = err end, "record the outcome")

  stage_begin(st, "builder")
  local builder = guarded_sandbox(g, {
    snapshot = opts.base, plan = opts.plan, network = opts.network, allow = opts.allow,
    region = opts.region, env = opts.env, lifetime = st.sandbox_lifetime,
    group = st.group_id }, "builder")
  summary.builder_id = builder.id
  builder:wait_running()
  st.group_id = builder.sandbox_group_id
  local previous = snapshots.latest(st.name, { group = st.group_id })
  summary.previous_id = previous and previous.id
  st.previous_known = true
  stage_end(st)

  stage_begin(st, "build")
  build_fn(builder, { name = st.name, previous = previous })
  stage_end(st)

  stage_begin(st, "capture")
  g:defer(function(err)
    if err ~= nil and not st.verified then delete_new_snapshot(st) end
  end, "delete the new snapshot")
  st.capture_sent = true
  local snap = builder:snapshot { kind = opts.kind, name = st.name, expires_at = opts.expires_at,
    wait = false }
  st.snap, summary.snapshot_id = snap, snap.id
  snap:wait_available { timeout = st.capture_timeout }
  -- The builder's work is in the snapshot now: free it before the verifier starts.
  terminate_early(builder)
  stage_end(st)

  stage_begin(st, "verify")
  local verifier = guarded_sandbox(g, {
    snapshot = snap, network = opts.network, allow = opts.allow, region = opts.region,
    lifetime = st.sandbox_lifetime }, "verifier")
  summary.verifier_id = verifier.id
  verifier:wait_running()
  run_verify(opts.verify, verifier, snap)
  st.verified = true
  terminate_early(verifier)
  stage_end(st)

  stage_begin(st, "prune")
  prune(st, st.keep)
  stage_end(st)
  stage_begin(st, "cleanup")
end

--- The error of a failed rebuild: one line naming the stage, the cause, and every id involved.
-- Returns the error value (it raises nothing itself, and does not yield).
local function rebuild_error(st, err, timed_out, seconds_limit)
  local summary = st.summary
  local what
  if timed_out then
    what = string.format("timed out after %g s during %s", seconds_limit, st.stage)
  else
    what = st.stage .. " failed: " .. describe(err)
  end
  local ids = {}
  if summary.builder_id then ids[#ids + 1] = "builder " .. summary.builder_id end
  if summary.verifier_id then ids[#ids + 1] = "verifier " .. summary.verifier_id end
  local fate
  if st.verified then
    fate = "new snapshot " .. st.snap.id .. " is verified and kept"
  elseif st.deleted_new then
    fate = "new snapshot " .. st.snap.id .. " deleted"
  elseif st.cleanup_note then
    fate = st.cleanup_note
  elseif st.snap then
    fate = "new snapshot " .. st.snap.id .. " was not deleted"
  end
  if not st.verified then
    local prev = summary.previous_id and ("the newest available is still " .. summary.previous_id)
      or (st.previous_known and "there is no previous snapshot of that name")
    if prev then fate = fate and (fate .. "; " .. prev) or prev end
  end
  local detail = {}
  if #ids > 0 then detail[#detail + 1] = table.concat(ids, ", ") end
  if fate then detail[#detail + 1] = fate end
  local cause = st.cause or err
  local cleanup = type(cause) == "table" and rawget(cause, "cleanup_errors") or nil
  if cleanup and #cleanup > 0 then detail[#detail + 1] = "cleanup failed: " .. guard.describe(cleanup) end
  return core.Error.new {
    op = "snapshots.rebuild", code = timed_out and "timeout" or "rebuild_failed", stage = st.stage,
    name = st.name, cause = err, cleanup_errors = cleanup, retryable = timed_out or nil,
    sandbox_id = (st.stage == "verify" and summary.verifier_id) or summary.builder_id,
    snapshot_id = summary.snapshot_id, builder_id = summary.builder_id, verifier_id = summary.verifier_id,
    previous_id = summary.previous_id, exit_code = type(err) == "table" and err.exit_code or nil,
    exec_id = type(err) == "table" and err.exec_id or nil,
    summary = summary,
    message = string.format("rebuild of '%s': %s%s", st.name, what,
      #detail > 0 and (" (" .. table.concat(detail, "; ") .. ")") or ""),
  }
end

--- render.snapshots.rebuild(name, build_fn, opts) -> Snapshot, summary. Rebuilds the snapshot
-- named `name`: creates a builder sandbox (from opts.base — a Snapshot, an id or a name — or
-- empty), calls build_fn(builder, {name, previous}) (previous: the newest available snapshot of
-- that name before this rebuild, or nil), captures the builder as `name` and waits until it is
-- available, restores it into a verifier sandbox and runs opts.verify there, then deletes the
-- older snapshots of that name beyond opts.keep. opts:
--   kind "filesystem" (default) | "runtime"; keep (default 3, >= 1);
--   verify: a command (bash string or argv table) that must exit 0, or function(verifier, snap)
--     that must not raise nor return false; nil: the restore reaching "running" is the check;
--   timeout: seconds or "20m", bounding the whole rebuild (task.timeout);
--   plan, region, network, allow, lifetime (each sandbox's own lifetime; default the
--     rebuild timeout plus 5 minutes, when there is one), env (builder only), group (a Group or
--     an id; default the base snapshot's, else the default group), expires_at (the snapshot's),
--     capture_timeout (seconds to wait for availability, default 3600).
-- summary: {name, snapshot_id, previous_id, builder_id, verifier_id, kept = {ids, newest
-- first}, deleted = {ids}, prune_errors = {{id, error}}, durations = {builder, build, capture,
-- verify, prune, total} (seconds)}.
-- Both sandboxes are terminated whatever happens. On failure the new snapshot (if any) is
-- deleted, so the previous one stays the newest available, and an error is raised with code
-- "rebuild_failed" ("timeout" when opts.timeout expired), `stage` ("builder", "build",
-- "capture", "verify", "prune" or "cleanup"), `cause` (the original error), snapshot_id,
-- builder_id, verifier_id, previous_id, summary, and a message such as "rebuild of 'base':
-- verify failed: exit 1 from `test -x /opt/app` (builder sbx-…, verifier sbx-…; new snapshot
-- snp-… deleted; the newest available is still snp-…)". A cancellation, or the deadline of an
-- enclosing task.timeout, is re-raised unchanged once the cleanup has run. Pruning failures
-- do not fail the rebuild (see summary.prune_errors). [yields]
function M.rebuild(name, build_fn, opts)
  opts = opts or {}
  if name == "" then
    error("render.snapshots.rebuild: name (a non-empty string) is required", 2)
  end
  local keep = opts.keep or 3
  if math.type(keep) ~= "integer" or keep < 1 then
    error("render.snapshots.rebuild: keep must be an integer >= 1, got " .. tostring(keep), 2)
  end
  local limit = seconds(opts.timeout, "timeout")
  local group = opts.group
  if type(group) == "table" then group = group.id end

  local summary = { name = name, deleted = {}, prune_errors = {}, kept = {}, durations = {} }
  local st = { name = name, keep = keep, summary = summary, group_id = group,
    capture_timeout = seconds(opts.capture_timeout, "capture_timeout") or 3600,
    sandbox_lifetime = schema.seconds(opts.lifetime) or (limit and math.ceil(limit) + 300) }
  local started = task.now()
  local ok, err
  if limit then
    ok, err = pcall(task.timeout, limit, attempt, st, build_fn, opts)
  else
    ok, err = pcall(attempt, st, build_fn, opts)
  end
  summary.durations.total = task.now() - started
  if ok then return st.snap, summary end
  if must_unwind(err) then error(err, 0) end
  local timed_out = limit ~= nil and task.is_timeout(err) and not rawequal(err, st.cause)
  error(rebuild_error(st, err, timed_out, limit), 0)
end

M.SCHEMA = {
  ["render.snapshots.rebuild"] = {
    summary = "rebuilds, captures, verifies and rolls forward the snapshot of that name",
    args = { { name = "name", type = "string" }, { name = "build_fn", type = "function" },
      { name = "opts", type = "table", optional = true } },
    options = OPTIONS, returns = "Snapshot, table", yields = true },
}
schema.declare(M.SCHEMA)
M.rebuild = schema.wrap("render.snapshots.rebuild", M.rebuild)

return M
