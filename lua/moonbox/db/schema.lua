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
local M = {}

M.sqlite = {
  [[
  CREATE TABLE runs (
    id INTEGER PRIMARY KEY, pid INTEGER NOT NULL, pid_start TEXT, recipe TEXT,
    backend TEXT NOT NULL, workspace TEXT, started_at REAL NOT NULL, ended_at REAL, outcome TEXT
  );
  CREATE TABLE intents (
    id INTEGER PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES runs(id),
    created_at REAL NOT NULL, label TEXT NOT NULL, sandbox_id TEXT, released_at REAL, outcome TEXT
  );
  CREATE INDEX intents_by_run ON intents (run_id);
  CREATE INDEX intents_by_sandbox ON intents (sandbox_id);
  ]],
  [[
  CREATE TABLE schedules (
    name TEXT PRIMARY KEY, recipe TEXT, spec TEXT, last_slot REAL, next_fire REAL,
    failures INTEGER NOT NULL DEFAULT 0, paused INTEGER NOT NULL DEFAULT 0, paused_reason TEXT,
    paused_at REAL, owner_pid INTEGER, owner_pid_start TEXT, updated_at REAL
  );
  CREATE TABLE schedule_runs (
    id INTEGER PRIMARY KEY, schedule TEXT NOT NULL, slot REAL NOT NULL, trigger TEXT NOT NULL,
    due_at REAL, fired_at REAL, started_at REAL, ended_at REAL, outcome TEXT NOT NULL, error TEXT,
    ledger_run INTEGER, pid INTEGER, pid_start TEXT
  );
  CREATE INDEX schedule_runs_by_schedule ON schedule_runs (schedule, id);
  CREATE UNIQUE INDEX schedule_runs_one_per_slot ON schedule_runs (schedule, slot)
    WHERE trigger <> 'manual';
  ]],
  -- Where an embedded backend keeps a run's sandboxes: its URL dies with it, its state dir does
  -- not, so `moonbox reap` can bring it up again there.
  [[
  ALTER TABLE runs ADD COLUMN local_state TEXT;
  ]],
  [[
  ALTER TABLE runs ADD COLUMN owner TEXT;
  ALTER TABLE runs ADD COLUMN lease_until REAL;
  ALTER TABLE schedule_runs ADD COLUMN owner TEXT;
  ALTER TABLE schedule_runs ADD COLUMN lease_until REAL;
  ]],
  [[
  CREATE TABLE daemons (
    owner TEXT NOT NULL, schedule TEXT NOT NULL, recipe TEXT, started_at REAL NOT NULL,
    lease_until REAL, command TEXT, command_by TEXT, command_at REAL, acked_at REAL,
    stopped_at REAL, PRIMARY KEY (owner, schedule)
  );
  CREATE INDEX daemons_by_schedule ON daemons (schedule);
  ALTER TABLE schedule_runs ADD COLUMN cancel_request TEXT;
  ]],
}

M.postgres = {
  [[
  CREATE TABLE runs (
    id BIGSERIAL PRIMARY KEY, pid INTEGER NOT NULL, pid_start TEXT, recipe TEXT,
    backend TEXT NOT NULL, workspace TEXT, started_at DOUBLE PRECISION NOT NULL,
    ended_at DOUBLE PRECISION, outcome TEXT
  );
  CREATE TABLE intents (
    id BIGSERIAL PRIMARY KEY, run_id BIGINT NOT NULL REFERENCES runs(id),
    created_at DOUBLE PRECISION NOT NULL, label TEXT NOT NULL, sandbox_id TEXT,
    released_at DOUBLE PRECISION, outcome TEXT
  );
  CREATE INDEX intents_by_run ON intents (run_id);
  CREATE INDEX intents_by_sandbox ON intents (sandbox_id);
  ]],
  [[
  CREATE TABLE schedules (
    name TEXT PRIMARY KEY, recipe TEXT, spec TEXT, last_slot DOUBLE PRECISION,
    next_fire DOUBLE PRECISION, failures INTEGER NOT NULL DEFAULT 0,
    paused INTEGER NOT NULL DEFAULT 0, paused_reason TEXT, paused_at DOUBLE PRECISION,
    owner_pid INTEGER, owner_pid_start TEXT, updated_at DOUBLE PRECISION
  );
  CREATE TABLE schedule_runs (
    id BIGSERIAL PRIMARY KEY, schedule TEXT NOT NULL, slot DOUBLE PRECISION NOT NULL,
    trigger TEXT NOT NULL, due_at DOUBLE PRECISION, fired_at DOUBLE PRECISION,
    started_at DOUBLE PRECISION, ended_at DOUBLE PRECISION, outcome TEXT NOT NULL, error TEXT,
    ledger_run BIGINT, pid INTEGER, pid_start TEXT
  );
  CREATE INDEX schedule_runs_by_schedule ON schedule_runs (schedule, id);
  CREATE UNIQUE INDEX schedule_runs_one_per_slot ON schedule_runs (schedule, slot)
    WHERE trigger <> 'manual';
  ]],
  [[
  ALTER TABLE runs ADD COLUMN local_state TEXT;
  ]],
  [[
  ALTER TABLE runs ADD COLUMN owner TEXT;
  ALTER TABLE runs ADD COLUMN lease_until DOUBLE PRECISION;
  ALTER TABLE schedule_runs ADD COLUMN owner TEXT;
  ALTER TABLE schedule_runs ADD COLUMN lease_until DOUBLE PRECISION;
  CREATE INDEX schedule_runs_open ON schedule_runs (outcome) WHERE outcome IN ('queued', 'running');
  ]],
  [[
  CREATE TABLE daemons (
    owner TEXT NOT NULL, schedule TEXT NOT NULL, recipe TEXT, started_at DOUBLE PRECISION NOT NULL,
    lease_until DOUBLE PRECISION, command TEXT, command_by TEXT, command_at DOUBLE PRECISION,
    acked_at DOUBLE PRECISION, stopped_at DOUBLE PRECISION, PRIMARY KEY (owner, schedule)
  );
  CREATE INDEX daemons_by_schedule ON daemons (schedule);
  ALTER TABLE schedule_runs ADD COLUMN cancel_request TEXT;
  ]],
}

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
