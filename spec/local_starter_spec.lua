-- Pins the starter's channel (tools/sandbox/starter.c): a sandbox's init starts the server's
-- commands on requests that come over a socketpair only the keeper holds. The attacker is root
-- inside the sandbox: it must not find the channel (no descriptor of it anywhere it can look,
-- in /proc, through pidfd_getfd or ptrace, inherited by a command), must not be able to forge a
-- request (it has nothing to send one on) and must not disturb the init by flooding it with
-- the only thing that reaches it, signals. A sender that does hold the channel (the spec itself,
-- host root, taking the keeper's end as the exec helper does) gets nothing for garbage: the init
-- refuses every malformed frame, leaks no descriptor and goes on starting the server's commands.
-- Also here: what a command started that way is (its streams only, its own OOM score, its
-- session), and which commands run without bash.
--
-- Needs root, the default image and python3 on the host and in the image (`moonbox image
-- build`); a missing precondition fails the first test with a sentence.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local Engine = require "moonbox.local.engine"
local image = require "moonbox.local.image"
local L = require "spec.support.local_backend"
local files = require "spec.support.files"
local proc = require "moonbox.proc"

local async = T.async
local RUN = files.run_tag()
local STATE = "/tmp/moonbox-starter-spec-" .. RUN
local IMAGE = image.path()
local eng = Engine.new { state_dir = STATE, image = IMAGE }
local created = {}

local function new_sandbox(name, opts)
  local id = "st-" .. name
  created[#created + 1] = id
  eng:create(id, opts or { network = "deny-all" })
  return id
end

local function sh(id, command)
  local r = eng:run(id, command)
  assert(r.code == 0, "`" .. tostring(command):sub(1, 200) .. "` in " .. id .. " exited " .. tostring(r.code)
    .. ": " .. r.stderr)
  return r.stdout
end

local function py(id, script, args)
  local quoted = {}
  for _, a in ipairs(args or {}) do quoted[#quoted + 1] = "'" .. tostring(a):gsub("'", "'\\''") .. "'" end
  return eng:run(id, "python3 - " .. table.concat(quoted, " ") .. " <<'MOONBOX_PY'\n" .. script .. "\nMOONBOX_PY")
end

-- Runs a Python program on the host (as root, like the exec helper) and returns code, stdout,
-- stderr.
local function host_py(script, args)
  local argv = { "python3", "-c", script }
  for _, a in ipairs(args or {}) do argv[#argv + 1] = tostring(a) end
  local p = proc.spawn(argv)
  local out, err = files.drain(p, "stdout"), files.drain(p, "stderr")
  local code = p:wait()
  return code, out, err
end

-- The init's open descriptors, as the host sees them (host root may list them).
local function init_fds(id)
  return #files.listdir("/proc/" .. eng:info(id).init_pid .. "/fd")
end

-- From inside: every way root there has to reach a descriptor of the init or of any process
-- it cannot see. Prints "breach ..." for each that worked and "probe done" at the end.
local FIND_PROBE = [[
import ctypes, os, socket, stat, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
me = os.getpid()
# 1. the init's descriptors through /proc
for what in ("fd", "fdinfo", "map_files"):
    try:
        os.listdir("/proc/1/%s" % what)
        print("breach listdir /proc/1/%s" % what)
    except OSError:
        pass
for fd in range(0, 64):
    for what in ("fd", "fdinfo"):
        try:
            with open("/proc/1/%s/%d" % (what, fd), "rb") as f:
                f.read(1)
            print("breach open /proc/1/%s/%d" % (what, fd))
        except OSError:
            pass
# 2. pidfd_getfd and ptrace on every process it sees, for every descriptor number
for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
    if pid == me:
        continue
    pidfd = libc.syscall(434, pid, 0)
    if pidfd >= 0:
        for fd in range(0, 256):
            got = libc.syscall(438, pidfd, fd, 0)
            if got >= 0:
                mode = os.fstat(got).st_mode
                if stat.S_ISSOCK(mode) and pid == 1:
                    print("breach pidfd_getfd socket of pid", pid, fd)
                elif pid == 1:
                    print("breach pidfd_getfd of the init", fd)
                os.close(got)
        os.close(pidfd)
if libc.ptrace(16, 1, 0, 0) == 0:
    print("breach ptrace-attach 1")
# 3. a socket it holds that it did not make: inherited from the init
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink("/proc/self/fd/" + fd)
    except OSError:
        continue
    if target.startswith("socket:"):
        print("breach inherited", fd, target)
# 4. a name to connect to: the channel has none, so nothing named may lead to the init
for line in open("/proc/net/unix").read().splitlines()[1:]:
    f = line.split()
    if len(f) >= 8:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(f[7].replace("@", "\0", 1))
            print("breach connected to", f[7])
        except OSError:
            pass
        s.close()
print("probe done")
]]

-- From the host, as the exec helper: takes a copy of the keeper's end of the channel and sends
-- the init everything but a good request: garbage, short frames, a frame that lies about its
-- length, good frames with no, three, five or sixteen descriptors, or a non-socket for the
-- reply, an oversized message, and a flood of each. Prints "answered N refused M" (N: the
-- malformed frames with four descriptors and a reply socket, each answered 'F' EINVAL; M:
-- replies that said anything else) and "done".
local FORGE = [[
import ctypes, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
keeper, chanfd = int(sys.argv[1]), int(sys.argv[2])
pidfd = os.pidfd_open(keeper)
fd = libc.syscall(438, pidfd, chanfd, 0)
assert fd >= 0, "pidfd_getfd: %d" % ctypes.get_errno()
chan = socket.socket(fileno=fd)
def s(b): return struct.pack("<I", len(b)) + b
def request(argv, env=(b"PATH=/bin",), cwd=b"/", flags=0, shell=b""):
    body = s(cwd) + struct.pack("<I", len(argv)) + b"".join(s(a) for a in argv)
    body += struct.pack("<I", len(env)) + b"".join(s(e) for e in env) + s(shell)
    return struct.pack("<IBBH", 8 + len(body), ord("X"), flags, 0) + body
good = request([b"/bin/true"])
null = os.open("/dev/null", os.O_RDWR)
bad = [b"", b"\0", b"X" * 7, good[:-1], good + b"\0",
       struct.pack("<I", len(good) + 1) + good[4:],
       good[:4] + b"Y" + good[5:],
       good[:5] + b"\x02" + good[6:],
       request([b""]), request([]), request([b"/bin/true"], cwd=b"relative"),
       request([b"/bin/t\0rue"]), request([b"/bin/true"], env=(b"=x",)),
       request([b"/bin/true"], env=(b"NOEQUALS",)),
       struct.pack("<IBBH", 16, ord("X"), 0, 0) + struct.pack("<II", 0xffffffff, 0)]
answered = other = 0
def expect_einval(r):
    global answered, other
    r.settimeout(10)
    m = r.recv(64)
    if len(m) == 12 and m[4:5] == b"F" and struct.unpack("<i", m[8:12])[0] == 22:
        answered += 1
    else:
        other += 1
for round in range(40):
    for b in bad:
        r, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        socket.send_fds(chan, [b], [null, null, null, far.fileno()])
        far.close()
        expect_einval(r)
        r.close()
    # a good frame with a wrong number of descriptors: refused, nothing started, no answer possible
    for n in (0, 3, 5, 16):
        fds = [null] * n
        if n:
            socket.send_fds(chan, [good], fds)
        else:
            chan.send(good)
    # a non-socket where the reply socket goes: refused
    socket.send_fds(chan, [good], [null, null, null, null])
# a message over the frame limit
r, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    socket.send_fds(chan, [request([b"/bin/true", b"x" * (3 << 20)])], [null, null, null, far.fileno()])
    far.close()
    expect_einval(r)
except OSError:
    pass  # EMSGSIZE: the channel itself refuses it
print("answered", answered, "refused", other)
print("done")
]]

describe("moonbox local's starter: the init starts commands, over a channel only the server holds", function()
  setup(async(function()
    local status = files.must_read("/proc/self/status")
    assert(status:match("\nUid:%s+0%s"), "the starter spec runs as root (CI does)")
    assert(files.exists(IMAGE .. "/bin/sh"), "the default image is missing at " .. IMAGE ..
      " (build it with `moonbox image build`; ./dev test does)")
    local code = host_py("import os; os.pidfd_open")
    assert(code == 0, "the starter spec needs python3 (3.9 or newer) on the host")
  end))

  teardown(async(function()
    for _, id in ipairs(created) do pcall(eng.terminate, eng, id) end
    pcall(eng.close, eng)
    L.remove_trees(STATE)
  end))

  it("gives a command its three streams and nothing else: no socket, no descriptor of the init",
    async(function()
      local id = new_sandbox("fds")
      -- through bash and without it: both are started by the init
      local via_bash = sh(id, "python3 -c 'import os; print(sorted(os.listdir(\"/proc/self/fd\")))'")
      assert.are.equal("['0', '1', '2', '3']\n", via_bash) -- 3: the listing itself
      local direct = sh(id, { "python3", "-c", "import os; print(sorted(os.listdir('/proc/self/fd')))" })
      assert.are.equal("['0', '1', '2', '3']\n", direct)
      assert.are.equal("1\n", sh(id, "echo $PPID")) -- started by the init, not entered from outside
    end))

  it("leaves a sandbox process no way to find the channel: /proc, pidfd_getfd, ptrace, inheritance, " ..
    "a name", async(function()
      local id = new_sandbox("find")
      local r = py(id, FIND_PROBE)
      assert.are.equal(0, r.code, r.stderr)
      assert.matches("probe done\n$", r.stdout)
      local breaches = {}
      for line in r.stdout:gmatch("[^\n]+") do
        if line:match("^breach") then breaches[#breaches + 1] = line end
      end
      assert.are.same({}, breaches, r.stdout)
      assert.are.equal("still\n", sh(id, "echo still"))
    end))

  it("refuses forged, malformed and flooding frames on the channel, leaks no descriptor and keeps " ..
    "starting commands", async(function()
      local id = new_sandbox("forge")
      -- measured after a command: an exec's end means the init has closed what it held for it
      sh(id, "true")
      local before = init_fds(id)
      local sb = eng.sandboxes[id]
      local code, out, err = host_py(FORGE, { sb.keeper.pid, sb.channel })
      assert.are.equal(0, code, err)
      assert.matches("done\n$", out)
      -- 15 malformed frames x 40 rounds and one over the frame limit, each with a reply socket:
      -- every one answered EINVAL
      assert.are.equal("answered 601 refused 0", out:match("(answered %d+ refused %d+)"), out)
      -- the channel is in order: once this command has ended, every forged frame was handled
      assert.are.equal("ok\n", sh(id, "echo ok"))
      assert.are.equal(before, init_fds(id), "the init holds descriptors a forged frame left")
      assert.is_true(eng:alive(id))
    end))

  it("keeps starting commands while the sandbox floods its init with signals", async(function()
    local id = new_sandbox("signals")
    sh(id, "(for i in $(seq 1 200000); do kill -CHLD 1; kill -TERM 1; kill -USR1 1; done) " ..
      ">/dev/null 2>&1 </dev/null & echo started")
    local tasks = {}
    for i = 1, 20 do
      tasks[i] = task.spawn(function() return eng:run(id, "echo " .. i .. "; exit " .. (i % 7)) end)
    end
    for i, t in ipairs(tasks) do
      local r = task.join(t)
      assert.are.equal(i % 7, r.code, r.stderr)
      assert.are.equal(i .. "\n", r.stdout)
    end
    assert.is_true(eng:alive(id))
  end))

  it("starts a command with the kernel's OOM score, in a session of its own, killable with its group",
    async(function()
      local id = new_sandbox("oom")
      assert.are.equal("0\n", sh(id, "cat /proc/self/oom_score_adj"))
      assert.are.equal("True\n", sh(id, "python3 -c 'import os; print(os.getsid(0) == os.getpid())'"))
      local h = eng:exec(id, "sleep 1000 & sleep 1001")
      local deadline = task.now() + 10
      local count = 0
      while task.now() < deadline do
        count = tonumber((sh(id, "pgrep -c -x sleep || true"):match("%d+"))) or 0
        if count == 2 then break end
        task.sleep(0.02)
      end
      assert.are.equal(2, count)
      assert.is_true(h:kill("KILL"))
      local code = h:wait()
      assert.are.equal(137, code)
      deadline = task.now() + 10
      while task.now() < deadline do
        count = tonumber((sh(id, "pgrep -c -x sleep || true"):match("%d+"))) or 0
        if count == 0 then break end
        task.sleep(0.02)
      end
      assert.are.equal(0, count, "a killed exec's group outlived it")
    end))

  it("runs plain words and argv without bash, and everything else, or a missing program, with it",
    async(function()
      local id = new_sandbox("words")
      -- plain words: the program itself (its parent is the init, no bash in between)
      assert.are.equal("1\n", sh(id, "python3 -c 'import os; print(os.getppid())'"))
      -- shell syntax: bash reads it (bash runs its last command with exec, so ask $PPID of a child)
      assert.are.equal("bash\n", sh(id, "python3 -c 'import os; print(open(\"/proc/%d/comm\" % os.getppid()).read().strip())'; true"))
      -- a builtin
      assert.are.equal("x\n", sh(id, "printf 'x\\n'"))
      local r = eng:run(id, "exit 3")
      assert.are.equal(3, r.code)
      -- a missing program: bash's own words and status
      r = eng:run(id, "no-such-program --flag")
      assert.are.equal(127, r.code)
      assert.matches("no%-such%-program: command not found", r.stderr)
      -- argv: each element literally, no shell
      assert.are.equal("$HOME *\n", sh(id, { "/bin/echo", "$HOME", "*" }))
      r = eng:run(id, { "no-such-program" })
      assert.are.equal(127, r.code)
      -- the environment bash would have exported, but `_`
      local function env_set(text)
        local set = {}
        for line in text:gmatch("[^\n]+") do
          if not line:match("^_=") then set[#set + 1] = line end
        end
        table.sort(set)
        return set
      end
      assert.are.same(env_set(sh(id, "env; true")), env_set(sh(id, "env")))
    end))
end)
