-- A dry run (moonbox.dryrun) as a spec's backend, with the interface of spec/support/
-- local_backend.lua's: url, key, workspace, req, create, wait_status, exec, snapshot, settled,
-- destroy; plus http (request and stream as moonbox.http has them, on the dry run's in-memory
-- transport), hold (real work with the simulated clock held still) and runs_commands = false
-- (an exec's output is what render.dry_run.on_exec hooks give, not what a shell would print).
-- Specs iterate over both to hold the dry run to what moonbox local answers.
local json = require "moonbox.json"
local task = require "moonbox.task"
local dryrun = require "moonbox.dryrun"
local encode_query = require("moonbox.render.api").encode_query

local M = {}
local Backend = {}
Backend.__index = Backend

--- M.start() -> backend: starts a dry run in this process (it lasts until backend:destroy()).
-- [yields]
function M.start()
  local s = dryrun.start()
  local srv = s.backend.srv
  return setmetatable({ sim = s, url = "http://dry-run.invalid", key = s.backend.api_key,
    workspace = s.backend.workspace, runs_commands = false, dry = true,
    http = { request = function(o) return srv:request(o) end, stream = function(o) return srv:stream(o) end },
  }, Backend)
end

--- backend:hold(fn, ...) -> fn's results, the simulated clock held still meanwhile. [yields]
function Backend.hold(_, fn, ...) return dryrun.hold(fn, ...) end

--- backend:destroy(): ends the dry run. [yields]
function Backend:destroy()
  if self.sim then
    self.sim = nil
    pcall(require("moonbox.render").close)
    dryrun.stop()
  end
end

--- backend:connect_render(): points moonbox.render at the dry run (its default connection). [yields]
function Backend.connect_render()
  require("moonbox.render").connect {}
end

--- backend:req(method, path, opts) -> status, decoded JSON (or raw body), headers, body: as
-- local_backend's. [yields]
function Backend:req(method, path, opts)
  opts = opts or {}
  local headers = { Accept = "application/json" }
  if opts.auth ~= false then headers.Authorization = "Bearer " .. (opts.auth or self.key) end
  local body = opts.body
  if type(body) == "table" then
    body = json.encode(body)
    headers["Content-Type"] = "application/json"
  end
  for k, v in pairs(opts.headers or {}) do headers[k] = v end
  local r = self.http.request { method = method, url = self.url .. path .. encode_query(opts.query),
    headers = headers, body = body }
  local decoded = r.body
  if (r.headers["content-type"] or ""):find("json") then decoded = json.decode(r.body) end
  return r.status, decoded, r.headers, r.body
end

--- backend:create(body) -> the created sandbox, once it is running. [yields]
function Backend:create(body)
  body = body or {}
  body.ownerId = body.ownerId or self.workspace
  local status, sb = self:req("POST", "/v1/sandboxes", { body = body })
  assert(status == 201, "create failed: " .. status .. " " .. json.encode(sb))
  return self:wait_status(sb.id, "running")
end

--- backend:wait_status(id, status) -> the sandbox once it has that status. [yields]
function Backend:wait_status(id, want)
  for _ = 1, 600 do
    local _, sb = self:req("GET", "/v1/sandboxes/" .. id)
    if sb.status == want then return sb end
    if sb.status == "errored" or (sb.status == "terminated" and want ~= "terminated") then
      error("sandbox " .. id .. " became " .. sb.status)
    end
    task.sleep(0.05)
  end
  error("sandbox " .. id .. " did not become " .. want)
end

--- backend:snapshot(id[, kind]) -> the 202 answer's snapshot. [yields]
function Backend:snapshot(id, kind)
  local s, snap = self:req("POST", "/v1/sandboxes/" .. id .. "/snapshots", { body = { kind = kind or "filesystem" } })
  assert(s == 202, "capture of " .. id .. ": " .. s .. " " .. json.encode(snap))
  return snap
end

--- backend:exec(id, command) -> {stdout, stderr, code, events, status, exec_id}: local_backend's
-- (a stream run), over the in-memory transport. [yields]
Backend.exec = require("spec.support.local_backend").Backend.exec

--- M.fixture(setup, teardown, ready): local_backend.fixture's, for a dry run. [yields]
function M.fixture(setup, teardown, ready)
  local T = require "moonbox.testing"
  local b, undo
  setup(T.async(function()
    b = M.start()
    b:connect_render()
    undo = ready(b)
  end))
  teardown(T.async(function()
    if undo then undo() end
    if b then b:destroy() end
  end))
end

return M
