--- moonbox.reap — `moonbox ps` and `moonbox reap`: what runs hold, and finishing the cleanup of
-- runs that died (DESIGN.md §6).
--
-- A run is dead when its process is gone (pid and process start time no longer match) or it
-- recorded an end. reap terminates every sandbox a dead run still holds, and reconciles intents
-- without an id (the create's answer was lost) by the name label each create carries: a
-- sandbox on the backend with that exact name is attributable and is terminated; anything it
-- cannot attribute is listed, never touched.
local ledger_mod = require "moonbox.ledger"
local conn_mod = require "moonbox.render.conn"
local api = require "moonbox.render.api"
local core = require "moonbox.core"

local M = {}

local function held_line(i)
  if i.sandbox_id then return i.sandbox_id .. " (intent " .. i.id .. ")" end
  return "unknown create " .. i.label .. " (answer lost; intent " .. i.id .. ")"
end

--- reap.ps(out) -> number of sandboxes held: prints every run that holds something.
function M.ps(out)
  local L = ledger_mod.open()
  local n = 0
  for _, r in ipairs(L:runs()) do
    if #r.held > 0 or r.alive then
      out(string.format("run %d  pid %d  %s  %s  %s", r.id, r.pid, r.alive and "alive" or "dead",
        r.recipe or "?", r.backend))
      for _, i in ipairs(r.held) do
        out("  holds " .. held_line(i))
        n = n + 1
      end
    end
  end
  L:close()
  return n
end

--- Lists the names of the backend's sandboxes that may still be alive: name -> id. [yields]
local function live_by_name(c)
  local by_name, cursor = {}, nil
  repeat
    local page = api.call(c, "sandboxes.list", "GET", "/sandboxes", { query = { ownerId = c.workspace,
      status = { "creating", "running", "suspending", "suspended", "resuming", "errored" },
      cursor = cursor, limit = 100 } })
    for _, e in ipairs(page) do
      if e.sandbox and e.sandbox.name then by_name[e.sandbox.name] = e.sandbox.id end
    end
    cursor = page[#page] and page[#page].cursor
  until #page < 100
  return by_name
end

--- reap.reap_run(L, r, opts, out, result): terminates what run r (from L:runs() or L:run(id))
-- holds, over its own connection to the run's backend (the default connection of
-- moonbox.render is left alone, so a long-lived process can reap its own dead runs). Counts go
-- into result {terminated, unattributed, would}. [yields]
function M.reap_run(L, r, opts, out, result)
  if #r.held == 0 then return end
  local c = conn_mod.connect { backend = r.backend, workspace = r.workspace }
  local by_name
  for _, i in ipairs(r.held) do
    local id = i.sandbox_id
    if not id then
      by_name = by_name or live_by_name(c)
      id = by_name[i.label]
      if not id then
        result.unattributed = result.unattributed + 1
        out(string.format("run %d: %s: no sandbox carries its label; nothing done", r.id, held_line(i)))
      end
    end
    if id then
      if opts.dry_run then
        result.would = result.would + 1
        out(string.format("run %d: would terminate %s", r.id, id))
      else
        api.call(c, "sandboxes.terminate", "POST", "/sandboxes/" .. id .. "/terminate",
          { idempotent = true, sandbox_id = id })
        L.db:run("UPDATE intents SET sandbox_id = ?, released_at = ?, outcome = 'reaped' WHERE id = ?",
          id, core.time(), i.id)
        result.terminated = result.terminated + 1
        out(string.format("run %d: terminated %s", r.id, id))
      end
    end
  end
end

--- reap.reap(opts, out) -> {terminated = n, unattributed = n, would = n}: for every dead run,
-- terminates what it holds (opts.dry_run: only says what it would do). [yields]
function M.reap(opts, out)
  local L = ledger_mod.open()
  local result = { terminated = 0, unattributed = 0, would = 0 }
  for _, r in ipairs(L:runs()) do
    if not r.alive then M.reap_run(L, r, opts, out, result) end
  end
  L:close()
  return result
end

return M
