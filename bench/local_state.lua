-- bench/local_state.lua — how `moonbox local` behaves as its history grows, measured from a
-- client process over HTTP against real backend processes (issue 13, the backend's part):
--   * list page time (GET /v1/sandboxes?limit=1 and ?status=terminated&limit=20, median of
--     LIST_N requests) on a fresh state against one holding SEED terminated sandbox records;
--   * the backend's CPU while idle (utime + stime from /proc/PID/stat over IDLE_SECONDS), with
--     no sandbox and with one running sandbox;
--   * the backend's RSS after 100 and after LIVES real sandbox lifecycles (create, exec `true`,
--     terminate), and the CPU one lifecycle costs the host: the backend's own utime + stime plus
--     cutime + cstime (every helper, keeper, init and sandbox process it started and reaped).
-- The SEED terminated records are written straight into the state database through
-- moonbox.local.state while no backend runs (SEED real lifecycles would take many minutes on
-- this machine); the real lifecycles of the last part check the same behaviour the slow way.
-- Run: build/moonbox run bench/local_state.lua [OUT.md]   (root, like moonbox local)
-- Environment: SEED (10000), LIST_N (300), IDLE_SECONDS (60), LIVES (1000).
local core = require "moonbox.core"
local ids = require "moonbox.ids"
local json = require "moonbox.json"
local State = require "moonbox.local.state"
local L = require "spec.support.local_backend"
local measure = require "bench.support.measure"

local out_file = arg and arg[1]
local SEED = tonumber(os.getenv("SEED")) or 10000
local LIST_N = tonumber(os.getenv("LIST_N")) or 300
local IDLE = tonumber(os.getenv("IDLE_SECONDS")) or 60
local LIVES = tonumber(os.getenv("LIVES")) or 1000
local report = measure.report()
local function row(...) report:row(...) end

local median, stat = measure.median, measure.proc_stat

local function page_ms(B, query)
  local t = {}
  for _ = 1, 30 do B:req("GET", "/v1/sandboxes", { query = query }) end -- warm-up
  for i = 1, LIST_N do
    local t0 = core.now()
    local s = B:req("GET", "/v1/sandboxes", { query = query })
    t[i] = core.now() - t0
    assert(s == 200, "list failed: " .. s)
  end
  return median(t) * 1000
end

local lifecycle = measure.life

local function lists(B, label)
  local a = page_ms(B, { limit = 1 })
  local b = page_ms(B, { status = "terminated", limit = 20 })
  row("GET /v1/sandboxes?limit=1, " .. label, string.format("%.3f ms", a), "median of " .. LIST_N)
  row("GET /v1/sandboxes?status=terminated&limit=20, " .. label, string.format("%.3f ms", b), "")
  return a, b
end

-- 1. list pages: a fresh state (one full page of 20 terminated records besides the one a real
-- lifecycle left, so both states answer the same pages), then SEED terminated records.
local function seed(state, n)
  local st = State.open(state .. "/local.db")
  local proto
  for row_ in st.db:each("SELECT doc FROM records WHERE kind = 'sandbox'") do proto = json.decode(row_.doc) end
  st.db:run("BEGIN")
  for _ = 1, n do
    local rec = {}
    for k, v in pairs(proto) do rec[k] = v end
    rec.id, rec._seq = ids.new("sbx"), nil
    st:save("sandbox", rec)
  end
  st.db:run("COMMIT")
  st:close()
end
local B = L.start()
lifecycle(B) -- makes the default group and one terminated record to copy
B:stop()
seed(B.state, 20)
B = L.start { state = B.state }
local fa, fb = lists(B, "fresh state (21 records)")
B:stop()
seed(B.state, SEED - 20)
B = L.start { state = B.state }
local sa, sb = lists(B, SEED .. " terminated records")
row("ratio limit=1, seeded / fresh", string.format("%.2f×", sa / fa), "goal ≤ 1.2×")
row("ratio status=terminated, seeded / fresh", string.format("%.2f×", sb / fb), "goal ≤ 1.2×")

-- 2. idle CPU
local function idle_cpu(label)
  core.sleep(2)
  local a = stat(B.p.pid)
  core.sleep(IDLE)
  local b = stat(B.p.pid)
  row("idle backend CPU, " .. label, string.format("%.0f ms / %d s", (b.self - a.self) * 1000, IDLE),
    "utime + stime; goal ≤ 10 ms per minute")
end
idle_cpu(SEED .. " terminated records, no sandbox")
local s_, live = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace } })
assert(s_ == 201)
B:wait_status(live.id, "running")
idle_cpu("one running sandbox")
B:req("POST", "/v1/sandboxes/" .. live.id .. "/terminate")
B:destroy()

-- 3. RSS over lifecycles, and CPU per lifecycle
B = L.start()
for _ = 1, 100 do lifecycle(B) end
local at100 = stat(B.p.pid)
local t0 = core.now()
for _ = 101, LIVES do lifecycle(B) end
local wall = core.now() - t0
local atN = stat(B.p.pid)
row("backend RSS after 100 lifecycles", string.format("%.1f MB", at100.rss / 1024),
  string.format("create, exec `true`, terminate; anonymous %.1f MB", at100.anon / 1024))
row("backend RSS after " .. LIVES .. " lifecycles", string.format("%.1f MB", atN.rss / 1024),
  string.format("%+.1f MB; goal within 10 MB; anonymous %.1f MB (%+.1f)", (atN.rss - at100.rss) / 1024,
    atN.anon / 1024, (atN.anon - at100.anon) / 1024))
local n = LIVES - 100
-- The floor: one bare `bwrap --unshare-all` spawn of `true`, CPU of this process's children.
local proc = require "moonbox.proc"
local me0 = stat("self")
for _ = 1, 100 do proc.run { "bwrap", "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "true" } end
local me1 = stat("self")
local floor = (me1.children - me0.children) * 1000 / 100
row("floor: one `bwrap --unshare-all ... true`", string.format("%.1f ms", floor), "CPU of 100 spawns, from this process")
row("host CPU per lifecycle", string.format("%.1f ms", ((atN.self + atN.children) - (at100.self + at100.children))
  * 1000 / n), string.format("backend %.1f ms + its children %.1f ms, over %d lifecycles, %.1f ms wall each",
  (atN.self - at100.self) * 1000 / n, (atN.children - at100.children) * 1000 / n, n, wall * 1000 / n))
row("host CPU per lifecycle / floor", string.format("%.2f×", ((atN.self + atN.children) - (at100.self
  + at100.children)) * 1000 / n / floor), "goal ≤ 3×")
local fa2, fb2 = lists(B, LIVES .. " real lifecycles")
row("ratio limit=1, real history / fresh", string.format("%.2f×", fa2 / fa), "")
row("ratio status=terminated, real history / fresh", string.format("%.2f×", fb2 / fb), "")
B:destroy()

report:finish(out_file)
