--- moonbox.db.schema — the versioned schema of moonbox's database, for both stores.
--
-- Migration i is the same step on SQLite and on PostgreSQL (the same tables and columns, in
-- each store's types: REAL is a double in SQLite but a 4-byte float in PostgreSQL, so times are
-- DOUBLE PRECISION there; INTEGER PRIMARY KEY becomes BIGSERIAL). A database at version v gets
-- migrations v+1.. in order, each once, in its own transaction. SQLite keeps the version in
-- PRAGMA user_version, PostgreSQL in the table moonbox_schema (moonbox.db.postgres).
--
--   1  runs, intents                       the ledger (lua/moonbox/ledger.lua)
--   2  schedules, schedule_runs            schedule state and history (moonbox.schedule.store)
--   3  runs.local_state                    where an embedded backend kept a run's sandboxes
--   4  owner, lease_until on runs and      who runs a run, and until when it is known alive
--      schedule_runs                       (on PostgreSQL, liveness is the lease: see ledger.md)
--   5  daemons, schedule_runs.             the daemons firing each schedule (a lease each) and
--      cancel_request                      the requests other machines leave them: --stop
--                                          (moonbox.schedule.store), a cancel_other of a run
--   6  journal, run_resumes; runs.durable,  durable runs (moonbox.durable): each call a run made
--      args, resumes, run_key;             with its answer, who resumed a run and when, the
--      schedule_runs.resumes, resumed_by   recipe's arguments a resume runs it with again, and
--                                          the name --run-id gives a run
local M = {}

-- The types that differ between the stores; a migration below names them as $NAME.
local TYPES = {
  sqlite = { ID = "INTEGER PRIMARY KEY", BIGINT = "INTEGER", TIME = "REAL" },
  postgres = { ID = "BIGSERIAL PRIMARY KEY", BIGINT = "BIGINT", TIME = "DOUBLE PRECISION" },
}

-- Each migration once: its script, and what one store adds to it (PostgreSQL's migration 4 also
-- indexes the open schedule runs; SQLite's never did, and a migration that has shipped stays as
-- it was).
local MIGRATIONS = {
  { [[
  CREATE TABLE runs (
    id $ID, pid INTEGER NOT NULL, pid_start TEXT, recipe TEXT,
    backend TEXT NOT NULL, workspace TEXT, started_at $TIME NOT NULL, ended_at $TIME, outcome TEXT
  );
  CREATE TABLE intents (
    id $ID, run_id $BIGINT NOT NULL REFERENCES runs(id),
    created_at $TIME NOT NULL, label TEXT NOT NULL, sandbox_id TEXT, released_at $TIME, outcome TEXT
  );
  CREATE INDEX intents_by_run ON intents (run_id);
  CREATE INDEX intents_by_sandbox ON intents (sandbox_id);
  ]] },
  { [[
  CREATE TABLE schedules (
    name TEXT PRIMARY KEY, recipe TEXT, spec TEXT, last_slot $TIME, next_fire $TIME,
    failures INTEGER NOT NULL DEFAULT 0, paused INTEGER NOT NULL DEFAULT 0, paused_reason TEXT,
    paused_at $TIME, owner_pid INTEGER, owner_pid_start TEXT, updated_at $TIME
  );
  CREATE TABLE schedule_runs (
    id $ID, schedule TEXT NOT NULL, slot $TIME NOT NULL, trigger TEXT NOT NULL,
    due_at $TIME, fired_at $TIME, started_at $TIME, ended_at $TIME, outcome TEXT NOT NULL, error TEXT,
    ledger_run $BIGINT, pid INTEGER, pid_start TEXT
  );
  CREATE INDEX schedule_runs_by_schedule ON schedule_runs (schedule, id);
  CREATE UNIQUE INDEX schedule_runs_one_per_slot ON schedule_runs (schedule, slot)
    WHERE trigger <> 'manual';
  ]] },
  -- Where an embedded backend keeps a run's sandboxes: its URL dies with it, its state dir does
  -- not, so `moonbox reap` can bring it up again there.
  { [[
  ALTER TABLE runs ADD COLUMN local_state TEXT;
  ]] },
  { [[
  ALTER TABLE runs ADD COLUMN owner TEXT;
  ALTER TABLE runs ADD COLUMN lease_until $TIME;
  ALTER TABLE schedule_runs ADD COLUMN owner TEXT;
  ALTER TABLE schedule_runs ADD COLUMN lease_until $TIME;
  ]], postgres = [[
  CREATE INDEX schedule_runs_open ON schedule_runs (outcome) WHERE outcome IN ('queued', 'running');
  ]] },
  { [[
  CREATE TABLE daemons (
    owner TEXT NOT NULL, schedule TEXT NOT NULL, recipe TEXT, started_at $TIME NOT NULL,
    lease_until $TIME, command TEXT, command_by TEXT, command_at $TIME, acked_at $TIME,
    stopped_at $TIME, PRIMARY KEY (owner, schedule)
  );
  CREATE INDEX daemons_by_schedule ON daemons (schedule);
  ALTER TABLE schedule_runs ADD COLUMN cancel_request TEXT;
  ]] },
  { [[
  CREATE TABLE journal (
    run_id $BIGINT NOT NULL REFERENCES runs(id), stream TEXT NOT NULL, kind TEXT NOT NULL,
    seq INTEGER NOT NULL, state TEXT, entry TEXT NOT NULL, written_at $TIME NOT NULL,
    PRIMARY KEY (run_id, stream, kind, seq)
  );
  CREATE TABLE run_resumes (
    id $ID, run_id $BIGINT NOT NULL REFERENCES runs(id), at $TIME NOT NULL, owner TEXT,
    previous_owner TEXT, entries INTEGER
  );
  CREATE INDEX run_resumes_by_run ON run_resumes (run_id);
  ALTER TABLE runs ADD COLUMN durable INTEGER NOT NULL DEFAULT 0;
  ALTER TABLE runs ADD COLUMN args TEXT;
  ALTER TABLE runs ADD COLUMN resumes INTEGER NOT NULL DEFAULT 0;
  ALTER TABLE runs ADD COLUMN run_key TEXT;
  CREATE UNIQUE INDEX runs_by_key ON runs (run_key) WHERE run_key IS NOT NULL;
  ALTER TABLE schedule_runs ADD COLUMN resumes INTEGER NOT NULL DEFAULT 0;
  ALTER TABLE schedule_runs ADD COLUMN resumed_by TEXT;
  ]] },
}

-- The migrations of one store: each script with the store's types, then the store's additions.
local function for_store(store)
  local types, out = TYPES[store], {}
  for i, m in ipairs(MIGRATIONS) do
    out[i] = (m[1] .. (m[store] or "")):gsub("%$(%u+)", function(name)
      return assert(types[name], "schema: no type " .. name .. " for " .. store)
    end)
  end
  return out
end

--- schema.sqlite, schema.postgres: the migration scripts of each store, in order (script i
-- takes a database from version i-1 to i).
M.sqlite = for_store("sqlite")
M.postgres = for_store("postgres")

--- schema.statements(script) -> array of the statements of a migration script (split at the
-- semicolons that end a line; migrations hold no semicolon inside a literal).
function M.statements(script)
  local out = {}
  for stmt in (script .. "\n"):gmatch("(.-);%s*\n") do
    if stmt:match("%S") then out[#out + 1] = stmt end
  end
  return out
end

return M
