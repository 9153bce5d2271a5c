--- moonbox.local.check — `moonbox local --check`: verifies the snapshots of a state directory.
--
-- Every layer of every available snapshot is read in full (contents and xattrs too) and compared
-- with the manifest its capture wrote (moonbox.local.engine.verify_layer, full); a runtime
-- snapshot's /dev capture is looked for. One line per snapshot, then a summary. It takes the
-- state directory's lock, so it never reads layers a serving backend is changing, and refuses
-- while a backend holds it. It changes nothing: a snapshot found damaged is reported, and the
-- backend marks it failed when a restore meets it.
local sys = require "moonbox.sys"
local host = require "moonbox.local.engine.host"
local engine = require "moonbox.local.engine"
local State = require "moonbox.local.state"

local M = {}

local function name_of(path) return path:match("[^/]*$") end

-- The available snapshots, oldest first.
local function available(st)
  local out = {}
  for _, s in pairs(st.snapshots) do
    if s.status == "available" and not s._deleted then out[#out + 1] = s end
  end
  table.sort(out, function(a, b) return a._seq < b._seq end)
  return out
end

--- check.run(state_dir, print) -> exit status (0: every snapshot matches; 1: some do not, or the
-- check could not run: print has said why). print(line) receives each line of the report.
-- [yields]
function M.run(state_dir, print)
  if not host.exists(state_dir .. "/local.db") then
    print("moonbox local --check: no moonbox local state in " .. state_dir .. " (no local.db)")
    return 1
  end
  local lock = sys.try_lock(state_dir .. "/backend.lock", "exclusive")
  if not lock then
    local f = io.open(state_dir .. "/endpoint")
    local endpoint = f and f:read("l")
    if f then f:close() end
    print("moonbox local --check: a moonbox local serves " .. state_dir ..
      (endpoint and (" (at " .. endpoint:match("^(%S+)") .. ")") or "") ..
      "; stop it first (the check reads layers that backend may be changing)")
    return 1
  end
  local st = State.open(state_dir .. "/local.db")
  local ok, code = pcall(function()
    local results = {} -- layer path -> {res, why, code} (a layer shared by several snapshots is read once)
    local counts = { ok = 0, bad = 0, legacy = 0, layers = 0 }
    local snaps = available(st)
    for _, snap in ipairs(snaps) do
      local problem, files, bytes, legacy = nil, 0, 0, false
      for _, l in ipairs(snap._layers or {}) do
        local r = results[l]
        if not r then
          local vok, res, why, vcode = pcall(engine.verify_layer, l, { full = true })
          r = vok and { res = res, why = why, code = vcode } or { why = tostring(type(res) == "table" and
            res.message or res), code = "error" }
          results[l] = r
          counts.layers = counts.layers + 1
        end
        if r.res then
          files, bytes = files + (r.res.files or 0), bytes + (r.res.bytes or 0)
        elseif r.code == "no_manifest" then
          local owner = st.snapshots[name_of(l)]
          if owner and owner._manifest then
            problem = r.why
          else
            legacy = true -- captured before layers had manifests: only its presence is known
          end
        else
          problem = r.why
        end
        if problem then break end
      end
      if not problem and snap._dev_records and not host.exists(snap._dev_records) then
        problem = "its /dev capture is gone"
      end
      if problem then
        counts.bad = counts.bad + 1
        print(string.format("%s MISMATCH: %s", snap.id, problem))
      else
        counts.ok = counts.ok + 1
        if legacy then counts.legacy = counts.legacy + 1 end
        print(string.format("%s ok: %d files, %d bytes in %d layer%s%s", snap.id, files, bytes,
          #(snap._layers or {}), #(snap._layers or {}) == 1 and "" or "s",
          legacy and " (some captured before manifests: present, not verified)" or ""))
      end
    end
    print(string.format("%d snapshot%s checked (%d layer%s): %d ok, %d mismatched%s", #snaps,
      #snaps == 1 and "" or "s", counts.layers, counts.layers == 1 and "" or "s", counts.ok, counts.bad,
      counts.legacy > 0 and (", " .. counts.legacy .. " not fully verifiable (no manifest)") or ""))
    return counts.bad > 0 and 1 or 0
  end)
  st:close()
  lock:unlock()
  if not ok then
    print("moonbox local --check: " .. tostring(type(code) == "table" and code.message or code))
    return 1
  end
  return code
end

return M
