--- moonbox.schedule.runs — the `moonbox runs [NAME] [--json] [--limit N]` command: the history
-- of scheduled runs from the state dir's moonbox.db, newest first.
local json = require "moonbox.json"
local clock_mod = require "moonbox.schedule.clock"
local db_mod = require "moonbox.db"
local store_mod = require "moonbox.schedule.store"

local M = {}

M.command = {
  usage = "moonbox runs [NAME] [--json] [--limit N] [--state DB]",
  detail = [[Prints the history `moonbox schedule` recorded in $XDG_STATE_HOME/moonbox/moonbox.db,
newest first: every run and every skipped slot, of schedule NAME or of all schedules. Columns:
record id, schedule, slot (the time the fire was due), trigger (cron, catchup or manual), start,
duration, outcome (queued, running, ok, failed, timeout, cancelled, skipped, interrupted), the
sandboxes the run created, whether a durable schedule's run was resumed after its daemon died
("(resumed N times, last by HOST/PID)"), and the error or the reason it was skipped.

--limit N shows the newest N records (default 20; 0 shows all). --json prints one JSON array of
objects with the same facts; times are RFC 3339 text (slot, fired_at, started_at, ended_at) and
numbers of seconds since the epoch (slot_unix, due_unix — the slot plus its jitter —,
fired_unix, started_unix, ended_unix), resumes (how many times a daemon resumed the run) and
resumed_by (the owner id HOST/PID/START of the daemon that resumed it last, or null). Times are
the schedule clock's (the test clock's, when a spec set MOONBOX_TEST_CLOCK).

--state DB reads another database: a SQLite file or a postgres:// URL (default:
MOONBOX_DATABASE_URL, else the state dir's moonbox.db). On a PostgreSQL database shared by
several machines it lists every machine's runs.]],
}

local function duration(r)
  if not (r.started_at and r.ended_at) then return "-" end
  return string.format("%.1fs", r.ended_at - r.started_at)
end

--- main(args, cli) -> exit status.
function M.main(args, cli)
  local opts, rest = cli.parse_flags(args, { json = "flag", limit = "value", state = "value" })
  if not opts then return cli.usage_error("runs: %s", rest) end
  if #rest > 1 then return cli.usage_error("runs: unexpected argument '%s'", rest[2]) end
  local limit = tonumber(opts.limit or "20")
  if not limit or limit < 0 or limit % 1 ~= 0 then
    return cli.usage_error("runs: --limit must be an integer >= 0, got '%s'", tostring(opts.limit))
  end
  if limit == 0 then limit = -1 end
  if opts.state then db_mod.set_target(opts.state) end
  local tok, terr = pcall(db_mod.target)
  if not tok then return cli.usage_error("runs: --state: %s", tostring(terr)) end
  local code, err = cli.run_root(function() M.print(rest[1], limit, opts.json) end)
  if err ~= nil then cli.eprintf("moonbox runs: %s\n", cli.format_error(err)) end
  return code
end

--- runs.print(name, limit, as_json): prints the history (see the command). [yields] on
-- PostgreSQL.
function M.print(name, limit, as_json)
  local store = store_mod.open()
  local ok, err = pcall(M.print_rows, store, name, limit, as_json)
  store.ledger:close()
  if not ok then error(err, 0) end
end

--- runs.print_rows(store, name, limit, as_json): prints store's run history, newest first, as
-- `moonbox runs` does: only schedule name's rows when name is given, at most limit rows (nil or
-- -1: all), either as one JSON array on stdout (times both RFC 3339 and Unix, absent ones null)
-- or as an aligned table, with a line saying so when there are none. Raises the store's errors;
-- [yields] on PostgreSQL.
function M.print_rows(store, name, limit, as_json)
  local rest, opts = { name }, { json = as_json }
  local rows = store:history { schedule = rest[1], limit = math.tointeger(limit) }
  if opts.json then
    local out = {}
    for i, r in ipairs(rows) do
      out[i] = {
        id = r.id, schedule = r.schedule, trigger = r.trigger, outcome = r.outcome,
            error = r.error or json.null,
        slot = clock_mod.format(r.slot), slot_unix = r.slot, due_unix = r.due_at or json.null,
        fired_at = r.fired_at and clock_mod.format(r.fired_at) or json.null,
            fired_unix = r.fired_at or json.null,
        started_at = r.started_at and clock_mod.format(r.started_at) or json.null,
        started_unix = r.started_at or json.null,
        ended_at = r.ended_at and clock_mod.format(r.ended_at) or json.null,
            ended_unix = r.ended_at or json.null,
        sandboxes = json.array(r.sandboxes), ledger_run = r.ledger_run or json.null, pid = r.pid,
        owner = r.owner or json.null, resumes = r.resumes or 0, resumed_by = r.resumed_by or json.null,
      }
    end
    io.stdout:write(json.encode(json.array(out)), "\n")
  else
    if #rows == 0 then
      print(rest[1] and ("no runs recorded for schedule '" .. rest[1] .. "'") or "no runs recorded")
    else
      print(string.format("%-6s %-18s %-24s %-8s %-24s %-8s %-11s %s", "ID", "SCHEDULE", "SLOT", "TRIGGER",
        "STARTED", "TOOK", "OUTCOME", "SANDBOXES / ERROR"))
      for _, r in ipairs(rows) do
        local extra = {}
        if #r.sandboxes > 0 then extra[#extra + 1] = table.concat(r.sandboxes, ",") end
        if (r.resumes or 0) > 0 then
          extra[#extra + 1] = string.format("(resumed %d time%s, last by %s)", r.resumes,
            r.resumes == 1 and "" or "s", (tostring(r.resumed_by):gsub("/[^/]*$", "")))
        end
        if r.error then extra[#extra + 1] = r.error end
        print(string.format("%-6d %-18s %-24s %-8s %-24s %-8s %-11s %s", r.id, r.schedule,
            clock_mod.format(r.slot),
          r.trigger, r.started_at and clock_mod.format(r.started_at) or "-", duration(r), r.outcome,
          table.concat(extra, "  ")))
      end
    end
  end
end

return M
