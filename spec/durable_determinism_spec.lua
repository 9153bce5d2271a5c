-- Determinism is checked, not assumed (issue 25, the third "Done when";
-- docs/reference/durable.md, "Rules of a durable recipe"): a durable recipe SIGKILLed by itself
-- at a named point (die_if: the point does not depend on how many journal writes a run makes) and
-- then edited before its resume — a changed exec command, an added call, a removed call, a
-- changed create option — fails on resume with `nondeterminism` naming both calls (the journaled
-- one with its line, the new one with the recipe's file:line); a sandbox terminated behind the
-- run's back (through the backend's API, between the crash and the resume) gives `lost_sandbox`
-- naming its id. Either way the failed resume ends the run (`failed`: a further resume is
-- refused) and leaves nothing running: the sandboxes the recipe reached are terminated by their
-- guards, the ones it never reached by the resume itself, and the ledger holds nothing.
--
-- (ctest runs this spec twice: its journal in SQLite, then in PostgreSQL —
-- spec_durable_determinism_pg)
local T = require "moonbox.testing"
local runs = require "spec.support.runs"
local D = require "spec.support.durable"
local S = require "spec.support.store_env"

local B, home

runs.fixture(setup, teardown, function(b, h) B, home = b, h end)
teardown(T.async(function()
  S.shutdown()
end))

-- The recipe's lines after the prelude; line numbers below count from the prelude's end.
local _, PRELUDE_LINES = D.PRELUDE:gsub("\n", "")

local BASE = {
  [[local sb <close> = render.sandboxes.create { network = "deny-all", lifetime = 600 }]],
  [[print("sb " .. sb.id) io.stdout:flush()]],
  [[sb:exec("echo one >> /root/log"):check()]],
  [[local other <close> = render.sandboxes.create { network = "deny-all", lifetime = 600 }]],
  [[print("other " .. other.id) io.stdout:flush()]],
  [[die_if("after the first calls")]],
  [[sb:exec("echo two >> /root/log"):check()]],
  [[print("done")]],
}

local function text(lines) return D.PRELUDE .. table.concat(lines, "\n") .. "\n" end

local function write(path, s)
  local f = assert(io.open(path, "w"))
  f:write(s)
  f:close()
end

-- Runs the base recipe durably under run id key with CRASH at its die_if (it must die there),
-- and returns the recipe's path and the ids it printed ({sb =, other =}). [yields]
local function crash(key)
  local recipe = home:recipe(text(BASE))
  local mark = runs.last_seq(B)
  local first = D.moonbox(home, { CRASH = "after the first calls" }, "run", "--durable", "--run-id", key, recipe)
  assert(first.signal == "KILL", key .. ": the first attempt did not die at its die_if: exit " ..
    tostring(first.code) .. "\n" .. first.stdout .. first.stderr)
  local ids = {}
  for name, id in first.stdout:gmatch("(%a+) (sbx%-%w+)") do ids[name] = id end
  assert(ids.sb and ids.other, key .. ": the first attempt printed no ids:\n" .. first.stdout)
  S.after_kill()
  runs.settled(B, mark)
  return recipe, ids, mark
end

-- Resumes run key (it must fail, exit 1), then checks it ended: nothing is left running and a
-- second resume is refused as ended, failed. -> the resume's stderr. [yields]
local function resume_fails(key, mark)
  local r = D.moonbox(home, {}, "run", "--resume", key)
  assert(r.code == 1, key .. ": the resume exited " .. tostring(r.code) .. ", not 1\n" .. r.stdout .. r.stderr)
  D.check_nothing_left(B, home, key .. ": after the failed resume", mark)
  local again = D.moonbox(home, {}, "run", "--resume", key)
  assert(again.code == 1 and again.stderr:find("has ended (failed)", 1, true),
    key .. ": a second resume was not refused as ended, failed: exit " .. tostring(again.code) .. "\n" .. again.stderr)
  return r.stderr
end

