--- moonbox.options — the nearest known name to a misspelt one.
--
-- moonbox.schema checks every public call's options against its declaration and, for an
-- unknown option, names the nearest valid one ("did you mean `network`?") with this.
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
-- than half its length; one edit for a name of two or three characters), or nil.
function M.nearest(name, known)
  local best, best_d = nil, math.huge
  local cap = math.min(2, (#name - 1) // 2)
  if #name >= 2 and cap < 1 then cap = 1 end
  local names = {}
  for k in pairs(known) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do
    local d = distance(name, k, cap)
    if d < best_d then best, best_d = k, d end
  end
  return best
end

return M
