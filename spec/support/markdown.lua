-- Markdown tables, as the specs that hold the manual to the code read them (render_errors_spec:
-- the error-code tables; schema_spec: the options tables).
local M = {}

--- M.cells(line) -> the cells of a table row ("| a | `b\|c` |" -> {"a", "`b|c`"}), trimmed, an
-- escaped "\|" kept as "|"; nil for a line that is not a row. Does not yield.
function M.cells(line)
  local out = {}
  local body = line:match("^%s*|(.*)|%s*$")
  if not body then return nil end
  body = body:gsub("\\|", "\0")
  for c in (body .. "|"):gmatch("([^|]*)|") do
    out[#out + 1] = (c:gsub("%z", "|"):gsub("^%s+", ""):gsub("%s+$", ""))
  end
  return out
end

--- M.tables(text) -> every table of a markdown text: {header = {...}, rows = {{...}, ...},
-- line = n (its header's line)}. Does not yield.
function M.tables(text)
  local lines = {}
  for l in text:gmatch("([^\n]*)\n?") do lines[#lines + 1] = l end
  local out, i = {}, 1
  while i < #lines do
    local head, sep = M.cells(lines[i]), lines[i + 1]
    if head and sep:match("^%s*|[%s%-:|]+$") then
      local t = { header = head, rows = {}, line = i }
      i = i + 2
      while i <= #lines and M.cells(lines[i]) do
        t.rows[#t.rows + 1] = M.cells(lines[i])
        i = i + 1
      end
      out[#out + 1] = t
    else
      i = i + 1
    end
  end
  return out
end

return M
