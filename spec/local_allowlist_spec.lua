-- Pins the allow-list network policy of `moonbox local` ({"default":"allow-list",
-- "allowedDomains":[...]}): HTTP (by Host) and HTTPS (by SNI) to the listed names only, a
-- leftmost "*." covering every name below it but not the name itself, DNS answered for listed
-- names only, and everything else refused — other names on the same server, listed names sent
-- to other addresses, raw TCP, UDP, other resolvers, and listed names that resolve to the host or
-- to slirp4netns's alias of the host's loopback. Every check runs from inside a real sandbox against real servers (nginx with TLS,
-- dnsmasq) in a network namespace this spec makes (spec/support/named_net.lua), named through
-- the sandbox's own resolver; the servers' logs prove what reached them. The last part runs the
-- same through a real `moonbox local` over HTTP, with the API's validation of allowedDomains.
--
-- Needs root, the default image, slirp4netns, nftables, iproute2, nginx-light, dnsmasq-base,
-- openssl and python3 (./dev setup installs them); a missing one fails the first test with a
-- sentence naming its package. deny-all and allow-all are spec/local_isolation_spec.lua's; the
-- contrast checks here only show that the same servers are reachable without the gate.
local T = require "moonbox.testing"
local json = require "moonbox.json"
local proc = require "moonbox.proc"
local Engine = require "moonbox.local.engine"
local image = require "moonbox.local.image"
local H = require "spec.support.isolation_host"
local N = require "spec.support.named_net"
local L = require "spec.support.local_backend"
local files = require "spec.support.files"

local async = T.async
local RUN = files.run_tag()
local STATE = "/tmp/moonbox-allowlist-spec-" .. RUN
local net, eng
local created = {}

