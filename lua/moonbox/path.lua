--- moonbox.path — path arithmetic, where moonbox keeps its state, and reading a small file whole:
-- shared by the Render client, the ledger, the local backend and the specs.
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

--- path.read_file(p) -> the whole content of file p, or nil when it cannot be opened (missing,
-- unreadable): the caller decides whether that is an error. Raises only on a read error after
-- the open.
function M.read_file(p)
  local f = io.open(p, "rb")
  if not f then return nil end
  local s, err = f:read("a")
  f:close()
  if not s then error("cannot read " .. p .. ": " .. tostring(err), 0) end
  return s
end

return M
