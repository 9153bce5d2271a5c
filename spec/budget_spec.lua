-- Budgets (moonbox.render.budget): `moonbox run --max-sandboxes N --max-sandbox-seconds S` and
-- render.budget{...} in a recipe, against a real `moonbox local`. A create beyond the count
-- raises budget_exceeded before anything is sent (the backend's journal shows no such request);
-- a run whose sandboxes have spent the seconds has them terminated and fails with
-- budget_exceeded naming the budget, the count and the ids; a recipe can lower the command
-- line's limits, never raise them; `--json` reports sandbox-seconds per plan.
local T = require "moonbox.testing"
local json = require "moonbox.json"
local runs = require "spec.support.runs"

local B, home

runs.fixture(setup, teardown, function(b, h) B, home = b, h end)

-- Runs recipe text with extra `moonbox run` arguments; returns the result, the --json summary
-- and the POST /v1/sandboxes requests the backend received meanwhile.
local function run(text, ...)
  local mark = runs.last_seq(B)
  local args = { "run", "--json", ... }
  args[#args + 1] = home:recipe(text)
  local r = home:moonbox(table.unpack(args))
  local summary = json.decode(r.stdout:match("([^\n]*)\n?$"))
  runs.settled(B, mark)
  local creates = {}
  for _, e in ipairs(runs.journal(B, mark)) do
    if e.method == "POST" and e.path == "/v1/sandboxes" then creates[#creates + 1] = e end
  end
  return r, summary, creates
end

local CREATE_FOUR = [[
local render = require "moonbox.render"
local a <close> = render.sandboxes.create {}
local b <close> = render.sandboxes.create {}
local c <close> = render.sandboxes.create {}
local d <close> = render.sandboxes.create {}
]]

describe("a sandbox-count budget", function()
  it("refuses the create beyond it before sending it, naming the budget and the ids", T.async(function()
    local r, summary, creates = run(CREATE_FOUR, "--max-sandboxes", "2")
    assert.are.equal(1, r.code, r.stderr)
    assert.are.equal(2, #creates)
    assert.matches(
      ":4: render.budget: this run's budget of 2 sandboxes is spent %(created: sbx%-%w+, sbx%-%w+%); " ..
      "the create was not sent %[code budget_exceeded%]", r.stderr)
    assert.are.same({ "budget_exceeded", "sandboxes" }, { summary.errors[1].code, summary.errors[1].budget })
    assert.are.same({ sandboxes = 2, sandbox_seconds = json.null, exceeded = "sandboxes" }, summary.budget)
    assert.are.equal(2, #summary.sandboxes.created)
    assert.are.same(summary.sandboxes.created, summary.sandboxes.terminated)
    assert.are.same({}, runs.live(B))
  end))

  it("counts a create the backend refused for sure as not made", T.async(function()
    local r, _, creates = run([[
local render = require "moonbox.render"
local ok, err = pcall(render.sandboxes.create, { plan = "no-such-plan" })
assert(not ok and err.status == 400, tostring(err))
local a <close> = render.sandboxes.create {}
print("made", a.id)
]], "--max-sandboxes", "1")
    assert.are.equal(0, r.code, r.stderr)
    assert.are.equal(2, #creates)
    assert.matches("made%s+sbx%-", r.stdout)
  end))

  it("is lowered by render.budget in the recipe, never raised", T.async(function()
    local lower = "require('moonbox.render').budget { sandboxes = 1 }\n" .. CREATE_FOUR
    local r, _, creates = run(lower, "--max-sandboxes", "3")
    assert.are.equal(1, r.code)
    assert.are.equal(1, #creates)
    local higher = "require('moonbox.render').budget { sandboxes = 10 }\n" .. CREATE_FOUR
    r, _, creates = run(higher, "--max-sandboxes", "3")
    assert.are.equal(1, r.code)
    assert.are.equal(3, #creates)
    assert.matches("budget of 3 sandboxes is spent", r.stderr)
    local alone = "require('moonbox.render').budget { sandboxes = 2 }\n" .. CREATE_FOUR
    r, _, creates = run(alone)
    assert.are.equal(1, r.code)
    assert.are.equal(2, #creates)
    assert.are.same({}, runs.live(B))
  end))

  it("stops a fan-out at the budget, and all_or_nothing terminates what it made", T.async(function()
    local r, _, creates = run([[
local render = require "moonbox.render"
local snap
do
  local src <close> = render.sandboxes.create {}
  snap = src:snapshot {}
end
local fleet <close> = render.restore(snap, { count = 6, concurrency = 2 })
]], "--max-sandboxes", "4")
    assert.are.equal(1, r.code, r.stderr)
    assert.are.equal(4, #creates)
    assert.matches("budget_exceeded", r.stderr)
    assert.are.same({}, runs.live(B))
  end))

  it("refuses bad limits with a usage error or a recipe error", T.async(function()
    local r = home:moonbox("run", "--max-sandboxes", "lots", home:recipe("print(1)"))
    assert.are.equal(2, r.code)
    assert.matches("%-%-max%-sandboxes wants a whole number", r.stderr)
    r = home:moonbox("run", home:recipe("require('moonbox.render').budget { sandbox = 3 }"))
    assert.are.equal(1, r.code)
    assert.matches(":1: render.budget: unknown option `sandbox` (did you mean `sandboxes`?)", r.stderr, 1, true)
  end))
end)

describe("a sandbox-seconds budget", function()
  it("terminates what still runs when the seconds are spent and fails the run", T.async(function()
    local r, summary = run([[
local render = require "moonbox.render"
local task = require "moonbox.task"
local a <close> = render.sandboxes.create {}
local b <close> = render.sandboxes.create { plan = "2c-4g" }
task.sleep(600)
print("not reached")
]], "--max-sandbox-seconds", "2")
    assert.are.equal(1, r.code, r.stderr)
    assert.is_nil(r.stdout:find("not reached", 1, true))
    assert.matches(":5: render.budget: this run's budget of 2 sandbox%-seconds is spent %([%d.]+ s over 2 " ..
      "sandboxes%); terminated the 2 still running: sbx%-%w+, sbx%-%w+ %[code budget_exceeded%]", r.stderr)
    assert.are.equal("sandbox_seconds", summary.budget.exceeded)
    assert.is_true(summary.sandbox_seconds >= 2, json.encode(summary))
    assert.is_number(summary.sandbox_seconds_by_plan["1c-2g"])
    assert.is_number(summary.sandbox_seconds_by_plan["2c-4g"])
    assert.are.same({}, runs.live(B))
  end))

  it("reports sandbox-seconds per plan in --json even without a budget", T.async(function()
    local r, summary = run([[
local render = require "moonbox.render"
do local a <close> = render.sandboxes.create { plan = "4c-8g" } end
]])
    assert.are.equal(0, r.code, r.stderr)
    assert.are.same({ "4c-8g" }, (function()
      local plans = {}
      for p in pairs(summary.sandbox_seconds_by_plan) do plans[#plans + 1] = p end
      return plans
    end)())
    assert.are.same({ sandboxes = json.null, sandbox_seconds = json.null, exceeded = json.null },
      summary.budget)
  end))
end)

describe("moonbox run --json and --dry-run --json", function()
  -- The JSON type of v, as the summaries' readers see it ("array" and "object" apart).
  local function kind(v)
    if type(v) ~= "table" then return v == json.null and "null" or type(v) end
    return json.is_array(v) and "array" or "object"
  end
  -- Every key path of a (objects walked, arrays and by-plan maps as leaves) → its kind.
  local function shape(a, prefix, out)
    out = out or {}
    for k, v in pairs(a) do
      local path = (prefix or "") .. k
      if kind(v) == "object" and not k:find("_by_plan$") then shape(v, path .. ".", out)
      else out[path] = kind(v) end
    end
    return out
  end

  it("name the same facts the same way: every key of the run's summary, same shape, in the dry run's",
    T.async(function()
      local recipe = [[
local render = require "moonbox.render"
local sb <close> = render.sandboxes.create { network = "deny-all" }
sb:exec("echo hi"):check()
sb:snapshot { name = "same-keys" }
]]
      local r, real = run(recipe)
      assert.are.equal(0, r.code, r.stderr)
      local d, dry = run(recipe, "--dry-run")
      assert.are.equal(0, d.code, d.stderr)
      assert.are.same({ false, true }, { real.dry_run, dry.dry_run })
      local want, got = shape(real), shape(dry)
      local differ = {}
      for path, k in pairs(want) do
        if got[path] ~= k then differ[#differ + 1] = path .. ": " .. k .. " vs " .. tostring(got[path]) end
      end
      table.sort(differ)
      assert.are.same({}, differ)
      assert.are.equal(1, #real.sandboxes.created)
      assert.are.equal(1, #dry.sandboxes.created)
      assert.are.same(real.sandboxes.created, real.sandboxes.terminated)
      assert.are.same(dry.sandboxes.created, dry.sandboxes.terminated)
      assert.is_number(real.sandbox_seconds_by_plan["1c-2g"])
      assert.is_number(dry.sandbox_seconds_by_plan["1c-2g"])
    end))
end)
