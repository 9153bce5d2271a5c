--- moonbox.local.engine.sim — the engine of a dry run (`moonbox run --dry-run`): moonbox local's
-- service runs on it unchanged, and it starts no process and touches no btrfs, cgroup or network.
--
-- A sandbox is a record with a file tree in memory (Fs below, rooted at "/", with the home
-- directory /root). Uploads write into the tree, downloads and listings read it, a capture copies
-- it into a layer kept by the layer's path, and a restore boots a copy of exactly the tree its
-- snapshot captured. Boots, captures and transfers take simulated seconds (opts.duration(kind):
-- "create", "restore", "snapshot", "transfer"), slept with task.sleep, which the dry run drives
-- on its simulated clock.
--
-- Commands arrive as the structured command the client built (eng:exec's opts.intent, carried by
-- the in-memory transport beside the wire body; moonbox.render.exec documents its fields), never
-- as text to parse: nothing here reads the client's bash wrapper or kill script back. An exec is
-- answered by opts.answer(text, sandbox_id, intent) (the recipe's render.dry_run.on_exec hooks),
-- where text is the recipe's own command: its string, or its argv joined with spaces. One
-- command is known without a hook: a plain `sleep N` (argv {"sleep", N}, or the text of exactly
-- those two words) takes N simulated seconds. A kill intent signals the exec it names (it ends
-- with 128 + the signal), or marks it so that it never starts (it then exits 143), as the
-- client's kill script does on a real backend.
--
-- opts.observe(what, fields) is told each step (create, restore, exec, upload, download,
-- terminate) for the dry run's report; opts.download(path, sandbox_id) may give the bytes of a
-- file nothing wrote (render.dry_run.on_download).
local task = require "moonbox.task"
local core = require "moonbox.core"
local sys = require "moonbox.sys"
local ids = require "moonbox.ids"
local archive = require "moonbox.archive"

local M = {}

-- ---- the file tree ----------------------------------------------------------------------------

local Fs = {}
Fs.__index = Fs
M.Fs = Fs

-- The names of an absolute path, "/" itself giving none; nil for a relative path. Plain
-- splitting at "/" (no pattern over the name's bytes: a name may hold any byte but "/" and NUL).
local function split(path)
  if type(path) ~= "string" or path:sub(1, 1) ~= "/" then return nil end
  local names, i = {}, 2
  while i <= #path do
    local j = path:find("/", i, true) or (#path + 1)
    if j > i then
      local name = path:sub(i, j - 1)
      if name ~= "." then
        if name == ".." then names[#names] = nil else names[#names + 1] = name end
      end
    end
    i = j + 1
  end
  return names
end

local MODE_DIR, MODE_FILE, MODE_LINK = tonumber("755", 8), tonumber("600", 8), tonumber("777", 8)

local function dir_node(t) return { type = "directory", children = {}, mtime = t, mode = MODE_DIR } end

--- sim.new_fs(now) -> Fs: an empty tree (/, /root and /tmp, directories); now() gives the epoch seconds
-- entries are stamped with. Does not yield.
function M.new_fs(now)
  local self = setmetatable({ now = now or core.time }, Fs)
  self.root = dir_node(self.now())
  self.root.children.root = dir_node(self.now())
  self.root.children.tmp = dir_node(self.now())
  self.root.children.tmp.mode = tonumber("1777", 8)
  return self
end

-- The node at names[1..n] (default all), or nil, errno ("ENOENT", "ENOTDIR", "ELOOP"). Symlinks
-- on the way are followed as the kernel follows them (a relative target from the link's
-- directory, at most 40 of them), and the last one too when follow.
function Fs:walk(names, n, follow)
  local queue = table.move(names, 1, n or #names, 1, {})
  local node, at, i, hops = self.root, {}, 1, 0
  while i <= #queue do
    if node.type ~= "directory" then return nil, "ENOTDIR" end
    local child = node.children[queue[i]]
    if not child then return nil, "ENOENT" end
    if child.type == "symlink" and (i < #queue or follow) then
      hops = hops + 1
      if hops > 40 then return nil, "ELOOP" end
      local target = child.target
      local abs = target:sub(1, 1) == "/" and target or ("/" .. table.concat(at, "/") .. "/" .. target)
      local t = split(abs) or {}
      for j = i + 1, #queue do t[#t + 1] = queue[j] end
      queue, node, at, i = t, self.root, {}, 1
    else
      node, at[#at + 1], i = child, queue[i], i + 1
    end
  end
  return node
end

-- The directory that holds path's last name, and that name; or nil, errno.
function Fs:parent(path)
  local names = split(path)
  if not names then return nil, "ENOENT" end
  if #names == 0 then return nil, "EACCES" end -- "/" has no parent to change
  local dir, err = self:walk(names, #names - 1, true)
  if not dir then return nil, err end
  if dir.type ~= "directory" then return nil, "ENOTDIR" end
  return dir, names[#names]
end

-- The size stat reports: a file's bytes, a symlink's target length, 4096 for a directory.
local function node_size(node)
  if node.type == "file" then return #node.data end
  if node.type == "symlink" then return #node.target end
  return 4096
end

--- fs:lstat(path) -> nil, errno | {type = "file"|"directory"|"symlink", size, mtime, target,
-- mode}: what is at path, a final symlink not followed (those on the way are). Does not yield.
function Fs:lstat(path) return self:stat_of(path, false) end

--- fs:stat(path) -> as fs:lstat, a final symlink followed. Does not yield.
function Fs:stat(path) return self:stat_of(path, true) end

-- What is at path (a final symlink followed when follow), or nil, errno.
function Fs:stat_of(path, follow)
  local names = split(path)
  if not names then return nil, "ENOENT" end
  local node, err = self:walk(names, nil, follow)
  if not node then return nil, err end
  return { type = node.type, size = node_size(node), mtime = node.mtime, target = node.target,
    mode = node.mode }
end

--- fs:children(path) -> array of the names in the directory at path, sorted (empty when path is
-- not a directory). Does not yield.
function Fs:children(path)
  local names = split(path)
  local node = names and self:walk(names, nil, true)
  local out = {}
  if node and node.type == "directory" then
    for name in pairs(node.children) do out[#out + 1] = name end
    table.sort(out)
  end
  return out
end

--- fs:mkdir(path) -> true | nil, errno ("ENOENT": no parent, "ENOTDIR", "EEXIST"). Does not yield.
function Fs:mkdir(path)
  local dir, name = self:parent(path)
  if not dir then return nil, name end
  if dir.children[name] then return nil, "EEXIST" end
  dir.children[name] = dir_node(self.now())
  dir.mtime = self.now()
  return true
end

--- fs:remove(path) -> true | nil, errno ("ENOENT", "ENOTDIR", "ENOTEMPTY" for a directory with
-- entries, "EACCES" for /): removes a file, a symlink or an empty directory. Does not yield.
function Fs:remove(path)
  local dir, name = self:parent(path)
  if not dir then return nil, name end
  local node = dir.children[name]
  if not node then return nil, "ENOENT" end
  if node.type == "directory" and next(node.children) then return nil, "ENOTEMPTY" end
  dir.children[name] = nil
  dir.mtime = self.now()
  return true
end

--- fs:rename(from, to) -> true | nil, errno: as rename(2): "ENOENT" (from, or to's parent),
-- "ENOTDIR" (a directory onto a file, or a parent that is not one), "EISDIR" (a file onto a
-- directory), "ENOTEMPTY" (onto a directory with entries), "EACCES" (/, or a directory into
-- itself). Does not yield.
function Fs:rename(from, to)
  local fdir, fname = self:parent(from)
  if not fdir then return nil, fname end
  local node = fdir.children[fname]
  if not node then return nil, "ENOENT" end
  local tdir, tname = self:parent(to)
  if not tdir then return nil, tname end
  if from == to then return true end
  if node.type == "directory" and (to .. "/"):sub(1, #from + 1) == from .. "/" then return nil, "EACCES" end
  local there = tdir.children[tname]
  if there then
    if node.type == "directory" and there.type ~= "directory" then return nil, "ENOTDIR" end
    if node.type ~= "directory" and there.type == "directory" then return nil, "EISDIR" end
    if there.type == "directory" and next(there.children) then return nil, "ENOTEMPTY" end
  end
  fdir.children[fname] = nil
  tdir.children[tname] = node
  fdir.mtime, tdir.mtime = self.now(), self.now()
  return true
end

--- fs:read(path) -> the bytes of the file at path (symlinks followed) | nil, errno ("ENOENT",
-- "ENOTDIR", "EISDIR", "ELOOP"). Does not yield.
function Fs:read(path)
  local names = split(path)
  if not names then return nil, "ENOENT" end
  local node, err = self:walk(names, nil, true)
  if not node then return nil, err end
  if node.type == "directory" then return nil, "EISDIR" end
  return node.data or ""
end

--- fs:write(path, data[, kind]) -> true | nil, errno: makes path a file holding data (kind
-- "symlink": a symlink to data), replacing a file or symlink there; the missing parents are made
-- (directories). "EISDIR" when a directory is there, "ENOTDIR" when a parent is a file. Does not
-- yield.
function Fs:write(path, data, kind)
  local names = split(path)
  if not names or #names == 0 then return nil, "EISDIR" end
  local node = self.root
  for i = 1, #names - 1 do
    local child = node.children[names[i]]
    if not child then
      child = dir_node(self.now())
      node.children[names[i]] = child
    elseif child.type ~= "directory" then
      return nil, "ENOTDIR"
    end
    node = child
  end
  local there = node.children[names[#names]]
  if there and there.type == "directory" then return nil, "EISDIR" end
  if kind == "symlink" then
    node.children[names[#names]] = { type = "symlink", target = data, mtime = self.now(), mode = MODE_LINK }
  else
    node.children[names[#names]] = { type = "file", data = data, mtime = self.now(), mode = MODE_FILE }
  end
  return true
end

--- fs:mkdir_p(path) -> true | nil, errno: path and its missing parents as directories. Does not yield.
function Fs:mkdir_p(path)
  local names = split(path)
  if not names then return nil, "ENOENT" end
  local node = self.root
  for i = 1, #names do
    local child = node.children[names[i]]
    if not child then
      child = dir_node(self.now())
      node.children[names[i]] = child
    elseif child.type ~= "directory" then
      return nil, "ENOTDIR"
    end
    node = child
  end
  return true
end

-- A deep copy of a node and everything under it.
local function copy_node(node)
  local out = {}
  for k, v in pairs(node) do out[k] = v end
  if node.children then
    out.children = {}
    for name, child in pairs(node.children) do out.children[name] = copy_node(child) end
  end
  return out
end

--- fs:copy() -> a new Fs holding a copy of the whole tree. Does not yield.
function Fs:copy()
  local out = setmetatable({ now = self.now }, Fs)
  out.root = copy_node(self.root)
  return out
end

--- fs:totals() -> files, bytes: the regular files of the tree and their bytes. Does not yield.
function Fs:totals()
  local files, bytes = 0, 0
  local function walk(node)
    if node.type == "file" then
      files, bytes = files + 1, bytes + #node.data
    elseif node.children then
      for _, child in pairs(node.children) do walk(child) end
    end
  end
  walk(self.root)
  return files, bytes
end

-- ---- command words ---------------------------------------------------------------------------

-- Bytes a word of a shell-free command may hold (no quoting, expansion, redirection or list).
local PLAIN = {}
for c in ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%"):gmatch(".") do
  PLAIN[c:byte()] = true
end

--- sim.words(text) -> the words of text when it is a plain command (words of PLAIN bytes
-- separated by spaces), else nil: `sleep 5` is {"sleep", "5"}, `sleep 5; ls` is nil. A byte scan
-- of the recipe's own command, never of what the client wraps it in. Does not yield.
function M.words(text)
  local words, cur = {}, {}
  for i = 1, #text do
    local b = text:byte(i)
    if b == 32 then
      if #cur > 0 then
        words[#words + 1] = table.concat(cur)
        cur = {}
      end
    elseif PLAIN[b] then
      cur[#cur + 1] = string.char(b)
    else
      return nil
    end
  end
  if #cur > 0 then words[#words + 1] = table.concat(cur) end
  return words
end

--- sim.command_text(intent, wire_command) -> the recipe's own command: its argv joined with
-- spaces, or its text; the wire's command for a request that carries no intent. Does not yield.
function M.command_text(intent, wire_command)
  local ex = intent and intent.exec
  if not ex then return wire_command or "" end
  if ex.argv then return table.concat(ex.argv, " ") end
  return ex.command or wire_command or ""
end

-- The seconds of a plain `sleep N`, or nil.
local function sleep_seconds(ex, text)
  local argv = ex and ex.argv or M.words(text)
  if argv and #argv == 2 and argv[1] == "sleep" then
    local n = tonumber(argv[2])
    if n and n >= 0 and n ~= math.huge then return n end
  end
  return nil
end

-- ---- exec handles ----------------------------------------------------------------------------

local Handle = {}
Handle.__index = Handle

-- A handle whose command ends after `seconds` (or when killed) with code, and whose output
-- (stdout, stderr) is read once it has ended.
local function new_handle(sb, key, r, step)
  local h = setmetatable({ sb = sb, key = key, r = r, step = step, cond = core.cond(), done = false,
    pending = { stdout = r.stdout ~= "" and r.stdout or nil, stderr = r.stderr ~= "" and r.stderr or nil },
    pid = 0 }, Handle)
  if key then sb.running[key] = h end
  h.task = task.spawn(function()
    local t0 = task.now()
    if r.seconds > 0 then pcall(task.timeout, r.seconds, h.cond.wait, h.cond) end
    h.done = true
    if h.signal then
      h.code = 128 + h.signal
      h.pending = {}
      if step then step.code, step.killed, step.seconds = h.code, true, task.now() - t0 end
    else
      h.code = r.code
    end
    if key and sb.running[key] == h then sb.running[key] = nil end
    h.cond:broadcast()
  end)
  return h
end

--- handle:read(stream) -> the command's output on stream ("stdout" | "stderr"), once it has
-- ended, then nil. [yields] until it ends.
function Handle:read(stream)
  while not self.done do self.cond:wait() end
  local data = self.pending[stream]
  self.pending[stream] = nil
  return data
end

--- handle:wait() -> code: waits for the command's end (128 + the signal when killed). [yields]
function Handle:wait()
  while not self.done do self.cond:wait() end
  return self.code
end

--- handle:kill(sig) -> whether it was still running: it ends at once with 128 + sig. Does not yield.
function Handle:kill(sig)
  if self.done then return false end
  self.signal = type(sig) == "number" and sig or 15
  self.cond:broadcast()
  return true
end

--- handle:detach(): nothing to let go of (the command runs on to its simulated end). Does not yield.
function Handle.detach() end

-- ---- the engine -------------------------------------------------------------------------------

local Engine = {}
Engine.__index = Engine
M.Engine = Engine

local Files = {}
Files.__index = Files

-- What every engine answers with (moonbox.local.engine's MAX_ALLOWED / check_domain are asked
-- by the service itself).
local function engine_error(op, code, id, message)
  error(core.Error.new { op = "local.engine." .. op, code = code, sandbox_id = id, message = message }, 0)
end

--- sim.new(opts) -> Engine. opts: now (epoch seconds, the clock files are stamped with),
-- duration(kind) -> seconds ("create", "restore", "snapshot", "exec", "transfer"),
-- answer(text, sandbox_id, intent)
-- -> {code, stdout, stderr, seconds} | nil, download(path, sandbox_id) -> string | nil,
-- observe(what, fields) -> the step's fields (the report may complete them), temp_dir (a private
-- host directory for the archives of directory transfers), hold(fn, ...) (runs real work — the
-- archive jobs — with the simulated clock held still; default: calls fn), builtin(fs, argv) ->
-- handled, exit_code, stdout, stderr (commands carried out on the sandbox's tree, asked before
-- answer, for a command the client sent as an argv: moonbox.local.engine.coreutils.run; a
-- command given as text is never interpreted). Does not yield.
function M.new(opts)
  local self = setmetatable({
    now = opts.now or core.time, duration = opts.duration or function() return 0 end,
    answer = opts.answer or function() return nil end, download = opts.download or function() return nil end,
    observe = opts.observe or function(_, f) return f end, temp_dir = opts.temp_dir,
    hold = opts.hold or function(fn, ...) return fn(...) end, builtin = opts.builtin,
    sandboxes = {}, layers = {},
  }, Engine)
  self.files = setmetatable({ engine = self }, Files)
  return self
end

--- eng:check() -> {ok = true, problems = {}}: a simulated engine runs anywhere. Does not yield.
function Engine.check() return { ok = true, problems = {} } end

-- The sandbox id, booted and not terminated; raises not_found / not_running as the real engine.
function Engine:live(op, id)
  local sb = self.sandboxes[id]
  if not sb then engine_error(op, "not_found", id, "sandbox " .. tostring(id) .. " does not exist") end
  if not sb.running_state then engine_error(op, "not_running", id, "sandbox " .. id .. " is not running") end
  return sb
end

--- eng:create(id, opts) boots sandbox id: a fresh tree, or a copy of the tree its first lower
-- layer captured (a restore), after the simulated create or restore seconds. opts as the real
-- engine's (lowers, network, env, limits) plus plan. Raises when a lower layer is unknown. [yields]
function Engine:create(id, opts)
  local lowers = opts.lowers or {}
  local layer = lowers[1] and self.layers[lowers[1]]
  if lowers[1] and not layer then
    engine_error("create", "missing", id, "sandbox " .. id .. ": its snapshot's layer is gone")
  end
  local sb = { id = id, plan = opts.plan or "1c-2g", running = {}, marked = {},
    fs = layer and layer.fs:copy() or M.new_fs(self.now) }
  self.sandboxes[id] = sb
  local snapshot = lowers[1] and lowers[1]:match("([^/]+)$") or nil
  self.observe(snapshot and "restore" or "create", { sandbox = id, plan = sb.plan, snapshot = snapshot })
  task.sleep(self.duration(snapshot and "restore" or "create"))
  if self.sandboxes[id] == sb then sb.running_state = true end
end

--- eng:terminate(id): the sandbox is gone, its running commands end (killed). Idempotent. Does
-- not yield.
function Engine:terminate(id)
  local sb = self.sandboxes[id]
  if not sb then return end
  self.sandboxes[id] = nil
  for _, h in pairs(sb.running) do h:kill(9) end
  self.observe("terminate", { sandbox = id, plan = sb.plan })
end

--- eng:freeze(id) / eng:thaw(id): idle suspend and wake (nothing runs between). Do not yield.
function Engine:freeze(id) self:live("freeze", id).frozen = true end
function Engine:thaw(id) self:live("thaw", id).frozen = nil end

--- eng:exec(id, command, opts) -> handle (read/wait/kill/detach). opts.intent: the client's
-- structured command (see the file's header); command, the wire's text, is only reported when
-- there is none. A kill intent answers "signalled", "marked" or "gone" on stdout at once; an exec
-- marked killed before it started exits 143 without running. Raises not_found / not_running.
-- Yields only in a hook that does: the simulated command runs in a task of its own.
function Engine:exec(id, command, opts)
  local sb = self:live("exec", id)
  local intent = opts and opts.intent or nil
  local kill = intent and intent.kill
  if kill then
    local h = sb.running[kill.id]
    local said
    if h then
      h:kill(kill.signal)
      said = "signalled"
    elseif kill.mark then
      sb.marked[kill.id] = true
      said = "marked"
    else
      said = "gone"
    end
    return new_handle(sb, nil, { code = 0, stdout = said .. "\n", stderr = "", seconds = 0 })
  end
  local ex = intent and intent.exec
  local text = M.command_text(intent, command)
  if ex and ex.env_file then sb.fs:remove(ex.env_file) end -- as the client's wrapper does
  if ex and ex.id and sb.marked[ex.id] then
    sb.marked[ex.id] = nil
    return new_handle(sb, nil, { code = 143, stdout = "", stderr = "", seconds = 0 })
  end
  local r
  local argv = self.builtin and ex and ex.argv
  if argv then
    local handled, code, stdout, stderr = self.builtin(sb.fs, argv)
    if handled then
      r = { code = code or 0, stdout = stdout or "", stderr = stderr or "", seconds = self.duration("exec") }
    end
  end
  if r == nil then r = self.answer(text, id, intent) end
  if r == nil then
    r = { code = 0, stdout = "", stderr = "", seconds = sleep_seconds(ex, text) or self.duration("exec") }
  end
  local step = self.observe("exec", { sandbox = id, command = text, kind = intent and intent.kind or "stream",
    seconds = r.seconds, code = r.code })
  return new_handle(sb, ex and ex.id, r, step)
end

--- eng:capture(id, layer, opts) -> {size, layers = {layer}}: copies the sandbox's tree into the
-- layer named layer (a path, kept by name) after the simulated snapshot seconds. Raises
-- not_running when the sandbox ended meanwhile. [yields]
function Engine:capture(id, layer, _)
  local sb = self:live("capture", id)
  local fs = sb.fs:copy()
  task.sleep(self.duration("snapshot"))
  if self.sandboxes[id] ~= sb then engine_error("capture", "not_running", id, "sandbox " .. id ..
    " ended during its capture") end
  local files, bytes = fs:totals()
  self.layers[layer] = { fs = fs, files = files, bytes = bytes }
  return { size = bytes, layers = { layer } }
end

--- eng:verify_layer(layer) -> {files, bytes} | nil, why, "missing": whether a layer is kept.
-- Does not yield.
function Engine:verify_layer(layer)
  local l = self.layers[layer]
  if not l then return nil, "its layer is gone", "missing" end
  return { files = l.files, bytes = l.bytes }
end

--- eng:forget_layer(layer): drops a layer the service freed. Does not yield.
function Engine:forget_layer(layer) self.layers[layer] = nil end

--- eng:recover() -> {}: a simulated engine leaves nothing behind. Does not yield.
function Engine.recover() return {} end

--- eng:close(): forgets every sandbox and layer. Does not yield.
function Engine:close()
  self.sandboxes, self.layers = {}, {}
end

-- ---- files ------------------------------------------------------------------------------------

local ERRNO = {
  ENOENT = { "not_found", "no file or directory at path" },
  ENOTDIR = { "not_directory", "a parent of the path is not a directory" },
  EISDIR = { "is_directory", "path is a directory" },
  EACCES = { "permission_denied", "permission denied" },
}

-- Raises the real engine's error for errno (code and message as moonbox.local.engine.files's).
local function files_error(op, id, path, errno)
  local e = ERRNO[errno] or { "io_error", errno }
  error(core.Error.new { op = "local.engine." .. op, code = e[1], sandbox_id = id, path = path,
    message = "sandbox " .. id .. ": " .. e[2] .. " (" .. path .. ")" }, 0)
end

-- The tree of a running sandbox; raises not_found / not_running.
local function sandbox_fs(self, op, id)
  return self.engine:live(op, id).fs
end

-- A listing entry as the real engine's files:stat/list give it.
local function entry(name, st)
  return { name = name, type = st.type, size = st.size, modifiedAt = st.mtime, mtime = st.mtime,
    target = st.target, mode = st.mode }
end

--- files:stat(id, path[, {follow}]) -> {name, type, size, modifiedAt, mode, target} | nil. A path
-- nothing wrote that render.dry_run.on_download answers is a file of those bytes. Raises
-- not_found (the sandbox). Does not yield.
function Files:stat(id, path, opts)
  local fs = sandbox_fs(self, "stat", id)
  local st, errno
  if opts and opts.follow then st, errno = fs:stat(path) else st, errno = fs:lstat(path) end
  local name = path:match("([^/]*)$")
  if not st and errno ~= "ENOENT" then files_error("stat", id, path, errno) end
  if not st then
    local given = self.engine.download(path, id)
    if given == nil then return nil end
    return entry(name, { type = "file", size = #given, mtime = fs.now() })
  end
  return entry(name, st)
end

--- files:list(id, path, depth) -> entries (names relative to path, sorted) | nil when nothing is
-- there: depth 0 is path itself. Raises not_directory for a file given depth >= 1. Does not yield.
function Files:list(id, path, depth)
  local fs = sandbox_fs(self, "list", id)
  local st, errno = fs:lstat(path)
  if not st and errno ~= "ENOENT" then files_error("list", id, path, errno) end
  if not st then return nil end
  if depth == 0 then return { entry(path:match("([^/]*)$"), st) } end
  if st.type == "symlink" then st = fs:stat(path) or st end -- a listing follows a link given as the path
  if st.type ~= "directory" then files_error("list", id, path, "ENOTDIR") end
  local out = {}
  local function walk(dir, rel, level)
    for _, name in ipairs(fs:children(dir)) do
      local p = (dir == "/" and "" or dir) .. "/" .. name
      local shown = rel == "" and name or (rel .. "/" .. name)
      local s = fs:lstat(p)
      out[#out + 1] = entry(shown, s)
      if s.type == "directory" and level < depth then walk(p, shown, level + 1) end
    end
  end
  walk(path, "", 1)
  table.sort(out, function(a, b) return a.name < b.name end)
  return out
end

-- A stream of bytes as the real engine's read helper gives them (p:read("stdout") until nil).
local function byte_stream(data)
  local left = data
  return { read = function(_, stream)
    if stream ~= "stdout" or left == nil then return nil end
    local d = left
    left = nil
    return d ~= "" and d or nil
  end, wait = function() return 0 end, kill = function() end }
end

--- files:read(id, path) -> p, size: the file's bytes as a stream (p:read("stdout") until nil,
-- p:wait()), after the simulated transfer seconds. Raises not_found, is_directory. [yields]
function Files:read(id, path)
  task.sleep(self.engine.duration("transfer"))
  local fs = sandbox_fs(self, "read", id)
  local data, errno = fs:read(path)
  if not data and errno == "ENOENT" then data = self.engine.download(path, id) end
  if not data then files_error("read", id, path, errno) end
  self.engine.observe("download", { sandbox = id, path = path, bytes = #data })
  return byte_stream(data), #data
end

-- The bytes of an upload's body: a host file's (the path a client's body_file named), or those an
-- in-memory request carried ({data = bytes}, moonbox.local.http.memory).
local function body_bytes(body)
  if type(body) == "table" then return body.data end
  local f = assert(io.open(body, "rb"))
  local data = f:read("a")
  f:close()
  return data
end

-- Paths the client keeps its own files at (an exec's env file): not the recipe's uploads.
local function private(path) return path:sub(1, 14) == "/dev/.moonbox/" end

--- files:write(id, path, body) writes the upload's bytes as the file at path (parents made),
-- after the simulated transfer seconds. Raises is_directory, not_directory. [yields]
function Files:write(id, path, body)
  task.sleep(self.engine.duration("transfer"))
  local fs = sandbox_fs(self, "write", id)
  local data = body_bytes(body)
  local ok, errno = fs:write(path, data)
  if not ok then files_error("write", id, path, errno) end
  if not private(path) then self.engine.observe("upload", { sandbox = id, path = path, bytes = #data }) end
end

-- A fresh path under the engine's private temporary directory.
local function temp(self, what)
  local dir = self.engine.temp_dir
  if not dir then error("moonbox.local.engine.sim: no temp_dir for a directory transfer", 0) end
  if not self.engine.temp_made then
    sys.mkdir_p(dir, tonumber("700", 8))
    self.engine.temp_made = true
  end
  return dir .. "/" .. what .. "." .. ids.token():sub(1, 16)
end

-- Reads the records moonbox.archive.to_records wrote (runtime/archive_records.c: 'H', then the
-- NUL-terminated fields type, mode, uid, gid, mtime, size, name, target, then size bytes of a
-- file; 'E' at the end) into the tree under base. Returns the file bytes read. Raises
-- corrupt_archive for a record it cannot read.
local function load_records(fs, base, data)
  local pos, bytes = 1, 0
  local function field()
    local z = data:find("\0", pos, true)
    if not z then error(core.Error.new { op = "archive.to_records", code = "corrupt_archive",
      message = "the upload's records end early" }, 0) end
    local v = data:sub(pos, z - 1)
    pos = z + 1
    return v
  end
  local prefix = base == "/" and "" or base
  while pos <= #data do
    local tag = data:sub(pos, pos)
    pos = pos + 1
    if tag == "E" then break end
    local ty, mode = field(), field()
    field() -- uid
    field() -- gid
    local mtime, size, name, target = field(), field(), field(), field()
    local p = prefix .. "/" .. name
    local n = (ty == "f") and (tonumber(size) or 0) or 0
    if ty == "d" then
      fs:mkdir_p(p)
    elseif ty == "l" then
      fs:write(p, target, "symlink")
    elseif ty == "h" then
      fs:write(p, fs:read(prefix .. "/" .. target) or "")
    else
      fs:write(p, data:sub(pos, pos + n - 1))
      bytes = bytes + n
    end
    local st = fs:walk(split(p))
    if st then st.mode, st.mtime = tonumber(mode, 8) or st.mode, tonumber(mtime) or st.mtime end
    pos = pos + n
  end
  return bytes
end

-- The bytes of a host file.
local function read_all(path)
  local f = assert(io.open(path, "rb"))
  local data = f:read("a")
  f:close()
  return data
end

--- files:tar_in(id, path, archive_file, opts) extracts a (gzip'd) tar into the directory path:
-- moonbox.archive.to_records checks every member as on a real backend (no absolute names, no
-- "..", symlinks that stay inside, no devices) into a private temporary file, which is then
-- read into the tree. Raises the archive's errors. [yields]
function Files:tar_in(id, path, archive_file, opts)
  task.sleep(self.engine.duration("transfer"))
  local fs = sandbox_fs(self, "tar_in", id)
  local rec = temp(self, "in")
  local ok, err = pcall(function()
    if type(archive_file) == "table" then
      local f = assert(io.open(rec .. ".tar", "wb"))
      f:write(archive_file.data)
      f:close()
      archive_file = rec .. ".tar"
    end
    self.engine.hold(function(...) return archive.to_records(...) end, archive_file, rec,
      { max_bytes = opts and opts.max_bytes })
    local made, errno = fs:mkdir_p(path)
    if not made then files_error("tar_in", id, path, errno) end
    local bytes = load_records(fs, path, read_all(rec))
    self.engine.observe("upload", { sandbox = id, path = path, bytes = bytes })
  end)
  os.remove(rec)
  os.remove(rec .. ".tar")
  if not ok then error(err, 0) end
end

--- files:tar_out(id, path) -> archive_file: the directory path as a gzip'd tar in a temporary
-- host file the caller serves and removes (records written here, packed by
-- moonbox.archive.from_records). Raises not_found. [yields]
function Files:tar_out(id, path)
  task.sleep(self.engine.duration("transfer"))
  local fs = sandbox_fs(self, "tar_out", id)
  local rec, out = temp(self, "out"), temp(self, "out") .. ".tar.gz"
  local ok, err = pcall(function()
    local parts, bytes = {}, 0
    local function put(ty, st, name, target, data)
      parts[#parts + 1] = table.concat({ "H" .. ty, string.format("%o", st.mode or MODE_FILE), "0", "0",
        tostring(math.floor(st.mtime or 0)), tostring(data and #data or 0), name, target or "" }, "\0")
        .. "\0"
      if data then parts[#parts + 1] = data end
    end
    local function walk(inside, rel)
      for _, name in ipairs(fs:children(inside)) do
        local p = (inside == "/" and "" or inside) .. "/" .. name
        local shown = rel == "" and name or (rel .. "/" .. name)
        local st = fs:lstat(p)
        if st.type == "directory" then
          put("d", st, shown)
          walk(p, shown)
        elseif st.type == "symlink" then
          put("l", st, shown, st.target)
        else
          local data = fs:read(p)
          bytes = bytes + #data
          put("f", st, shown, nil, data)
        end
      end
    end
    walk(path, "")
    parts[#parts + 1] = "E"
    local f = assert(io.open(rec, "wb"))
    f:write(table.concat(parts))
    f:close()
    self.engine.hold(function(...) return archive.from_records(...) end, rec, out)
    self.engine.observe("download", { sandbox = id, path = path, bytes = bytes })
  end)
  os.remove(rec)
  if not ok then
    os.remove(out)
    error(err, 0)
  end
  return out
end

return M
