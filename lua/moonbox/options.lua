--- moonbox.options — the one check every public call makes of its options table.
--
-- A call given an option it does not know refuses it: a misspelt `netwrok = "deny-all"` must
-- never create an allow-all sandbox without a word. The error names the call, the option, the
-- nearest known name when one is close (a typo) and the recipe line (the level is the caller's).
local M = {}

-- Edit distance (insertions, deletions, substitutions, adjacent swaps) between two short names,
-- or math.huge once it exceeds cap.
local function distance(a, b, cap)
  if math.abs(#a - #b) > cap then return math.huge end
  local prev2, prev = {}, {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    local cur = { [0] = i }
    local best = i
    for j = 1, #b do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      local d = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
      if i > 1 and j > 1 and a:byte(i) == b:byte(j - 1) and a:byte(i - 1) == b:byte(j) then
        d = math.min(d, prev2[j - 2] + 1)
      end
      cur[j] = d
      if d < best then best = d end
    end
    if best > cap then return math.huge end
    prev2, prev = prev, cur
  end
  return prev[#b]
end

--- options.nearest(name, known) -> the known name closest to name (at most 2 edits, and fewer
-- than half its length), or nil.
function M.nearest(name, known)
  local best, best_d = nil, math.huge
  local cap = math.min(2, (#name - 1) // 2)
  local names = {}
  for k in pairs(known) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do
    local d = distance(name, k, cap)
    if d < best_d then best, best_d = k, d end
  end
  return best
end

--- options.check(opts, known, fname[, level]): raises "<fname>: unknown option 'x' (did you
-- mean 'y'?)" for the first key of opts (in sorted order, so the message is stable) that is not
-- in the set known, at the caller's caller's line (level 3 by default: the recipe's call of the
-- public function that called this). opts that is not a table raises too. Returns opts.
function M.check(opts, known, fname, level)
  level = level or 3
  if type(opts) ~= "table" then
    error(fname .. ": options must be a table (got " .. type(opts) .. ")", level)
  end
  local unknown = {}
  for k in pairs(opts) do
    if not known[k] then unknown[#unknown + 1] = tostring(k) end
  end
  if #unknown == 0 then return opts end
  table.sort(unknown)
  local k = unknown[1]
  local near = M.nearest(k, known)
  error(string.format("%s: unknown option '%s'%s", fname, k,
    near and (" (did you mean '" .. near .. "'?)") or ""), level)
end

--- options.union(...) -> a new set with every key of the given sets.
function M.union(...)
  local out = {}
  for i = 1, select("#", ...) do
    for k in pairs((select(i, ...))) do out[k] = true end
  end
  return out
end

return M
