--- moonbox.render.dryrun — render.dry_run: what a recipe tells a dry run (`moonbox run --dry-run`)
-- about the simulated backend, and whether one is in force.
--
-- The dry run itself is moonbox.dryrun: moonbox local's service and routes on a simulated engine
-- (moonbox.local.engine.sim), reached over an in-memory transport, on a simulated clock. It lives
-- outside moonbox.render (the client may not depend on the backend, tests/lint/layers.py); this
-- module is only the registry it reads — the recipe's exec and download hooks, the simulated
-- durations, the simulated-time limit — and the flag it sets. Registering a hook outside a dry
-- run does nothing, so a recipe may register them unconditionally.
-- See docs/reference/render.md, "Dry runs", for what a dry run is and what it cannot tell.
--
-- The hooks are declared in moonbox.schema (M.SCHEMA below) like every public call. on_exec and
-- on_download check their own arguments (declared "any"), so that a mistake says what a hook
-- takes, not only the type expected; durations checks its options itself, raising the schema's
-- invalid_option with its own wording; limit is wrapped (invalid_argument for a non-number).
local schema = require "moonbox.schema"
local options = require "moonbox.options"

local M = {}

--- dryrun.DURATIONS: the simulated seconds each operation takes unless render.dry_run.durations
-- says otherwise — what moonbox local takes (measured on a 2-core machine: a create runs in 8-17
-- ms, a restore in 16-29 ms, an exec round trip 11-14 ms, a capture is seen available 19-51 ms
-- after it was asked, an upload 3-4 ms), so that the client's waits poll as often as they do
-- against moonbox local (spec/render_dryrun_spec.lua pins at most twice its requests):
-- create (a fresh sandbox until it runs), restore (a sandbox from a snapshot until it runs),
-- exec (a command no hook times, unless it is a plain `sleep N`), snapshot (a capture until
-- available), transfer (one upload or download).
M.DURATIONS = { create = 0.02, restore = 0.02, exec = 0.01, snapshot = 0.03, transfer = 0.004 }

--- dryrun.MAX_SIMULATED: the simulated seconds a dry run may last unless the recipe says
-- otherwise (render.dry_run.limit): one day. A recipe that polls for an output no hook gives
-- would otherwise loop forever on the simulated clock.
M.MAX_SIMULATED = 86400

local hooks = { exec = {}, download = {} }
local durations = {}
local state = { active = false, limit = nil }

local H = {}

--- render.dry_run.active() -> whether this run is a dry run (moonbox run --dry-run).
function H.active() return state.active end

local function add_hook(kind, fname, pattern, answer)
  if type(pattern) ~= "string" then
    error(string.format("render.dry_run.%s: the pattern must be a string (a Lua pattern), got %s", fname,
      type(pattern)), 3)
  end
  local t = type(answer)
  if t ~= "function" and t ~= (kind == "exec" and "table" or "string") then
    error("render.dry_run." .. fname .. ": the answer must be a function or a " ..
      (kind == "exec" and "table {code, stdout, stderr, seconds}" or "string") .. ", got " .. t, 3)
  end
  local list = hooks[kind]
  list[#list + 1] = { pattern = pattern, answer = answer }
end

--- render.dry_run.on_exec(pattern, answer): in a dry run, an exec (sb:exec, sb:spawn,
-- sb:run_sync) whose command matches the Lua pattern gets answer: a table {code = 0, stdout =
-- "", stderr = "", seconds = simulated duration}, or a function(command, sandbox_id) returning
-- one (or nil: the next hook, then the default, decides). command is the recipe's own command:
-- the string it gave, or its argv table's elements joined with single spaces (unquoted: {"ls",
-- "-l", "/"} is "ls -l /"), never what the client wraps it in. The newest matching hook is
-- asked first. Raises on a bad argument; does nothing outside a dry run. Does not yield.
function H.on_exec(pattern, answer) add_hook("exec", "on_exec", pattern, answer) end

--- render.dry_run.on_download(pattern, answer): in a dry run, a download of a file nothing wrote
-- whose path (absolute, as the backend resolves it) matches the pattern gives answer: a string,
-- or a function(path, sandbox_id) returning one (or nil: the next hook, then "not found",
-- decides). Raises on a bad argument; does nothing outside a dry run. Does not yield.
function H.on_download(pattern, answer) add_hook("download", "on_download", pattern, answer) end

