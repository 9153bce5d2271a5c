-- render.yaml, the Render Blueprint that runs `moonbox schedule` as a background worker: every
-- field it uses is one of Render's documented Blueprint fields, and it fits the Dockerfile it
-- builds (the state disk where the image keeps its state, the key a secret, one instance).
--
-- The documented field set below is transcribed from Render's Blueprint YAML reference,
-- https://render.com/docs/blueprint-spec (root-level fields, service fields, environment
-- variables, disks, databases), for the fields and values a moonbox Blueprint could use; a
-- field not listed here fails the spec until it is checked against that page and added.
local lyaml = require "lyaml"
local files = require "spec.support.files"

local function set(list)
  local s = {}
  for _, v in ipairs(list) do s[v] = true end
  return s
end

local DOCUMENTED = {
  root = set { "services", "databases", "envVarGroups", "previews", "projects", "ungrouped" },
  service = set { "type", "name", "runtime", "plan", "region", "repo", "branch", "rootDir",
    "numInstances", "scaling", "buildCommand", "startCommand", "preDeployCommand",
    "dockerfilePath", "dockerContext", "dockerCommand", "registryCredential", "image",
    "envVars", "disk", "autoDeploy", "autoDeployTrigger", "buildFilter", "healthCheckPath",
    "maxShutdownDelaySeconds", "domains", "previews", "ipAllowList" },
  service_type = set { "web", "pserv", "worker", "cron", "keyvalue", "redis" },
  runtime = set { "docker", "image", "node", "python", "ruby", "go", "rust", "elixir", "static" },
  region = set { "oregon", "ohio", "virginia", "frankfurt", "singapore" },
  auto_deploy_trigger = set { "commit", "checksPass", "off" },
  env_var = set { "key", "value", "generateValue", "sync", "fromDatabase", "fromService",
    "fromGroup", "previewValue" },
  from_database = set { "name", "property" },
  database_property = set { "connectionString", "host", "port", "user", "password", "database" },
  disk = set { "name", "mountPath", "sizeGB" },
  database = set { "name", "databaseName", "user", "plan", "region", "postgresMajorVersion",
    "diskSizeGB", "ipAllowList", "readReplicas", "highAvailability", "previewPlan" },
}
local MAX_SHUTDOWN_DELAY = 300 -- "Default: 30, Max: 300"

local read = files.must_read

