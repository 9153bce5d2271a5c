--- moonbox.reap — `moonbox ps` and `moonbox reap`: what runs hold, and finishing the cleanup of
-- runs that died (docs/reference/ledger.md).
--
-- A run is dead when it recorded an end, or when its owner is gone: on SQLite its process (pid
-- and process start time no longer match), on a PostgreSQL ledger shared by several machines
-- its lease (the owner stopped renewing it: moonbox.ledger), so reap on any machine acts on
-- every machine's dead runs and never on one whose owner still renews it.
--
-- reap goes through every dead run that still holds something, each over its own connection
-- to the run's backend — an embedded backend is brought up again on the state
-- dir the ledger recorded — and settles each intent with the backend's word: a sandbox it
-- terminates (or the backend no longer knows) is released; a create whose answer was lost is
-- found by the label in its name and terminated, or, when no sandbox carries the label, settled
-- as never made. A run whose backend cannot be reached, or a terminate that still fails after
-- the retries, is reported and left in the ledger for the next reap; the other runs go on.
-- Nothing without a ledger entry is ever touched. `moonbox reap --forget RUN` drops a run's
-- entries without asking the backend, for what a person knows is gone.
local ledger_mod = require "moonbox.ledger"
local conn_mod = require "moonbox.render.conn"
local api = require "moonbox.render.api"
local embedded = require "moonbox.render.embedded"
local sandbox = require "moonbox.render.sandbox"
local core = require "moonbox.core"

local M = {}

local function describe_backend(r)
  if r.local_state then return "embedded backend (state in " .. r.local_state .. ")" end
  return r.backend
end

local describe_error = api.error_text

--- Every sandbox the backend lists as not terminated: by id and by name. [yields]
local function listing(c)
  local by_id, by_name, cursor = {}, {}, nil
  repeat
    local page = api.call(c, "sandboxes.list", "GET", "/sandboxes",
      { query = { ownerId = c.workspace, cursor = cursor, limit = 100 } })
    for _, e in ipairs(page) do
      local sb = e.sandbox
      if sb and sb.id then
        by_id[sb.id] = sb
        if type(sb.name) == "string" then by_name[sb.name] = sb end
      end
    end
    cursor = page[#page] and page[#page].cursor
  until #page < 100
  return { by_id = by_id, by_name = by_name }
end

--- A connection to run r's backend: the embedded one on the recorded state dir (joined or
-- started; close it after), else the recorded URL. [yields]
local function connect_run(r)
  if r.local_state then
    return conn_mod.connect { backend = "local", state_dir = r.local_state, workspace = r.workspace }
  end
  return conn_mod.connect { backend = r.backend, workspace = r.workspace }
end

--- A read-only look at run r's backend for `moonbox ps`: the listing, or nil and why not. An
-- embedded backend is looked at only when it is already serving (ps never starts one). [yields]
local function look(r)
  local far = ledger_mod.elsewhere(r)
  if far then return nil, "its embedded backend ran on " .. far .. "; `moonbox ps` there can check it" end
  local opts = { backend = r.backend, workspace = r.workspace }
  if r.local_state then
    local url, key = embedded.advertised(r.local_state)
    if not url then
      return nil, "its embedded backend is not running; `moonbox reap` brings it up"
    end
    opts.backend, opts.api_key = url, key
  end
  local ok, c = pcall(conn_mod.connect, opts)
  if not ok then return nil, describe_error(c) end
  local lok, l = pcall(listing, c)
  if lok then return l end
  if r.local_state then return nil, "its embedded backend is not running; `moonbox reap` brings it up" end
  return nil, "its backend did not answer: " .. describe_error(l)
end

local function held_line(i)
  if i.sandbox_id then return i.sandbox_id .. " (intent " .. i.id .. ")" end
  return "unknown create " .. i.label .. " (answer lost; intent " .. i.id .. ")"
end

--- reap.resumable(r) -> whether run row r (with `alive`) is a durable run that died before it
-- ended: what it holds waits for `moonbox run --resume` (moonbox.durable), not for reap. Does not
-- yield.
local function resumable(r)
  return (r.durable or 0) ~= 0 and r.ended_at == nil and not r.alive
end
M.resumable = resumable

-- The schedule record of ledger run r when r is a durable schedule's run ({id, schedule}): the
-- schedule's daemons resume it, not `moonbox run --resume`. [yields] on PostgreSQL.
local function schedule_record(L, r)
  if (r.durable or 0) == 0 then return nil end
  return L.db:row("SELECT id, schedule FROM schedule_runs WHERE ledger_run = ? ORDER BY id LIMIT 1", r.id)
end

local function resumable_text(L, r)
  local sr = schedule_record(L, r)
  if sr then
    return string.format("dead, resumable (by a daemon of schedule '%s': record %d)", sr.schedule, sr.id), sr
  end
  return "dead, resumable (moonbox run --resume)"
end