-- The edits: each changes the calls the recipe makes before it goes live again. line: the
-- edited recipe's line (after the prelude) of the new call; old: the base recipe's line of the
-- journaled call it meets; got and expected: what the message shows of each.
local EDITS = {
  { name = "a changed exec command", line = 3, old = 3, got = "echo ONE >> /root/log", expected = "echo one >> /root/log",
    edit = function(l) l[3] = [[sb:exec("echo ONE >> /root/log"):check()]] end },
  { name = "an added call", line = 3, old = 3, got = "sandboxes.get GET /sandboxes/", expected = "sandbox:exec",
    edit = function(l) table.insert(l, 3, [[sb:refresh()]]) end },
  { name = "a removed call", line = 3, old = 3, got = "sandboxes.create POST /sandboxes",
    expected = "sandbox:exec", edit = function(l) table.remove(l, 3) end },
  { name = "a changed create option", line = 4, old = 4, got = '"timeoutSeconds":900',
    expected = '"timeoutSeconds":600',
    edit = function(l) l[4] = l[4]:gsub("lifetime = 600", "lifetime = 900") end },
}

describe("a durable run resumed", function()
  for i, e in ipairs(EDITS) do
    it("after " .. e.name .. " fails with nondeterminism naming both calls, and leaves nothing running",
      T.async(function()
      local key = "edit-" .. i
      local recipe, _, mark = crash(key)
      local lines = table.move(BASE, 1, #BASE, 1, {})
      e.edit(lines)
      write(recipe, text(lines))
      local err = resume_fails(key, mark)
      local what = key .. " (" .. e.name .. "): "
      assert(err:find("nondeterminism", 1, true), what .. "not nondeterminism:\n" .. err)
      -- the new call, at the edited recipe's file:line
      local at = recipe .. ":" .. (PRELUDE_LINES + e.line)
      assert(err:find("the recipe's call at " .. at .. ", ", 1, true), what .. "does not name " .. at .. ":\n" .. err)
      assert(err:find(e.got, 1, true), what .. "does not show the new call (" .. e.got .. "):\n" .. err)
      -- the journaled call, with the line the first attempt made it at
      local old = recipe .. ":" .. (PRELUDE_LINES + e.old)
      assert(err:find("is not the journal's next call in this task, ", 1, true), what .. err)
      assert(err:find(e.expected, 1, true), what .. "does not show the journaled call (" .. e.expected .. "):\n" .. err)
      assert(err:find("(made at " .. old .. ")", 1, true), what .. "does not name the journaled call's line " ..
        old .. ":\n" .. err)
    end))
  end

  for _, which in ipairs { "sb", "other" } do
    it("after its sandbox `" .. which .. "` was terminated behind its back fails with lost_sandbox naming it",
      T.async(function()
      local key = "lost-" .. which
      local recipe, ids, mark = crash(key)
      local s = B:req("POST", "/v1/sandboxes/" .. ids[which] .. "/terminate")
      assert(s == 204, key .. ": terminating " .. ids[which] .. " answered " .. tostring(s))
      local err = resume_fails(key, mark)
      assert(err:find("lost_sandbox", 1, true), key .. ": not lost_sandbox:\n" .. err)
      assert(err:find("sandbox " .. ids[which] .. ", which this run created at " .. recipe .. ":", 1, true),
        key .. ": does not name " .. ids[which] .. " and where it was created:\n" .. err)
      local survivor = which == "sb" and ids.other or ids.sb
      assert(not err:find("sandbox " .. survivor .. ", which", 1, true), key .. ": names " .. survivor .. " lost:\n" .. err)
      -- raised at the first call past the journal: the wait for `other` to run (its polls are
      -- journaled lazily, with the next write, which the crash never made), or the second exec
      local line = tonumber(err:match("failed: " .. recipe:gsub("%p", "%%%0") .. ":(%d+): durable: sandbox "))
      assert(line == PRELUDE_LINES + 4 or line == PRELUDE_LINES + 7, key .. ": raised at line " .. tostring(line) ..
        ", not at the first call past the journal (" .. (PRELUDE_LINES + 4) .. " or " .. (PRELUDE_LINES + 7) ..
        "):\n" .. err)
    end))
  end
end)
