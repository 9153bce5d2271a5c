--- moonbox.render — the Render sandbox API as blocking-style calls that park the calling task.
--
--   local render = require "moonbox.render"
--   local sb <close> = render.sandboxes.create { network = "deny-all" }   -- waits until running
--   print(sb:exec("echo hi"):check().stdout)                               -- terminated on scope exit
--
-- This file is the module's face: it gathers what the parts export, and owns nothing else.
--   moonbox.render.conn      which backend, the default connection (and .embedded, the embedded
--                            local backend's lifetime)
--   moonbox.render.api       one request: retries, typed errors, trace spans (both planes)
--   moonbox.render.sandbox   the Sandbox class and the sandboxes' lifecycle; its methods come
--                            from .exec, .files and .snapshots
--   moonbox.render.snapshots snapshots and groups
--   moonbox.render.fleet     render.restore
--   moonbox.render.rebuild   render.snapshots.rebuild
--   moonbox.render.events    render.observe
--   moonbox.render.budget    render.budget: limits on what a run may create and keep
--   moonbox.render.dryrun    render.dry_run: the hooks a dry run (moonbox.dryrun) reads
-- Every function documents its arguments, results, what it raises, and whether it yields where
-- it is defined; docs/reference/render.md is the manual.
local conn = require "moonbox.render.conn"
local events = require "moonbox.render.events"
local sandbox = require "moonbox.render.sandbox"
local exec = require "moonbox.render.exec"
local files = require "moonbox.render.files"
local snapshots = require "moonbox.render.snapshots"
local rebuild = require "moonbox.render.rebuild"
local fleet = require "moonbox.render.fleet"
local budget = require "moonbox.render.budget"
local schema = require "moonbox.schema"

local M = {}

-- The calls this face takes from modules that declare nothing themselves (moonbox.schema).
M.SCHEMA = {
  ["render.observe"] = { summary = "subscribes fn(event, subject, info) to sandbox life events",
    args = { { name = "fn", type = "function" } }, returns = "fun()" },
  ["render.connect"] = { summary = "chooses the backend and makes it the default connection",
    args = { { name = "opts", type = "table", optional = true } }, options = {
      backend = { type = "string",
        doc = "\"local\", \"render\" or an http(s) URL; default from the environment" },
      api_key = { type = "string", doc = "the API key; default RENDER_API_KEY" },
      workspace = { type = "string", doc = "the workspace (owner id); default RENDER_WORKSPACE_ID" },
      state_dir = { type = "string", doc = "the embedded local backend's state directory" },
    }, returns = "table", yields = true },
  ["render.connection"] = { summary = "the default connection (connecting with the defaults first)",
    returns = "table", yields = true },
  ["render.current_connection"] = {
    summary = "the default connection, or the last one, or nil; never connects",
    returns = "table?" },
  ["render.close"] = { summary = "closes the default connection", yields = true },
}
schema.declare(M.SCHEMA)

--- render.observe(fn) -> unsubscribe(): sandbox life events (moonbox.render.events). [does not
-- yield]
M.observe = schema.wrap("render.observe", events.observe)

--- render.connect(opts) -> Conn: chooses the backend (moonbox.render.conn: backend, api_key,
-- workspace, state_dir) and makes it the default for the module's functions. Called implicitly
-- by the first API call. [yields]
M.connect = schema.wrap("render.connect", conn.set_default)

--- render.connection() -> the default Conn (connecting with the defaults first). Concurrent
-- first calls make one connection. [yields]
M.connection = schema.wrap("render.connection", conn.default)

--- render.current_connection() -> the default Conn, or the last one after render.close(), or
-- nil; never connects. Does not yield.
M.current_connection = schema.wrap("render.current_connection", conn.current)

--- render.close(): closes the default connection; the embedded local backend this process used
-- stops if no other run uses it (moonbox run calls it when the recipe ends, also after a
-- failure or SIGINT). [yields]
M.close = schema.wrap("render.close", conn.close_default)

--- render.sandboxes: create, get, list, terminate (moonbox.render.sandbox).
M.sandboxes = {
  create = sandbox.create, get = sandbox.get, list = sandbox.list, terminate = sandbox.terminate,
}

--- render.snapshots, render.groups (moonbox.render.snapshots).
M.snapshots = snapshots.snapshots
--- render.snapshots.rebuild(name, build_fn, opts) -> Snapshot, summary: builds, captures,
-- verifies and rolls forward the snapshot named `name` (moonbox.render.rebuild). [yields]
M.snapshots.rebuild = rebuild.rebuild
M.groups = snapshots.groups

--- render.budget{sandboxes = N, sandbox_seconds = S} -> Budget: limits what the current run may
-- create and keep (moonbox.render.budget). Does not yield.
M.budget = budget.set

--- render.dry_run: active(), on_exec(pattern, answer), on_download(pattern, answer),
-- durations{...}: what a dry run (moonbox run --dry-run) simulates (moonbox.render.dryrun). Does
-- not yield.
M.dry_run = require("moonbox.render.dryrun").hooks

--- render.restore(snapshot, opts) -> Fleet (moonbox.render.fleet).
M.restore = fleet.restore

--- render.shell_quote(s), render.normalize_path(p): the quoting and path cleaning the client
-- uses (moonbox.render.exec, moonbox.render.files).
M.shell_quote = exec.shell_quote
M.normalize_path = files.normalize_path

--- The classes, for identification (getmetatable(x) == render.Sandbox) and for the REPL's
-- completion (render.Sandbox.methods).
M.Sandbox = sandbox.Sandbox
M.Snapshot = snapshots.Snapshot
M.Group = snapshots.Group
M.Fleet = fleet.Fleet
M.Result = exec.Result
M.Process = exec.Process

return M