--- reap.ps(out) -> number of sandboxes held: prints every run that is alive or holds
-- something, each held sandbox with what its backend says of it — a dead run's backend is
-- asked when it can be reached (a lost create shows the sandbox its label names, if any); an
-- alive run's is not (its creates may be in flight). [yields]
function M.ps(out)
  local L = ledger_mod.open()
  local n = 0
  for _, r in ipairs(L:runs()) do
    if #r.held > 0 or r.alive then
      local who = L.shared and r.owner and ("on " .. r.owner) or ("pid " .. r.pid)
      out(string.format("run %d  %s  %s  %s  %s%s", r.id, who,
        r.alive and "alive" or resumable(r) and resumable_text(L, r) or "dead",
        r.recipe or "?", describe_backend(r),
        (r.resumes or 0) > 0 and string.format("  (durable, resumed %d time(s))", r.resumes)
          or (r.durable or 0) ~= 0 and "  (durable)" or ""))
      local l, why
      if not r.alive and #r.held > 0 then l, why = look(r) end
      if why then out("  (not checked: " .. why .. ")") end
      for _, i in ipairs(r.held) do
        local state = ""
        if l then
          local sb = i.sandbox_id and l.by_id[i.sandbox_id] or (not i.sandbox_id and l.by_name[i.label])
          if not sb then
            state = i.sandbox_id and "  gone (not listed by its backend; reap releases it)"
              or "  no sandbox carries its label (reap settles it as never made)"
          elseif i.sandbox_id then
            state = "  " .. tostring(sb.status)
          else
            state = "  is " .. sb.id .. " " .. tostring(sb.status)
          end
        end
        out("  holds " .. held_line(i) .. state)
        n = n + 1
      end
    end
  end
  L:close()
  return n
end

-- Terminates id on c: "terminated", or "gone" when the backend does not know it. [yields]
local function terminate(c, id) return sandbox.terminate_request(c, id) end

local function new_result()
  return { terminated = 0, gone = 0, never_made = 0, failed = 0, would = 0, runs = 0, failed_runs = 0 }
end
M.new_result = new_result

-- Failures that say the backend itself cannot be reached (after the retries): the run's other
-- entries would meet them too.
local UNREACHABLE = { connect_failed = true, dns_failed = true, tls_failed = true }

--- Settles what run r holds over connection c; counts go into tally. Each held sandbox is
-- terminated (or found gone) and settled in ledger L; one recorded only by its label is looked
-- up by label (listing) and settled as never made when no sandbox carries it. With
-- opts.dry_run nothing is changed and tally.would counts what would be. out(line) tells each
-- step. A failed step is counted and told, and the rest go on; a backend that cannot be
-- reached stops the run's settling (what is left waits for the next reap). Raises only an
-- interruption (cancellation, deadline). [yields]
local function settle(L, r, c, opts, out, tally)
  local l
  for n, i in ipairs(r.held) do
    local id = i.sandbox_id
    local step_ok, step_err = pcall(function()
      if not id then
        l = l or listing(c)
        local sb = l.by_name[i.label]
        if not sb then
          if opts.dry_run then
            tally.would = tally.would + 1
            out(string.format("run %d: would settle %s as never made (no sandbox carries its label)", r.id,
              held_line(i)))
          else
            L:settle(i.id, "never_made")
            tally.never_made = tally.never_made + 1
            out(string.format("run %d: %s: no sandbox carries its label; settled as never made", r.id,
              held_line(i)))
          end
          return
        end
        id = sb.id
      end
      if opts.dry_run then
        tally.would = tally.would + 1
        out(string.format("run %d: would terminate %s", r.id, id))
        return
      end
      local how = terminate(c, id)
      L:settle(i.id, how == "gone" and "gone" or "reaped", id)
      if how == "gone" then
        tally.gone = tally.gone + 1
        out(string.format("run %d: %s was already gone", r.id, id))
      else
        tally.terminated = tally.terminated + 1
        out(string.format("run %d: terminated %s", r.id, id))
      end
    end)
    if not step_ok then
      if api.is_interruption(step_err) then error(step_err, 0) end
      if type(step_err) == "table" and UNREACHABLE[step_err.code] then
        local left = #r.held - n + 1
        tally.failed = tally.failed + left
        out(string.format("run %d: cannot reach its %s: %s (%d left for the next reap)", r.id,
          describe_backend(r), describe_error(step_err), left))
        return
      end
      tally.failed = tally.failed + 1
      out(string.format("run %d: could not settle %s: %s (left for the next reap)", r.id,
        id or held_line(i), describe_error(step_err)))
    end
  end
end

