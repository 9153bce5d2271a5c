--- moonbox.local.engine.coreutils — the argv commands moonbox.render's files calls run
-- (sb:remove, sb:mkdir, sb:rename), done in pure Lua over an abstract file system, for an
-- engine that starts no process (the dry run's simulated engine). Exactly this subset:
--
--   mkdir -- P        mkdir -p -- P        rm -d -- P        rm -r -- P        mv -T -- A B
--
-- with GNU coreutils' exit statuses (0, or 1 on failure) and its C-locale messages on stderr
-- ("mkdir: cannot create directory 'P': File exists", ...), names quoted as coreutils quotes
-- them (rm and mv: M.quote; mkdir: M.quote_locale), for the cases moonbox.render maps to typed
-- errors (not_found, exists, not_a_directory, is_a_directory, not_empty, permission_denied)
-- and the few refusals around them (the same file, a directory into itself, `rm -r` of "/",
-- "." or ".."). Any other argv of mkdir/rm/mv is not handled (run returns false): the caller
-- answers it as it answers any command it does not simulate, and it is never run
-- approximately. spec/local_coreutils_spec.lua checks it against the host's coreutils.
--
-- The file system object (the engine's in-memory tree; paths absolute and normalized):
--   fs:lstat(path) -> nil | { type = "file"|"directory"|"symlink", size = n, mtime = t, target = s }
--   fs:children(path) -> array of names (path is a directory)
--   fs:mkdir(path) / fs:remove(path) / fs:rename(from, to) -> true | nil, errno_name
--     errno_name: "ENOENT", "EEXIST", "ENOTDIR", "EISDIR", "ENOTEMPTY", "EACCES"
-- Symlinks are followed here (fs:lstat never follows), at most 40 of them per path as Linux
-- does. Nothing here yields or touches the host.
local M = {}

local TEXT = {
  ENOENT = "No such file or directory", EEXIST = "File exists", ENOTDIR = "Not a directory",
  EISDIR = "Is a directory", ENOTEMPTY = "Directory not empty", EACCES = "Permission denied",
  ELOOP = "Too many levels of symbolic links",
}

local MAX_LINKS = 40

-- ---- quoting ------------------------------------------------------------------------------------

-- Bytes coreutils writes as themselves inside '...' and inside "..." alike (the "compatible"
-- set of gnulib's quotearg): letters, digits, space and %+,-./:@]_.
local COMPAT = "^[%w %%+,%-%./:@%]_]$"
local C_ESCAPES = { ["\a"] = "a", ["\b"] = "b", ["\f"] = "f", ["\n"] = "n", ["\r"] = "r", ["\t"] = "t",
  ["\v"] = "v" }

--- coreutils.quote(name) -> name as GNU coreutils shows it in a C-locale message (gnulib's
-- shell-escape-always quoting): 'name'; bytes that are not printable ASCII as $'\n' / $'\377'
-- segments; a single quote as '\''; a name whose only oddities are single quotes (and bytes of
-- the compatible set) in double quotes instead.
function M.quote(s)
  local out, pending, quote_seen, all_compat = { "'" }, false, false, true
  for i = 1, #s do
    local c = s:sub(i, i)
    local b = c:byte()
    if c == "'" then
      quote_seen = true
      out[#out + 1] = "'\\''"
      pending = false
    elseif b < 0x20 or b >= 0x7f then
      all_compat = false
      if not pending then
        out[#out + 1] = "'$'"
        pending = true
      end
      out[#out + 1] = "\\" .. (C_ESCAPES[c] or string.format("%03o", b))
    else
      if not c:find(COMPAT) then all_compat = false end
      if pending then
        out[#out + 1] = "''"
        pending = false
      end
      out[#out + 1] = c
    end
  end
  if quote_seen and all_compat then return '"' .. s .. '"' end
  out[#out + 1] = "'"
  local q = table.concat(out)
  -- gnulib's quirk, reproduced: a name holding a single quote after its first byte and ending in
  -- an escaped byte comes out with two more quotes in front.
  if quote_seen and s:sub(1, 1) ~= "'" and pending then q = "''" .. q end
  return q
end

--- coreutils.quote_locale(name) -> name as mkdir shows it in a C-locale message (gnulib's
-- locale quoting): '...' with C escapes inside (\n, \t, ..., \\ for a backslash, \' for a
-- single quote, \ooo for other bytes that are not printable ASCII).
function M.quote_locale(s)
  return "'" .. s:gsub("[%c\\'\127-\255]", function(c)
    if c == "\\" or c == "'" then return "\\" .. c end
    return "\\" .. (C_ESCAPES[c] or string.format("%03o", c:byte()))
  end) .. "'"
end

-- ---- paths --------------------------------------------------------------------------------------

local function split(p)
  local parts = {}
  for part in p:gmatch("[^/]+") do parts[#parts + 1] = part end
  return parts
end

-- The absolute, lexically normalized form of p (relative to cwd).
local function absolute(p, cwd)
  if p:sub(1, 1) ~= "/" then p = cwd .. "/" .. p end
  local out = {}
  for _, part in ipairs(split(p)) do
    if part == ".." then out[#out] = nil
    elseif part ~= "." then out[#out + 1] = part end
  end
  return "/" .. table.concat(out, "/")
end

local function join(dir, name) return dir == "/" and "/" .. name or dir .. "/" .. name end

local function dirname(p) return p:match("^(.*)/[^/]*$") ~= "" and p:match("^(.*)/[^/]*$") or "/" end

--- resolve(fs, abs, follow_last) -> real path, its lstat (nil when nothing is there) | nil,
-- errno: walks abs component by component from "/", following every symlink on the way (and
-- the last one when follow_last). A missing or non-directory component before the last is
-- ENOENT / ENOTDIR.
local function resolve(fs, abs, follow_last, hops)
  hops = hops or 0
  local parts = split(abs)
  local cur = "/"
  for i, part in ipairs(parts) do
    local last = i == #parts
    local p = join(cur, part)
    local st = fs:lstat(p)
    if st and st.type == "symlink" and (not last or follow_last) then
      hops = hops + 1
      if hops > MAX_LINKS then return nil, "ELOOP" end
      local t = st.target or ""
      local target = t:sub(1, 1) == "/" and absolute(t, "/") or absolute(t, cur)
      local real, rst = resolve(fs, target, true, hops)
      if not real then return nil, rst end
      p, st = real, rst
    end
    if last then return p, st end
    if not st then return nil, "ENOENT" end
    if st.type ~= "directory" then return nil, "ENOTDIR" end
    cur = p
  end
  return "/", fs:lstat("/") or { type = "directory" }
end

-- ---- the commands -------------------------------------------------------------------------------

local function failure(lines) return true, 1, "", table.concat(lines, "\n") .. "\n" end

local function mkdir(fs, p, parents, cwd)
  local prefix = "mkdir: cannot create directory "
  if not parents then
    local real, st = resolve(fs, absolute(p, cwd), false)
    if not real then return failure { prefix .. M.quote_locale(p) .. ": " .. TEXT[st] } end
    if st then return failure { prefix .. M.quote_locale(p) .. ": " .. TEXT.EEXIST } end
    local ok, e = fs:mkdir(real)
    if not ok then return failure { prefix .. M.quote_locale(p) .. ": " .. TEXT[e] } end
    return true, 0, "", ""
  end
  local parts = split(p)
  local written = p:sub(1, 1) == "/" and "/" or ""
  for i, part in ipairs(parts) do
    written = written .. (i > 1 and "/" or "") .. part
    local last = i == #parts
    local abs = absolute(written, cwd)
    local real, st = resolve(fs, abs, false)
    if not real then return failure { prefix .. M.quote_locale(written) .. ": " .. TEXT[st] } end
    if not st then
      local made, e = fs:mkdir(real)
      if not made then return failure { prefix .. M.quote_locale(written) .. ": " .. TEXT[e] } end
    else
      if st.type == "symlink" then
        -- mkdir says EEXIST; coreutils then stats through the link: a dangling one keeps EEXIST
        local to, tst = resolve(fs, abs, true)
        if not to or not tst then
          return failure { prefix .. M.quote_locale(written) .. ": " .. TEXT.EEXIST }
        end
        st = tst
      end
      if st.type ~= "directory" then
        return failure { prefix .. M.quote_locale(written) .. ": " .. (last and TEXT.EEXIST or TEXT.ENOTDIR) }
      end
    end
  end
  return true, 0, "", ""
end

-- Removes real (lstat st) and, for a directory, everything under it, deepest first; appends a
-- message line per failure to errs. shown is the name as the user wrote it.
local function remove_tree(fs, real, st, shown, errs)
  if st.type == "directory" then
    local names = fs:children(real) or {}
    table.sort(names)
    local before = #errs
    for _, name in ipairs(names) do
      local child = join(real, name)
      local cst = fs:lstat(child)
      if cst then remove_tree(fs, child, cst, shown .. "/" .. name, errs) end
    end
    if #errs > before then return end -- a child stayed: coreutils leaves the directory without a word
  end
  local ok, e = fs:remove(real)
  if not ok then errs[#errs + 1] = "rm: cannot remove " .. M.quote(shown) .. ": " .. TEXT[e] end
end

local function rm(fs, p, recursive, cwd)
  local base = p:match("([^/]*)$")
  if recursive and (base == "." or base == "..") then
    return failure { "rm: refusing to remove '.' or '..' directory: skipping " .. M.quote(p) }
  end
  local abs = absolute(p, cwd)
  if recursive and abs == "/" then
    return failure { "rm: it is dangerous to operate recursively on " .. M.quote(p),
      "rm: use --no-preserve-root to override this failsafe" }
  end
  local real, st = resolve(fs, abs, false)
  if not real then return failure { "rm: cannot remove " .. M.quote(p) .. ": " .. TEXT[st] } end
  if not st then return failure { "rm: cannot remove " .. M.quote(p) .. ": " .. TEXT.ENOENT } end
  if not recursive then
    if st.type == "directory" and #(fs:children(real) or {}) > 0 then
      return failure { "rm: cannot remove " .. M.quote(p) .. ": " .. TEXT.ENOTEMPTY }
    end
    local ok, e = fs:remove(real)
    if not ok then return failure { "rm: cannot remove " .. M.quote(p) .. ": " .. TEXT[e] } end
    return true, 0, "", ""
  end
  local errs = {}
  remove_tree(fs, real, st, p, errs)
  if #errs > 0 then return failure(errs) end
  return true, 0, "", ""
end

local function mv(fs, a, b, cwd)
  local ra, sa = resolve(fs, absolute(a, cwd), false)
  if not ra or not sa then
    return failure { "mv: cannot stat " .. M.quote(a) .. ": " .. TEXT[ra and "ENOENT" or sa] }
  end
  local rb, sb = resolve(fs, absolute(b, cwd), false)
  if not rb and sb ~= "ENOENT" then
    return failure { "mv: cannot stat " .. M.quote(b) .. ": " .. TEXT[sb] }
  end
  local move = "mv: cannot move " .. M.quote(a) .. " to " .. M.quote(b) .. ": "
  if not rb then return failure { move .. TEXT.ENOENT } end
  if rb == ra then
    return failure { "mv: " .. M.quote(a) .. " and " .. M.quote(b) .. " are the same file" }
  end
  if sa.type == "directory" and rb:sub(1, #ra + 1) == ra .. "/" then
    return failure { "mv: cannot move " .. M.quote(a) .. " to a subdirectory of itself, " .. M.quote(b) }
  end
  if sb then
    if sa.type == "directory" and sb.type ~= "directory" then
      return failure { "mv: cannot overwrite non-directory " .. M.quote(b) .. " with directory " ..
        M.quote(a) }
    end
    if sa.type ~= "directory" and sb.type == "directory" then
      return failure { "mv: cannot overwrite directory " .. M.quote(b) .. " with non-directory" }
    end
    if sb.type == "directory" and #(fs:children(rb) or {}) > 0 then
      return failure { move .. TEXT.ENOTEMPTY }
    end
    local ok, e = fs:remove(rb)
    if not ok then return failure { move .. TEXT[e] } end
  elseif not fs:lstat(dirname(rb)) then
    return failure { move .. TEXT.ENOENT }
  end
  local ok, e = fs:rename(ra, rb)
  if not ok then return failure { move .. TEXT[e] } end
  return true, 0, "", ""
end


--- coreutils.run(fs, argv[, cwd]) -> handled, exit_code, stdout, stderr. handled is false (and
-- nothing else is returned) when argv is not one of the supported forms (`mkdir [-p] -- P`,
-- `rm -d|-r -- P`, `mv -T -- A B`). Otherwise the command is done on fs as GNU coreutils would
-- do it in the C locale: exit 0 with empty output, or 1 with its message on stderr. Relative
-- paths are under cwd (default "/root", the sandbox's home directory). Does not yield; raises
-- only for an argv that is not a table of strings.
function M.run(fs, argv, cwd)
  if type(argv) ~= "table" then error("coreutils.run: argv must be a table", 2) end
  local cmd = argv[1]
  if cmd ~= "mkdir" and cmd ~= "rm" and cmd ~= "mv" then return false end
  cwd = cwd or "/root"
  local n = #argv
  for i = 2, n do
    if type(argv[i]) ~= "string" then error("coreutils.run: argv[" .. i .. "] must be a string", 2) end
  end
  if cmd == "mkdir" and n == 3 and argv[2] == "--" then return mkdir(fs, argv[3], false, cwd) end
  if cmd == "mkdir" and n == 4 and argv[2] == "-p" and argv[3] == "--" then
    return mkdir(fs, argv[4], true, cwd)
  end
  if cmd == "rm" and n == 4 and (argv[2] == "-d" or argv[2] == "-r") and argv[3] == "--" then
    return rm(fs, argv[4], argv[2] == "-r", cwd)
  end
  if cmd == "mv" and n == 5 and argv[2] == "-T" and argv[3] == "--" then
    return mv(fs, argv[4], argv[5], cwd)
  end
  return false
end

return M
