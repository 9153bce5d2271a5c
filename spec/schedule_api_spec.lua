-- moonbox.schedule's recipe API: durations, eager validation with the recipe's file:line and the
-- schedule's name, duplicate names, and schedule.running() outside `moonbox schedule`.
local schedule = require "moonbox.schedule"
local clock = require "moonbox.schedule.clock"

local function noop() end

describe("schedule.duration", function()
  it("reads seconds and unit strings", function()
    assert.are.equal(90, schedule.duration("90s"))
    assert.are.equal(900, schedule.duration("15m"))
    assert.are.equal(5400, schedule.duration("1h30m"))
    assert.are.equal(172800, schedule.duration("2d"))
    assert.are.equal(5400, schedule.duration("1.5h"))
    assert.are.equal(42, schedule.duration(42))
  end)

  it("refuses what is not a duration, saying what it expected", function()
    for _, bad in ipairs { "15", "m", "10x", "", -1, true } do
      local d, msg = schedule.duration(bad)
      assert.is_nil(d)
      assert.is_string(msg)
    end
  end)
end)

describe("schedule.every and schedule.cron", function()
  before_each(function() schedule._reset() end)
  after_each(function() schedule._reset() end)

  it("register schedules in order and never fire outside moonbox schedule", function()
    schedule.every("a", "15m", noop)
    schedule.every("b", 60, noop, { overlap = "buffer_one", catchup = false, jitter = "10s", timeout = "5m",
      pause_after_failures = 3 })
    local l = schedule.list()
    assert.are.equal(2, #l)
    assert.are.equal("a", l[1].name)
    assert.are.equal(false, l[2].catchup)
    assert.are.equal(300, l[2].timeout)
    assert.is_false(l[2].durable)
    assert.is_true(schedule.every("c", "1m", noop, { durable = true }).durable)
    assert.is_false(schedule.running())
  end)

  it("raise at the recipe's line, naming the schedule", function()
    local function recipe_line()
      local s = schedule.every("bad-overlap", "1m", noop, { overlap = "queue" })
      return s
    end
    local line = debug.getinfo(1, "l").currentline - 3
    local ok, err = pcall(recipe_line)
    assert.is_false(ok)
    assert.are.equal("invalid_option", err.code)
    assert.are.equal("overlap", err.option)
    assert.matches("schedule_api_spec.lua:" .. line .. ": schedule.every: schedule 'bad%-overlap': option `overlap` " ..
      "must be one of", tostring(err))
  end)

  it("refuse duplicate names, unknown options, bad durations and bad counts", function()
    schedule.every("dup", "1m", noop)
    local cases = {
      { function() schedule.every("dup", "1m", noop) end, "already registered" },
      { function() schedule.every("x", "1m", noop, { overlaps = "skip" }) end, "unknown option `overlaps` %(did you mean `overlap`%?%)" },
      { function() schedule.every("x", "soon", noop) end, "interval: expected a duration" },
      { function() schedule.every("x", "1m", noop, { timeout = "5 minutes" }) end, "option `timeout` must be seconds" },
      { function() schedule.every("x", "1m", noop, { pause_after_failures = 0 }) end, "pause_after_failures must" },
      { function() schedule.every("x", "1m", noop, { jitter = "2m" }) end, "jitter %(2m%) must be shorter" },
      { function() schedule.every("x", "1m", "not a function") end, "expected a function" },
      { function() schedule.every("has space", "1m", noop) end, "the name must be" },
      { function() schedule.every("x", "1m", noop, { tz = "UTC" }) end, "tz applies to schedule.cron only" },
      { function() schedule.every("x", "1m", noop, { max_sandboxes = 1.5 }) end,
        "option `max_sandboxes` must be integer" },
      { function() schedule.cron("x", "0 3 * * *", noop, { max_sandbox_seconds = "a while" }) end,
        "option `max_sandbox_seconds` must be seconds" },
      { function() schedule.every("x", "1m", noop, { durable = "yes" }) end, "option `durable` must be boolean" },
      { function() schedule.every("x", "1m", noop, { durabel = true }) end,
        "unknown option `durabel` %(did you mean `durable`%?%)" },
    }
    for _, c in ipairs(cases) do
      local ok, err = pcall(c[1])
      assert.is_false(ok)
      assert.matches(c[2], tostring(err))
      assert.matches("schedule_api_spec.lua:%d+:", err)
    end
  end)

  it("puts every-slots at multiples of the interval since the epoch", function()
    local s = schedule.every("q", "15m", noop)
    local t0 = clock.parse_time("2026-03-01T00:07:30Z")
    assert.are.equal(clock.parse_time("2026-03-01T00:15:00Z"), schedule.next_after(s, t0))
    assert.are.equal(clock.parse_time("2026-03-01T00:30:00Z"),
      schedule.next_after(s, clock.parse_time("2026-03-01T00:15:00Z")))
  end)
end)

describe("the schedule clock", function()
  it("parses and formats RFC 3339 in UTC, whatever the local zone", function()
    local t = clock.parse_time("2026-03-01T00:00:00Z")
    assert.are.equal(1772323200, t)
    assert.are.equal("2026-03-01T00:00:00Z", clock.format(t))
    assert.are.equal(t, clock.parse_time("2026-03-01T01:00:00+01:00"))
    assert.are.equal("2026-03-01T00:00:00.250Z", clock.format(t + 0.25))
  end)

  it("runs a test clock from its start at its scale, and refuses a malformed one", function()
    local c = clock.from_env("start=2026-03-01T00:00:00Z,scale=600")
    assert.is_true(c.test)
    assert.is_true(c:now() >= 1772323200)
    assert.are.equal(1, c:real_seconds(600))
    assert.has_error(function() clock.from_env("start=yesterday") end)
    assert.has_error(function() clock.from_env("scale=0") end)
  end)
end)
