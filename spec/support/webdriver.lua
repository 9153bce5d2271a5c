--- spec.support.webdriver — headless Chromium (Debian's chromium + chromium-driver) driven over
-- the W3C WebDriver HTTP protocol with moonbox's own HTTP client: start chromedriver on a free
-- loopback port, open one session (one browser per spec file), navigate, run a script that
-- reads the page, find and click elements, type, take a screenshot.
--
-- The browser gets the flags that keep it off the network (no background networking, no
-- component updates, no sync, no QUIC) and a new empty profile and HOME in a temp dir, so it
-- never writes to the machine's own profile and never talks to anything but loopback.
local proc = require "moonbox.proc"
local http = require "moonbox.http"
local json = require "moonbox.json"
local task = require "moonbox.task"
local httpd = require "moonbox.httpd"

local M = {}
local Browser = {}
Browser.__index = Browser

local ELEMENT = "element-6066-11e4-a52e-4f735466cecf"

M.FLAGS = { "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync",
  "--disable-crash-reporter", "--disable-breakpad", "--window-size=1280,1000" }

local function free_port()
  local s <close> = httpd.listen { port = 0 }
  return s.port
end

--- webdriver.start(dir) -> Browser (chromedriver and one Chromium session; dir: a temp dir
-- for the profile and HOME). Raises, naming what is missing, when the packages are not
-- installed. [yields]
function M.start(dir)
  for _, bin in ipairs { "chromium", "chromedriver" } do
    if proc.run({ "sh", "-c", 'command -v "$1"', "sh", bin }).code ~= 0 then
      error(bin .. " is missing: ./dev setup installs Debian's chromium and chromium-driver", 0)
    end
  end
  local port = free_port()
  local p = proc.spawn { "chromedriver", "--port=" .. port, stderr = "stdout",
    env = { HOME = dir, XDG_CONFIG_HOME = dir .. "/config", XDG_CACHE_HOME = dir .. "/cache" } }
  local b = setmetatable({ p = p, base = "http://127.0.0.1:" .. port, dir = dir }, Browser)
  local lines = p:lines()
  task.timeout(30, function()
    while true do
      local l = lines()
      if not l then error("chromedriver exited before it was ready") end
      if l:find("started successfully", 1, true) then return end
    end
  end)
  task.spawn(function() for _ in lines do end end) -- keep its output drained
  local args = table.move(M.FLAGS, 1, #M.FLAGS, 1, {})
  args[#args + 1] = "--user-data-dir=" .. dir .. "/profile" -- new and empty
  local v = b:call("POST", "/session", { capabilities = { alwaysMatch = { ["goog:chromeOptions"] = {
    binary = "/usr/bin/chromium", args = args } } } })
  b.session = v.sessionId
  return b
end

--- browser:call(method, path, body) -> the answer's `value`; raises on a WebDriver error. [yields]
function Browser:call(method, path, body)
  local r = http.request { method = method, url = self.base .. path, timeout = 60,
    headers = { ["Content-Type"] = "application/json" }, body = body and json.encode(body) or nil }
  local ok, v = pcall(json.decode, r.body)
  if not ok then error("webdriver " .. method .. " " .. path .. ": HTTP " .. r.status .. ": " .. r.body, 0) end
  if r.status ~= 200 then
    error(string.format("webdriver %s %s: HTTP %d: %s", method, path, r.status,
      json.encode(v.value or v)), 0)
  end
  return v.value
end

function Browser:s(path) return "/session/" .. self.session .. path end

--- browser:go(url) [yields]
function Browser:go(url) return self:call("POST", self:s("/url"), { url = url }) end

--- browser:eval(script, ...) -> the script's return value (it runs as a function body). [yields]
function Browser:eval(script, ...)
  return self:call("POST", self:s("/execute/sync"), { script = script, args = json.array({ ... }) })
end

--- browser:until_true(script, what) -> waits (up to 30 s) until eval(script) is truthy. [yields]
function Browser:until_true(script, what)
  local ok, v = pcall(task.timeout, 30, function()
    while true do
      local r = self:eval(script)
      if r and r ~= json.null then return r end
      task.sleep(0.05)
    end
  end)
  if not ok then error("webdriver: waiting for " .. tostring(what) .. ": " .. tostring(v), 0) end
  return v
end

--- browser:find(css) -> element id. [yields]
function Browser:find(css)
  local v = self:call("POST", self:s("/element"), { using = "css selector", value = css })
  local id = type(v) == "table" and v[ELEMENT]
  if not id then error("webdriver: no element id for " .. css .. ": " .. json.encode(v), 0) end
  return id
end

function Browser:click(css) return self:call("POST", self:s("/element/" .. self:find(css) .. "/click"), {}) end

function Browser:type(css, text)
  return self:call("POST", self:s("/element/" .. self:find(css) .. "/value"), { text = text })
end

--- browser:source() -> the DOM serialized as it is now (after scripts ran). [yields]
function Browser:source() return self:call("GET", self:s("/source")) end

local B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
local function unbase64(s)
  local map = {}
  for i = 1, #B64 do map[B64:byte(i)] = i - 1 end
  local out, bits, n = {}, 0, 0
  for i = 1, #s do
    local v = map[s:byte(i)]
    if v then
      bits, n = (bits << 6) | v, n + 6
      if n >= 8 then
        n = n - 8
        out[#out + 1] = string.char((bits >> n) & 0xff)
      end
    end
  end
  return table.concat(out)
end

--- browser:screenshot(path) -> path of the PNG written. [yields]
function Browser:screenshot(path)
  local png = unbase64(self:call("GET", self:s("/screenshot")))
  local f = assert(io.open(path, "wb"))
  f:write(png)
  f:close()
  return path
end

--- browser:close(): ends the session (the browser exits) and chromedriver. [yields]
function Browser:close()
  if self.session then pcall(self.call, self, "DELETE", self:s("")) end
  self.session = nil
  self.p:kill("TERM")
  pcall(self.p.wait, self.p)
  self.p:close()
end

return M