--- reap.reap_run(L, r, opts, out [, result]) -> result: settles what run r (from L:runs() or
-- L:run(id)) holds, over its own connection to the run's backend (the default connection of
-- moonbox.render is left alone, so a long-lived process can reap its own dead runs). Counts go
-- into result {terminated, gone, never_made, failed, would, runs, failed_runs}; nothing raises
-- but an interruption of the calling task. opts.dry_run: only say what it would do. [yields]
function M.reap_run(L, r, opts, out, result)
  result = result or new_result()
  for k, v in pairs(new_result()) do
    if result[k] == nil then result[k] = v end
  end
  if #r.held == 0 then return result end
  result.runs = result.runs + 1
  local tally = new_result()
  local far = ledger_mod.elsewhere(r)
  local ok, c
  if far then
    -- An embedded backend on another machine: starting one here would find none of its
    -- sandboxes and release what still runs there.
    ok, c = false, string.format("its embedded backend ran on %s: run `moonbox reap` there", far)
  else
    ok, c = pcall(connect_run, r)
  end
  if not ok then
    if api.is_interruption(c) then error(c, 0) end
    tally.failed = #r.held
    out(string.format("run %d: cannot reach its %s: %s (%d left for the next reap)", r.id,
      describe_backend(r), describe_error(c), #r.held))
  else
    local sok, serr = pcall(settle, L, r, c, opts or {}, out, tally)
    local cok, cerr = pcall(c.close, c)
    if not sok then error(serr, 0) end
    if not cok and api.is_interruption(cerr) then error(cerr, 0) end
  end
  for k, v in pairs(tally) do result[k] = result[k] + v end
  if tally.failed > 0 then result.failed_runs = result.failed_runs + 1 end
  if not (opts and opts.dry_run) then
    out(string.format("run %d (%s): %d terminated, %d already gone, %d never made, %d failed", r.id,
      r.recipe or "?", tally.terminated, tally.gone, tally.never_made, tally.failed))
  end
  return result
end

--- reap.settle_unknown(L, run_id, c, out): at the end of a run, settles its creates whose
-- answer never came: a sandbox carrying the label is terminated (the recipe never had it), no
-- sandbox means it was never made. Failures are reported and left for `moonbox reap`. [yields]
function M.settle_unknown(L, run_id, c, out)
  local unknown = L:unknown(run_id)
  if #unknown == 0 then return end
  local r = { id = run_id, held = unknown }
  local tally = new_result()
  local ok, err = pcall(settle, L, r, c, {}, out, tally)
  if not ok then error(err, 0) end
end


--- reap.reap(opts, out) -> result: for every dead run, settles what it holds (see reap_run),
-- except a durable run that died before it ended, which is left for its resume and counted in
-- result.resumable. opts.dry_run: only say what it would do. [yields]
function M.reap(opts, out)
  local L = ledger_mod.open()
  local result = new_result()
  result.resumable = 0
  local ok, err = pcall(function()
    for _, r in ipairs(L:runs()) do
      if resumable(r) and #r.held > 0 then
        result.resumable = result.resumable + 1
        local sr = schedule_record(L, r)
        out(string.format("run %d: durable, died before it ended: its %d sandbox(es) wait for %s " ..
          "(`moonbox reap --abandon %d` gives them up)", r.id, #r.held, sr
            and string.format("a daemon of schedule '%s' to resume it (record %d)", sr.schedule, sr.id)
            or string.format("`moonbox run --resume %d`", r.id), r.id))
      elseif not r.alive and #r.held > 0 then
        M.reap_run(L, r, opts, out, result)
      end
    end
  end)
  L:close()
  if not ok then error(err, 0) end
  return result
end

--- reap.abandon(run_id, opts, out) -> result: gives up a durable run that died (it is ended
-- "abandoned", so it can no longer be resumed) and settles what it holds as reap does.
-- opts.dry_run: only say what it would do. Refuses a run that is not resumable. [yields]
function M.abandon(run_id, opts, out)
  local L = ledger_mod.open()
  local result = new_result()
  local ok, err = pcall(function()
    local r = L:run(run_id)
    if not r then error("moonbox reap: no run " .. run_id .. " in the ledger", 0) end
    if not resumable(r) then
      error(string.format("moonbox reap: run %d is not a durable run that died (%s): --abandon is for those",
        run_id, r.alive and "it is alive" or r.ended_at and ("it ended " .. tostring(r.outcome))
          or "it is not durable"), 0)
    end
    if not opts.dry_run then
      L:end_run("abandoned", run_id)
      r.ended_at = core.time()
    end
    out(string.format("run %d: %s", run_id, opts.dry_run and "would be abandoned" or "abandoned"))
    if #r.held > 0 then M.reap_run(L, r, opts, out, result) end
  end)
  L:close()
  if not ok then error(err, 0) end
  return result
end

--- reap.forget(run_id, opts, out) -> n: drops what run run_id holds from the ledger without
-- asking its backend (opts.dry_run: only lists it). Refuses a run that is alive. [yields]
function M.forget(run_id, opts, out)
  local L = ledger_mod.open()
  local ok, res = pcall(function()
    local r = L:run(run_id)
    if not r then error("moonbox reap: no run " .. run_id .. " in the ledger", 0) end
    if r.alive then
      error(string.format("moonbox reap: run %d is alive (%s): only a dead run's entries can go",
        run_id, L.shared and r.owner and ("on " .. r.owner .. ", its lease not expired")
          or ("pid " .. r.pid)), 0)
    end
    for _, i in ipairs(r.held) do
      out(string.format("run %d: %s %s", r.id, opts.dry_run and "would forget" or "forgot", held_line(i)))
    end
    if opts.dry_run then return #r.held end
    return L:forget(run_id)
  end)
  L:close()
  if not ok then error(res, 0) end
  return res
end

return M
