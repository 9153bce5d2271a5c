--- spec/support/ustar.lua — writes tar archives no well-behaved tar would produce (absolute
-- names, `..`, links out of the tree, device nodes), for specs that check they are refused.
-- Members are plain ustar headers computed here, so a spec states exactly what it sends.
local M = {}

M.O644 = tonumber("644", 8)
M.O755 = tonumber("755", 8)

--- ustar.member(m) -> the bytes of one member. m: name, type ("0" file, "1" hard link, "2"
-- symlink, "3" character device, "4" block device, "5" directory, "6" fifo), link, data, mode,
-- uid, gid (0), mtime (1700000000), major, minor. Raises when a name does not fit its header
-- field.
function M.member(m)
  local function field(s, n)
    s = s or ""
    assert(#s <= n, "ustar field too long: " .. s)
    return s .. ("\0"):rep(n - #s)
  end
  local function num(v, n) return ("%0" .. (n - 1) .. "o"):format(v) .. "\0" end
  local data = m.data or ""
  local h = field(m.name, 100) .. num(m.mode or M.O644, 8) .. num(m.uid or 0, 8) .. num(m.gid or 0, 8)
    .. num(#data, 12) .. num(m.mtime or 1700000000, 12) .. ("        ") .. (m.type or "0")
    .. field(m.link, 100) .. "ustar\0" .. "00" .. field("root", 32) .. field("root", 32)
    .. num(m.major or 0, 8) .. num(m.minor or 0, 8) .. field("", 155) .. field("", 12)
  assert(#h == 512)
  local sum = 0
  for i = 1, 512 do sum = sum + h:byte(i) end
  h = h:sub(1, 148) .. ("%06o\0 "):format(sum) .. h:sub(157)
  return h .. data .. ("\0"):rep((512 - #data % 512) % 512)
end

--- ustar.archive(members) -> the bytes of a whole (uncompressed) tar of those members.
function M.archive(members)
  local parts = {}
  for i, m in ipairs(members) do parts[i] = M.member(m) end
  parts[#parts + 1] = ("\0"):rep(1024)
  return table.concat(parts)
end

return M