--- render.dry_run.durations{create =, restore =, exec =, snapshot =, transfer =} -> the
-- simulated seconds in force (those given replace the defaults, dryrun.DURATIONS). Raises
-- invalid_option, before it replaces any, on an unknown name (with the nearest as suggestion) or a
-- value that is not seconds >= 0. Does not yield.
function H.durations(t)
  local call = "render.dry_run.durations"
  if t ~= nil then
    if type(t) ~= "table" then schema.check(call, t) end -- raises invalid_argument
    local keys = {}
    for k in pairs(t) do keys[#keys + 1] = k end
    table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
    for _, k in ipairs(keys) do
      local v = t[k]
      if M.DURATIONS[k] == nil then
        local near = type(k) == "string" and options.nearest(k, M.DURATIONS) or nil
        schema.invalid(call, { option = k, suggestion = near,
          message = "unknown operation '" .. tostring(k) .. "' " ..
            (near and "(did you mean `" .. near .. "`?)" or "(create, restore, exec, snapshot, transfer)") })
      end
      if type(v) ~= "number" or v ~= v or v < 0 or v == math.huge then
        schema.invalid(call, { option = k, expected = "number", got = type(v),
          message = "option `" .. k .. "` must be seconds >= 0, got " ..
            (type(v) == "string" and string.format("%q", v) or tostring(v)) })
      end
    end
    for k, v in pairs(t) do durations[k] = v end
  end
  local out = {}
  for k, v in pairs(M.DURATIONS) do out[k] = durations[k] or v end
  return out
end

--- render.dry_run.limit(seconds): the simulated seconds this dry run may last before it stops
-- with simulated_time_limit (default dryrun.MAX_SIMULATED, a day). Raises on a value that is
-- not seconds > 0 (invalid_argument when it is not a number); does nothing outside a dry run. Does not yield.
function H.limit(seconds)
  if type(seconds) ~= "number" or seconds ~= seconds or seconds <= 0 then
    error("render.dry_run.limit: expected seconds > 0, got " .. tostring(seconds), 2)
  end
  if state.active then state.limit = seconds end
end

local DURATION_DOC = {
  create = "a fresh sandbox, until it runs",
  restore = "a create from a snapshot, until it runs",
  exec = "a command no hook times (a command that is only `sleep N` takes N)",
  snapshot = "a capture, until it is available",
  transfer = "one upload or download",
}

local function duration_options()
  local out = {}
  for k, v in pairs(M.DURATIONS) do
    out[k] = { type = "number", default = v, doc = "the simulated seconds of " .. DURATION_DOC[k] }
  end
  return out
end

M.SCHEMA = {
  ["render.dry_run.active"] = { summary = "whether this run is a dry run (moonbox run --dry-run)",
    returns = "boolean" },
  ["render.dry_run.on_exec"] = {
    summary = "in a dry run, an exec whose command matches the Lua pattern gets answer " ..
      "({code, stdout, stderr, seconds}, or a function(command, sandbox_id) returning one or nil)",
    -- "any": the call names what a hook takes (a Lua pattern; a table or function) itself
    args = { { name = "pattern", type = "any" }, { name = "answer", type = "any" } } },
  ["render.dry_run.on_download"] = {
    summary = "in a dry run, a download of a path nothing wrote that matches the Lua pattern gets answer " ..
      "(the bytes, or a function(path, sandbox_id) returning them or nil)",
    args = { { name = "pattern", type = "any" }, { name = "answer", type = "any" } } },
  ["render.dry_run.durations"] = {
    summary = "replaces those simulated seconds for the run; returns the durations in force",
    args = { { name = "opts", type = "table", optional = true } }, options = duration_options(),
    returns = "table<string, number>" },
  ["render.dry_run.limit"] = {
    summary = "the simulated seconds this dry run may last before it stops with simulated_time_limit",
    args = { { name = "seconds", type = "number" } } },
}
schema.declare(M.SCHEMA)

-- on_exec, on_download and durations check their own arguments (above); active takes none, so
-- wrap returns it as it is; limit's type is checked by the wrap, its range by limit.
H.active = schema.wrap("render.dry_run.active", H.active)
H.limit = schema.wrap("render.dry_run.limit", H.limit)

M.hooks = H

-- ---- what the dry run reads (moonbox.dryrun) ------------------------------------------------

--- dryrun.duration(kind) -> the simulated seconds of kind in force. Does not yield.
function M.duration(kind) return durations[kind] or M.DURATIONS[kind] end

--- dryrun.limit_seconds() -> the simulated-time limit in force. Does not yield.
function M.limit_seconds() return state.limit or M.MAX_SIMULATED end

local function hook_answer(kind, subject, sandbox_id)
  local list = hooks[kind]
  for i = #list, 1, -1 do
    local h = list[i]
    if subject:find(h.pattern) then
      local r = h.answer
      if type(r) == "function" then r = r(subject, sandbox_id) end
      if r ~= nil then return r, h end
    end
  end
  return nil
end

--- dryrun.exec_answer(command, sandbox_id) -> {code, stdout, stderr, seconds} | nil: what the
-- hooks say the recipe's command (see on_exec) gives, nil when none does. Raises naming the
-- hook when one answers something else than a table. [yields] when a hook does.
function M.exec_answer(command, sandbox_id)
  local r, h = hook_answer("exec", command, sandbox_id)
  if r == nil then return nil end
  if type(r) ~= "table" then
    error("render.dry_run.on_exec hook for '" .. h.pattern .. "' returned a " .. type(r) ..
      ", not a table {code, stdout, stderr, seconds}", 0)
  end
  return { code = math.tointeger(r.code) or r.code or 0, stdout = tostring(r.stdout or ""),
    stderr = tostring(r.stderr or ""), seconds = tonumber(r.seconds) or M.duration("exec") }
end

--- dryrun.download_answer(path, sandbox_id) -> the bytes the hooks give a download of path, or
-- nil. [yields] when a hook does.
function M.download_answer(path, sandbox_id)
  local r = hook_answer("download", path, sandbox_id)
  if r == nil then return nil end
  return tostring(r)
end

--- dryrun.set_active(on): a dry run starts (true) or ends (false: the hooks, durations and limit
-- are cleared). For moonbox.dryrun. Does not yield.
function M.set_active(on)
  state.active = on == true
  if not on then
    hooks.exec, hooks.download = {}, {}
    durations = {}
    state.limit = nil
  end
end

return M
