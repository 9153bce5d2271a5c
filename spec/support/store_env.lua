--- spec/support/store_env.lua — which store a spec's moonbox processes keep their state in.
--
-- MOONBOX_SPEC_STORE=postgres (set by the second ctest entry of the ledger, reap and schedule
-- specs) runs the same spec file against PostgreSQL: the first call starts a real server
-- (spec.support.postgres) for the whole file and every call hands out a fresh database on
-- it, so each test starts from an empty ledger as it does with its own SQLite file. Unset (or
-- "sqlite"), nothing changes: the processes use their state dir's moonbox.db.
--
--   local S = require "spec.support.store_env"
--   argv entries: S.vars()        -- {} or { "MOONBOX_DATABASE_URL=..." }   [yields]
--   teardown(T.async(S.shutdown))
local M = {}

M.KIND = os.getenv("MOONBOX_SPEC_STORE") or "sqlite"
if M.KIND ~= "sqlite" and M.KIND ~= "postgres" then
  error("MOONBOX_SPEC_STORE must be sqlite or postgres, got '" .. M.KIND .. "'", 0)
end

local server
local n = 0

--- S.server() -> the PostgreSQL server of this spec file, started on first use. [yields]
function M.server()
  server = server or require("spec.support.postgres").start()
  return server
end

--- S.url() -> a fresh database's URL (postgres), or nil (sqlite). [yields]
function M.url()
  if M.KIND ~= "postgres" then return nil end
  n = n + 1
  return M.server():create_database(string.format("spec_%d_%d", require("moonbox.ledger").self_pid(), n))
end

--- S.LEASE: the lease (seconds) the processes of a PostgreSQL run hold (MOONBOX_LEASE_SECONDS).
M.LEASE = 1

--- S.vars() -> env entries ("K=V") that point a moonbox process at a fresh store. [yields]
function M.vars()
  local url = M.url()
  if not url then return {} end
  return { "MOONBOX_DATABASE_URL=" .. url, "MOONBOX_LEASE_SECONDS=" .. M.LEASE }
end

--- S.after_kill(): a SIGKILLed process's runs are dead at once on SQLite (its pid is gone); on
-- PostgreSQL once their lease has run out, which is a time, not an event: this waits for it
-- there and returns at once on SQLite. [yields]
function M.after_kill()
  if M.KIND == "postgres" then require("moonbox.task").sleep(M.LEASE + 0.5) end
end

--- S.shutdown(): stops and removes the server, if one was started. [yields]
function M.shutdown()
  if server then server:destroy() end
  server = nil
end

return M