--- problems(doc, where) -> list of "where: path: what is wrong" for a parsed Blueprint.
local function problems(doc, where)
  local out = {}
  local function bad(path, msg) out[#out + 1] = where .. ": " .. path .. ": " .. msg end
  local function fields(t, allowed, path)
    if type(t) ~= "table" then return bad(path, "expected a mapping, got " .. type(t)) end
    for k in pairs(t) do
      if not allowed[k] then bad(path .. "." .. tostring(k), "not a documented Blueprint field") end
    end
  end
  local function one_of(v, allowed, path)
    if v ~= nil and not allowed[v] then bad(path, "'" .. tostring(v) .. "' is not a documented value") end
  end
  fields(doc, DOCUMENTED.root, "(root)")
  local dbs = {}
  for i, db in ipairs(doc.databases or {}) do
    local p = ("databases[%d]"):format(i)
    fields(db, DOCUMENTED.database, p)
    if db.name then dbs[db.name] = true else bad(p, "a database needs a name") end
  end
  for i, s in ipairs(doc.services or {}) do
    local p = ("services[%d]"):format(i)
    fields(s, DOCUMENTED.service, p)
    if not s.name then bad(p, "a service needs a name") end
    if not s.type then bad(p, "a service needs a type") end
    one_of(s.type, DOCUMENTED.service_type, p .. ".type")
    one_of(s.runtime, DOCUMENTED.runtime, p .. ".runtime")
    one_of(s.region, DOCUMENTED.region, p .. ".region")
    one_of(s.autoDeployTrigger, DOCUMENTED.auto_deploy_trigger, p .. ".autoDeployTrigger")
    if s.maxShutdownDelaySeconds and not (math.type(s.maxShutdownDelaySeconds) == "integer" and
        s.maxShutdownDelaySeconds >= 1 and s.maxShutdownDelaySeconds <= MAX_SHUTDOWN_DELAY) then
      bad(p .. ".maxShutdownDelaySeconds", "must be a whole number of seconds up to " .. MAX_SHUTDOWN_DELAY)
    end
    if s.disk then
      fields(s.disk, DOCUMENTED.disk, p .. ".disk")
      if not (s.disk.name and s.disk.mountPath) then bad(p .. ".disk", "needs name and mountPath") end
      if s.plan == "free" then bad(p .. ".disk", "free instances cannot have a disk") end
    end
    for j, e in ipairs(s.envVars or {}) do
      local q = ("%s.envVars[%d]"):format(p, j)
      fields(e, DOCUMENTED.env_var, q)
      if e.sync ~= nil and e.sync ~= false then bad(q .. ".sync", "only sync: false is documented") end
      if e.fromDatabase then
        fields(e.fromDatabase, DOCUMENTED.from_database, q .. ".fromDatabase")
        one_of(e.fromDatabase.property, DOCUMENTED.database_property, q .. ".fromDatabase.property")
        if not dbs[e.fromDatabase.name] then
          bad(q .. ".fromDatabase.name", "no database named '" .. tostring(e.fromDatabase.name) .. "' here")
        end
      end
      local key = tostring(e.key or "")
      if e.value ~= nil and (key:find("KEY") or key:find("SECRET") or key:find("TOKEN") or key:find("PASSWORD")) then
        bad(q, key .. " has its value in the file: a secret must be sync: false")
      end
    end
  end
  return out
end

-- What the Dockerfile's stage NAME says: its USER, ENV lines and CMD.
local function stage(dockerfile, name)
  local text = dockerfile:match("\nFROM [^\n]+ AS " .. name .. "\n(.-)\nFROM ") or
    dockerfile:match("\nFROM [^\n]+ AS " .. name .. "\n(.*)$")
  assert(text, "the Dockerfile has no stage " .. name)
  return { text = text, user = text:match("\nUSER (%S+)"), cmd = text:match("\nCMD (%b[])"),
    env = text:match("\nENV ([^\n]+)") }
end

describe("render.yaml", function()
  local blueprint = lyaml.load(read("render.yaml"))
  local worker = blueprint.services and blueprint.services[1]

  it("uses only Render's documented Blueprint fields and values", function()
    assert.are.same({}, problems(blueprint, "render.yaml"))
  end)

  it("runs the Dockerfile's schedule stage as one background worker with its state on a disk", function()
    assert.are.equal(1, #blueprint.services)
    assert.are.equal("worker", worker.type)
    assert.are.equal("docker", worker.runtime)
    assert.are.equal(1, worker.numInstances)
    local dockerfile = read(worker.dockerfilePath)
    -- The default (last) stage is the one Render builds, and it runs the schedule daemon.
    assert.are.equal("schedule", dockerfile:match(".*\nFROM [^\n]+ AS (%S+)"))
    local s = stage(dockerfile, "schedule")
    assert.are.equal("moonbox", s.user)
    assert.are.equal('["schedule", "/etc/moonbox/schedule.lua", "--backend", "render"]', s.cmd)
    assert.truthy(s.text:find("\nENTRYPOINT %[\"moonbox\"%]"))
    -- moonbox.db lives in $XDG_STATE_HOME/moonbox: the disk must be mounted at XDG_STATE_HOME.
    assert.are.equal("XDG_STATE_HOME=" .. worker.disk.mountPath, s.env)
  end)

  it("asks for the API key as a secret and keeps it out of the file", function()
    local keys = {}
    for _, e in ipairs(worker.envVars) do keys[e.key] = e end
    assert.are.same({ key = "RENDER_API_KEY", sync = false }, keys.RENDER_API_KEY)
  end)

  it("gives moonbox the longest shutdown Render allows to unwind runs on SIGTERM", function()
    assert.are.equal(MAX_SHUTDOWN_DELAY, worker.maxShutdownDelaySeconds)
  end)
end)

describe("the Blueprint check", function()
  it("names an undocumented field, a bad value, an inline secret and a missing database", function()
    local doc = lyaml.load([[
services:
  - type: worker
    name: w
    runtime: dokcer
    startCmd: moonbox
    disk: { name: d, mountpath: /x }
    envVars:
      - key: RENDER_API_KEY
        value: rnd_inline
      - key: MOONBOX_DATABASE_URL
        fromDatabase: { name: nope, property: connectionString }
]])
    local got = table.concat(problems(doc, "t.yaml"), "\n")
    assert.truthy(got:find("t.yaml: services[1].startCmd: not a documented Blueprint field", 1, true))
    assert.truthy(got:find("services[1].runtime: 'dokcer' is not a documented value", 1, true))
    assert.truthy(got:find("services[1].disk.mountpath: not a documented Blueprint field", 1, true))
    assert.truthy(got:find("RENDER_API_KEY has its value in the file", 1, true))
    assert.truthy(got:find("services[1].envVars[2].fromDatabase.name: no database named 'nope'", 1, true))
  end)
end)

describe("docs/deploy.md", function()
  it("shows only Blueprints made of documented fields", function()
    local n = 0
    for block in read("docs/deploy.md"):gmatch("```yaml\n(.-)```") do
      if block:find("services:") or block:find("databases:") then
        n = n + 1
        assert.are.same({}, problems(lyaml.load(block), "docs/deploy.md yaml block " .. n))
      end
    end
    assert.is_true(n >= 1, "docs/deploy.md shows no Blueprint")
  end)
end)