-- Creates sandbox "al-<name>" with opts (allow = list: an allow-list) and puts the test CA at
-- /root/ca.crt inside it. [yields]
local function sandbox(name, allow, network)
  local id = "al-" .. name
  created[#created + 1] = id
  eng:create(id, { network = network or "allow-list", allowed = allow })
  local r = eng:run(id, "cat > /root/ca.crt <<'MOONBOX_CA'\n" .. net.ca .. "MOONBOX_CA")
  assert(r.code == 0, r.stderr)
  return id
end

-- Runs command in sandbox id; returns stdout .. "[exit]".
local function run(id, command)
  local r = eng:run(id, command)
  return r.stdout .. "[" .. tostring(r.code) .. "]", r
end

-- curl from inside: prints the body (or nothing) and "[curl's exit code]".
local function curl(id, args)
  return run(id, "curl -sS --max-time 10 --cacert /root/ca.crt " .. args .. " 2>&1")
end

-- Requests the test servers answered for host so far (every one answered before the call).
local function requests_for(host)
  local n = 0
  for line in net:settled_access_log():gmatch("[^\n]+") do
    if line:match("^(%S+)") == host then n = n + 1 end
  end
  return n
end

describe("moonbox local allow-list", function()
  setup(async(function()
    net = N.start()
    eng = Engine.new { state_dir = STATE, image = image.path(), dns = net.addr, disk = false }
    local chk = eng:check()
    assert(chk.ok, "this machine cannot run sandboxes: " .. table.concat(chk.problems, "; "))
  end))

  teardown(async(function()
    for _, id in ipairs(created) do pcall(eng.terminate, eng, id) end
    if net then net:close() end
    L.remove_trees(STATE)
  end))

  describe("an exact name", function()
    local id
    setup(async(function() id = sandbox("exact", { "allowed.test" }) end))

    it("is resolved through the sandbox's resolver and reached over HTTP and HTTPS", async(function()
      assert.are.equal("nameserver 10.200.0.1\n", eng:run(id, "cat /etc/resolv.conf").stdout)
      assert.matches("^" .. net.addr:gsub("%.", "%%.") .. "%s+allowed%.test", run(id, "getent hosts allowed.test"))
      assert.are.equal("served allowed.test\n[0]", curl(id, "http://allowed.test/"))
      assert.are.equal("served allowed.test\n[0]", curl(id, "https://allowed.test/"))
      -- a body larger than any buffer of the gate, both ways
      local r = run(id, "head -c 3000000 /dev/zero | curl -sS --max-time 20 --cacert /root/ca.crt " ..
        "-X POST --data-binary @- -o /dev/null -w '%{http_code}' https://allowed.test/")
      assert.are.equal("200[0]", r)
      assert.are.equal(net.big_size .. "\n[0]", run(id, "curl -sS --max-time 20 --cacert /root/ca.crt " ..
        "https://allowed.test/big | wc -c"))
    end))

    it("does not cover names below it", async(function()
      assert.are.equal("[2]", run(id, "getent hosts a.allowed.test"))
      local before = requests_for("a.allowed.test")
      local out = curl(id, "--resolve a.allowed.test:80:" .. net.addr .. " http://a.allowed.test/")
      assert.matches("refused HTTP to " .. net.addr:gsub("%.", "%%.") .. ": the host a%.allowed%.test is not in " ..
        "the allow%-list", out)
      assert.matches("%[35%]$", curl(id, "--resolve a.allowed.test:443:" .. net.addr .. " https://a.allowed.test/"))
      assert.are.equal(before, requests_for("a.allowed.test"))
    end))
  end)

  describe("a leftmost wildcard", function()
    local id
    setup(async(function() id = sandbox("wild", { "*.allowed.test" }) end))

    it("covers every name below it, at any depth, over HTTP and HTTPS", async(function()
      assert.are.equal("served a.allowed.test\n[0]", curl(id, "http://a.allowed.test/"))
      assert.are.equal("served a.allowed.test\n[0]", curl(id, "https://a.allowed.test/"))
      assert.are.equal("served x.y.allowed.test\n[0]", curl(id, "http://x.y.allowed.test/"))
    end))

    it("does not cover the name itself", async(function()
      assert.are.equal("[2]", run(id, "getent hosts allowed.test"))
      local before = requests_for("allowed.test")
      assert.matches("the host allowed%.test is not in the allow%-list",
        curl(id, "--resolve allowed.test:80:" .. net.addr .. " http://allowed.test/"))
      assert.matches("%[35%]$", curl(id, "--resolve allowed.test:443:" .. net.addr .. " https://allowed.test/"))
      assert.are.equal(before, requests_for("allowed.test"))
    end))
  end)

  describe("everything else", function()
    local id
    setup(async(function() id = sandbox("rest", { "allowed.test", "*.allowed.test" }) end))

    it("refuses a name not listed, though it is served from the same address", async(function()
      assert.are.equal("[2]", run(id, "getent hosts other.test"))
      assert.matches("the host other%.test is not in the allow%-list",
        curl(id, "--resolve other.test:80:" .. net.addr .. " http://other.test/"))
      assert.matches("%[35%]$", curl(id, "--resolve other.test:443:" .. net.addr .. " https://other.test/"))
      -- a listed Host or SNI does not carry another name along in the request itself
      assert.matches("names no host it can check",
        curl(id, "-H 'Host: allowed.test' --proxy http://" .. net.addr .. ":80 http://other.test/"))
      local twice = run(id, "printf 'GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\nHost: other.test\\r\\n\\r\\n' | " ..
        "curl -sS --max-time 10 telnet://" .. net.addr .. ":80 2>&1 | head -1")
      assert.matches("^HTTP/1.1 403", twice)
      assert.are.equal(0, requests_for("other.test"))
    end))

    it("refuses a listed name sent to an address its DNS did not give", async(function()
      assert.matches("the host allowed%.test was not resolved to this address",
        curl(id, "-H 'Host: allowed.test' http://" .. net.far .. "/"))
      assert.matches("%[35%]$", curl(id, "--resolve allowed.test:443:" .. net.far .. " https://allowed.test/"))
      assert.are.equal(0, requests_for("far.test"))
    end))

    it("refuses raw TCP, on any port, to any address", async(function()
      local out = run(id, "curl -sS --max-time 10 telnet://" .. net.addr .. ":" .. net.listener.port ..
        " </dev/null 2>&1; echo; curl -sS --max-time 10 telnet://10.200.0.1:22 </dev/null 2>&1")
      assert.is_nil(out:find(net.listener.secret, 1, true), out)
      assert.matches("Couldn't connect", out)
      assert.are.same({}, net.listener:connections_before_sentinel())
    end))

    it("drops UDP, and answers DNS itself whatever resolver is asked", async(function()
      run(id, "python3 -c \"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(" ..
        "b'from-the-sandbox', ('" .. net.addr .. "', " .. net.udp_port .. "))\"")
      assert.are.same({}, net:datagrams_before_sentinel())
      -- asked directly, dnsmasq would say other.test is .2; the gate answers instead
      local q = eng:run(id, "python3 - other.test " .. net.addr .. " <<'PY'\n" .. N.DNS_QUERY .. "\nPY")
      assert.are.equal("rcode 3 \n", q.stdout, q.stderr)
      q = eng:run(id, "python3 - allowed.test " .. net.addr .. " 28 <<'PY'\n" .. N.DNS_QUERY .. "\nPY")
      assert.are.equal("rcode 0 \n", q.stdout, q.stderr) -- AAAA: none (the sandbox has IPv4 only)
    end))

    it("refuses a listed name that resolves to the host or to its loopback alias", async(function()
      local host80 = H.listener(net.host_addr, "host-secret-" .. RUN)
      local ok, err = pcall(function()
        assert.matches("the host alias%.allowed%.test resolved to an address never reachable",
          curl(id, "http://alias.allowed.test/"))
        local out = curl(id, "http://host.allowed.test:" .. host80.port .. "/")
        assert.is_nil(out:find(host80.secret, 1, true), out)
        -- port 80 on the host's own address: the gate connects, the host's firewall refuses
        out = curl(id, "http://host.allowed.test/")
        assert.is_nil(out:find("served", 1, true), out)
        assert.are.same({}, host80:connections_before_sentinel())
      end)
      host80:close()
      assert(ok, err)
    end))

    it("survives garbage and floods of its own sandbox, and still serves", async(function()
      local out = run(id, "head -c 40000 /dev/urandom | curl -sS --max-time 10 telnet://" .. net.addr ..
        ":443 2>&1 >/dev/null; head -c 40000 /dev/zero | tr '\\0' 'a' | curl -sS --max-time 10 telnet://" ..
        net.addr .. ":80 2>&1 >/dev/null; python3 - <<'PY'\n" .. [[
import socket
socks = []
for i in range(600):
    s = socket.socket()
    try:
        s.connect((']] .. net.addr .. [[', 80))
        socks.append(s)
    except OSError:
        pass
print("opened", len(socks))
PY]])
      assert.matches("opened %d+", out)
      assert.are.equal("served allowed.test\n[0]", curl(id, "https://allowed.test/"))
    end))
  end)

  -- DNS a sandbox makes by hand, against a resolver that answers whatever it is asked with the
  -- attacker's address (net.far, where nginx serves any Host): a name the gate checked must be
  -- the name that goes upstream, so a NUL, a dot or an odd byte inside a label, or a compression
  -- pointer, is refused at the gate and never asked; what goes upstream is the query rebuilt; an
  -- answer counts only for the question it answers.
  describe("a DNS query made by hand", function()
    local evil_eng, resolver, id
    local sentinels = 0

    -- Logs every query as "query <hex>"; answers each with its own question and one A record,
    -- net.far (argv[1]), except mismatch.wild.test, answered as if it had asked allowed.test.
    local RESOLVER = [[
import socket, struct, sys
far = sys.argv[1]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((far, 53))
print("ready", flush=True)
def enc(name):
    return b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
while True:
    q, a = s.recvfrom(4096)
    print("query", q.hex(), flush=True)
    if len(q) < 17:
        continue
    off = 12
    while off < len(q) and 0 < q[off] < 64:
        off += q[off] + 1
    off += 2 if off < len(q) and q[off] >= 192 else 1
    question = q[12:off + 4]
    if question[:-4] == enc("mismatch.wild.test"):
        question = enc("allowed.test") + question[-4:]
    r = q[:2] + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0) + question
    r += b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton(far)
    s.sendto(r, a)
]]

    -- Sends each hand-made query to the sandbox's resolver; prints "<case> <rcode> <addrs>" or
    -- "<case> none" (no answer in 2 s).
    local ASK = [[
import random, socket, struct
def enc(*labels):
    return b"".join(bytes([len(l)]) + l for l in labels) + b"\0"
cases = [
    ("nul-exact", enc(b"allowed", b"test\0", b"evil")),
    ("nul-last", enc(b"allowed", b"test\0")),
    ("nul-wild", enc(b"a", b"wild", b"test\0", b"evil")),
    ("dot-exact", enc(b"allowed.test")),
    ("dot-wild", enc(b"x.wild", b"test")),
    ("dot-wild-suffix", enc(b"y", b"wild.test")),
    ("odd-byte", enc(b"allowed\xff", b"test")),
    ("space", enc(b"a b", b"wild", b"test")),
    ("pointer", b"\x01p\xc0\x14"),  # to offset 20, after the question
    ("pointer-loop", b"\xc0\x0c"),
    ("label-type", b"\x41" + b"a" * 65 + enc(b"test")),
    ("ctl", enc(b"CTL", b"Wild", b"test")),
    ("mismatch", enc(b"mismatch", b"wild", b"test")),
]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
for name, qname in cases:
    qid = random.randrange(65536)
    ar = 1 if name == "ctl" else 0
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, ar) + qname + struct.pack(">HH", 1, 1)
    if name == "pointer":
        q += enc(b"wild", b"test")  # what the pointer points at, after the question
    if name == "ctl":
        q += b"\0" + struct.pack(">HHIH", 41, 1232, 0, 0) + b"trailing bytes"  # EDNS, then junk
    s.sendto(q, ("10.200.0.1", 53))
    try:
        while True:
            m = s.recv(4096)
            if m[:2] == q[:2]:
                break
    except socket.timeout:
        print(name, "none")
        continue
    rcode, qd, an = m[3] & 15, struct.unpack(">H", m[4:6])[0], struct.unpack(">H", m[6:8])[0]
    addrs = []
    try:
        off = 12
        for _ in range(qd):
            while m[off] and m[off] < 192:
                off += m[off] + 1
            off += (2 if m[off] >= 192 else 1) + 4
        for _ in range(an):
            while m[off] and m[off] < 192:
                off += m[off] + 1
            off += 2 if m[off] >= 192 else 1
            t, _, _, rdlen = struct.unpack(">HHIH", m[off:off + 10])
            off += 10
            if t == 1:
                addrs.append(socket.inet_ntoa(m[off:off + 4]))
            off += rdlen
    except (IndexError, struct.error):
        addrs.append("(malformed)")
    print(name, rcode, " ".join(addrs))
]]

    -- The queries the resolver got before one the host sends it now, as byte strings. [yields]
    local function queries_before_sentinel()
      sentinels = sentinels + 1
      local mark = "sentinel-" .. sentinels
      local r = proc.run { H.PYTHON, "-c", N.DNS_QUERY, mark .. ".test", net.far }
      assert(r.code == 0, "the resolver did not answer the sentinel: " .. r.stderr)
      local got = {}
      while true do
        local line = assert(resolver.lines(), "the spec's resolver ended")
        local hex = line:match("^query (%x+)$")
        if hex then
          local q = hex:gsub("%x%x", function(h) return string.char(tonumber(h, 16)) end)
          if q:find(string.char(#mark) .. mark .. "\4test\0", 1, true) then return got end
          got[#got + 1] = q
        end
      end
    end

    -- The question name of query q as "a.b.c" if it is length-prefixed labels of host-name
    -- bytes alone, and whether q is that one question and nothing else (a rebuilt query).
    local function question_of(q)
      local off, labels = 13, {}
      while true do
        local l = q:byte(off)
        if not l or l == 0 or l > 63 then break end
        local label = q:sub(off + 1, off + l)
        if not label:match("^[%w_-]+$") then return nil, false end
        labels[#labels + 1] = label
        off = off + 1 + l
      end
      local counts = { q:byte(5, 12) }
      local clean = q:byte(off) == 0 and #q == off + 4 and
        table.concat(counts, ",") == "0,1,0,0,0,0,0,0"
      return table.concat(labels, "."), clean
    end

    setup(async(function()
      local p = proc.spawn { H.IP, "netns", "exec", net.ns, H.PYTHON, "-c", RESOLVER, net.far }
      resolver = { p = p, lines = p:lines("stdout") }
      assert(resolver.lines() == "ready", "the spec's resolver did not start")
      evil_eng = Engine.new { state_dir = STATE .. "-evil", image = image.path(), dns = net.far, disk = false }
      id = "al-byhand"
      evil_eng:create(id, { network = "allow-list", allowed = { "allowed.test", "*.wild.test" } })
    end))

    teardown(async(function()
      if evil_eng then pcall(evil_eng.terminate, evil_eng, id) end
      if resolver then
        pcall(resolver.p.kill, resolver.p, "KILL")
        pcall(resolver.p.wait, resolver.p)
      end
      proc.run { "rm", "-rf", "--one-file-system", STATE .. "-evil" }
    end))

    it("refuses a name with a NUL, a dot or an odd byte in a label, or a pointer, and asks " ..
      "upstream only the rebuilt query it checked", async(function()
        local before = {}
        for _, host in ipairs { "allowed.test", "a.wild.test", "x.wild.test", "y.wild.test", "p.wild.test",
          "mismatch.wild.test" } do
          before[host] = requests_for(host)
        end
        local r = evil_eng:run(id, "python3 - <<'PY'\n" .. ASK .. "\nPY")
        assert.are.equal(0, r.code, r.stderr)
        local far = net.far
        assert.are.equal(table.concat({
          "nul-exact 5 ", "nul-last 5 ", "nul-wild 5 ", "dot-exact 5 ", "dot-wild 5 ", "dot-wild-suffix 5 ",
          "odd-byte 5 ", "space 5 ", "pointer 1 ", "pointer-loop 1 ", "label-type 1 ",
          "ctl 0 " .. far, "mismatch none", "" }, "\n"), r.stdout)

        -- upstream got only the two names that passed, each as one clean question
        local asked = {}
        for _, q in ipairs(queries_before_sentinel()) do
          local name, clean = question_of(q)
          asked[#asked + 1] = tostring(name) .. (clean and "" or " (not rebuilt: " .. #q .. " bytes)")
        end
        table.sort(asked)
        assert.are.same({ "ctl.wild.test", "mismatch.wild.test" }, asked)

        -- and no answer of the attacker's became an address of a listed name
        local function to_far(host)
          local c = evil_eng:run(id, "curl -sS --max-time 10 -H 'Host: " .. host .. "' http://" .. far .. "/ 2>&1")
          return c.stdout
        end
        for host in pairs(before) do
          local pattern = "the host " .. host:gsub("%p", "%%%0") .. " was not resolved to this address"
          assert.matches(pattern, to_far(host))
        end
        assert.are.equal("served ctl.wild.test\n", to_far("ctl.wild.test"))
        for host, n in pairs(before) do assert.are.equal(n, requests_for(host), host) end
      end))
  end)

  it("contrast: allow-all reaches the same servers without the gate; deny-all none", async(function()
    local all = sandbox("all", nil, "allow-all")
    assert.are.equal("served other.test\n[0]", curl(all, "--resolve other.test:443:" .. net.addr ..
      " https://other.test/"))
    local none = sandbox("none", nil, "deny-all")
    assert.matches("%[7%]$", curl(none, "--resolve allowed.test:80:" .. net.addr .. " http://allowed.test/"))
  end))

  it("leaves nothing of the gate behind when its sandbox ends", async(function()
    local id = sandbox("gone", { "allowed.test" })
    local base = eng:info(id).uid_base
    assert.are.equal("served allowed.test\n[0]", curl(id, "http://allowed.test/"))
    local procs = H.processes_in_range(base)
    local gate = false
    for _, p in ipairs(procs) do if p:match(" " .. (base + 65534) .. " ") then gate = true end end
    assert.is_true(gate, "no gate process (uid " .. (base + 65534) .. ") among " .. table.concat(procs, ", "))
    eng:terminate(id)
    assert.are.same({}, H.processes_in_range(base))
  end))

  describe("through moonbox local over HTTP", function()
    local b
    setup(async(function() b = L.start { args = { "--dns", net.addr } } end))
    teardown(async(function() if b then b:destroy() end end))

    local function create(policy)
      return b:req("POST", "/v1/sandboxes", { body = { ownerId = L.WORKSPACE, networkPolicy = policy } })
    end

    it("creates an allow-list sandbox that keeps its policy and enforces it", async(function()
      local policy = { default = "allow-list", allowedDomains = { "allowed.test", "*.allowed.test" } }
      local sb = b:create { networkPolicy = policy }
      assert.are.same(policy, sb.networkPolicy)
      local ex = b:exec(sb.id, "curl -sS --max-time 10 http://a.allowed.test/; " ..
        "curl -sS --max-time 10 --resolve other.test:80:" .. net.addr .. " http://other.test/")
      assert.are.equal(0, ex.code, json.encode(ex))
      assert.matches("^served a%.allowed%.test\nmoonbox allow%-list: refused HTTP to [%d.]+: the host other%.test is " ..
        "not in the allow%-list", ex.stdout)
      b:req("DELETE", "/v1/sandboxes/" .. sb.id)
    end))

    it("rejects allowedDomains it cannot enforce, naming the entry and why", async(function()
      local cases = {
        { { default = "allow-list" }, "allowedDomains is required with default allow%-list" },
        { { default = "deny-all", allowedDomains = { "a.test" } }, "only valid with default allow%-list" },
        { { default = "allow-list", allowedDomains = "a.test" }, "must be an array" },
        { { default = "allow-list", allowedDomains = { "ok.test", "https://a.test/x" } }, "%[1%]: .*is a URL" },
        { { default = "allow-list", allowedDomains = { "a.test:8443" } }, "%[0%]: .*has a port" },
        { { default = "allow-list", allowedDomains = { "a.*.test" } }, "only a leftmost" },
        { { default = "allow-list", allowedDomains = { "10.1.2.3" } }, "is an IP address" },
        { { default = "allow-list", allowedDomains = { "bad name.test" } }, "is not a host name" },
        { { default = "allow-list", allowedDomains = { 7 } }, "expected a host name string" },
      }
      for _, c in ipairs(cases) do
        local status, body = create(c[1])
        assert.are.equal(400, status, json.encode(c[1]) .. " -> " .. json.encode(body))
        assert.matches(c[2], body.message, json.encode(c[1]))
      end
    end))
  end)
end)
