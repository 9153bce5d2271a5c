--- moonbox.path — path arithmetic shared by the Render client, the ledger and the local backend.
local M = {}

--- path.clean(p) -> p cleaned exactly as Go's path.Clean does (docs/wire.md, "File tokens": Render
-- refuses any path that this would change). "" cleans to ".".
function M.clean(p)
  if p == "" then return "." end
  local rooted = p:sub(1, 1) == "/"
  local out = {}
  for seg in p:gmatch("[^/]+") do
    if seg == ".." then
      if #out > 0 and out[#out] ~= ".." then
        out[#out] = nil
      elseif not rooted then
        out[#out + 1] = ".."
      end
    elseif seg ~= "." then
      out[#out + 1] = seg
    end
  end
  local s = table.concat(out, "/")
  if rooted then return "/" .. s end
  return s == "" and "." or s
end

--- path.state_home() -> moonbox's state directory: $XDG_STATE_HOME/moonbox, else
-- ~/.local/state/moonbox (docs/reference/ledger.md, "What is recorded").
function M.state_home()
  local xdg = os.getenv("XDG_STATE_HOME")
  if xdg and xdg ~= "" then return xdg .. "/moonbox" end
  return (os.getenv("HOME") or "/root") .. "/.local/state/moonbox"
end

return M
