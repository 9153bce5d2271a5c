--- spec/support/postgres.lua — a real PostgreSQL server (Debian's postgresql package) for
-- specs: initdb and pg_ctl in a temp dir owned by the unprivileged `postgres` user when run
-- as root (the server refuses to run as root), listening only on a unix socket directory of
-- its own (no TCP port at all), trust authentication for that socket. Fails loudly when the
-- package is missing. Every call yields.
--
--   local PG = require "spec.support.postgres"
--   local server = PG.start()                -- a running server, with database "moonbox"
--   server.url                               -- postgresql:///moonbox?host=/tmp/...&user=postgres
--   server:create_database(name) -> URL      -- a fresh database on it
--   server:restart([mode])  server:stop_server([mode])  server:start_server()
--   server:destroy()                         -- stopped and removed, also after a failure
local proc = require "moonbox.proc"

local M = {}

M.BIN = os.getenv("MOONBOX_PG_BIN") or "/usr/lib/postgresql/15/bin"
M.USER = "postgres"

local Server = {}
Server.__index = Server

local function run(argv)
  local r = proc.run(argv)
  if r.code ~= 0 then
    error(string.format("%s failed (exit %s): %s%s", table.concat(argv, " "), tostring(r.code),
      r.stdout or "", r.stderr or ""), 0)
  end
  return r
end

-- PostgreSQL refuses to run as root: as root, its commands run as the postgres user; as anyone
-- else, as that user. Set by M.start (it takes a process to find out, which yields).
local is_root = false

local function as_user(argv)
  if not is_root then return argv end
  local out = { "runuser", "-u", M.USER, "--" }
  for _, a in ipairs(argv) do out[#out + 1] = a end
  return out
end

--- M.start() -> Server: a new cluster in a temp dir, started, with database "moonbox". [yields]
function M.start()
  local f = io.open(M.BIN .. "/initdb")
  if not f then
    error("PostgreSQL is not installed (no " .. M.BIN .. "/initdb): run ./dev setup", 0)
  end
  f:close()
  is_root = (run({ "id", "-u" }).stdout or ""):match("^0%s") ~= nil
  local dir = run({ "mktemp", "-d", "/tmp/moonbox-pg-spec.XXXXXX" }).stdout:gsub("%s+$", "")
  local self = setmetatable({ dir = dir, data = dir .. "/data", sock = dir .. "/sock" }, Server)
  local ok, err = pcall(function()
    run { "chmod", "0755", dir }
    run { "mkdir", "-p", self.sock }
    if is_root then run { "chown", "-R", M.USER, dir } end
    run(as_user { M.BIN .. "/initdb", "-D", self.data, "-U", M.USER, "--auth=trust", "-E", "UTF8",
      "--no-sync" })
    self:start_server()
    run(as_user { M.BIN .. "/createdb", "-h", self.sock, "-U", M.USER, "moonbox" })
  end)
  if not ok then
    self:destroy()
    error(err, 0)
  end
  self.url = self:database_url("moonbox")
  return self
end

--- server:database_url(name) -> the URL of database name (over the server's socket).
function Server:database_url(name)
  return "postgresql:///" .. name .. "?host=" .. self.sock .. "&user=" .. M.USER
end

--- server:create_database(name) -> URL of a new empty database. [yields]
function Server:create_database(name)
  run(as_user { M.BIN .. "/createdb", "-h", self.sock, "-U", M.USER, name })
  return self:database_url(name)
end

--- server:start_server(): starts (or starts again) the server and waits until it accepts.
-- [yields]
function Server:start_server()
  run(as_user { M.BIN .. "/pg_ctl", "-D", self.data, "-l", self.dir .. "/log", "-w", "-t", "60",
    "-o", "-c listen_addresses='' -c unix_socket_directories=" .. self.sock ..
      " -c fsync=off -c max_connections=60", "start" })
  self.running = true
end

--- server:stop_server([mode]): stops the server (mode "fast" default, "immediate" = a crash).
-- [yields]
function Server:stop_server(mode)
  run(as_user { M.BIN .. "/pg_ctl", "-D", self.data, "-m", mode or "fast", "-w", "-t", "60", "stop" })
  self.running = false
end

--- server:restart([mode]): stop, then start again. [yields]
function Server:restart(mode)
  self:stop_server(mode)
  self:start_server()
end

--- server:destroy(): stops the server if it runs and removes its directory. [yields]
function Server:destroy()
  if self.running then pcall(self.stop_server, self, "immediate") end
  proc.run { "rm", "-rf", self.dir }
end

M.Server = Server
return M
