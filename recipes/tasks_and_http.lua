-- recipes/tasks_and_http.lua — tasks and HTTP concurrency on one event loop.
--
-- A tiny HTTP server runs in this same process (each request is handled by its own task),
-- and 200 client tasks fetch from it, at most 32 at a time. A slow endpoint shows a deadline
-- cancelling a request, and a scope shows that the first failure cancels its siblings.
-- Everything waits without blocking anything else: it is all one thread, one libev loop.
--
--   moonbox run recipes/tasks_and_http.lua [COUNT]
local task = require "moonbox.task"
local http = require "moonbox.http"
local httpd = require "moonbox.httpd"

local count = tonumber(arg and arg[1]) or 200

local srv <close> = httpd.listen { host = "127.0.0.1", port = 0 }
srv:route("GET", "/square/:n", function(req)
  local n = tonumber(req.captures.n)
  task.sleep(0.001 * (n % 5)) -- a little latency: handlers wait concurrently too
  return 200, tostring(n * n), { ["Content-Type"] = "text/plain" }
end)
srv:route("GET", "/slow", function()
  task.sleep(30)
  return 200, "too late"
end)
print(("serving on %s"):format(srv.url))

-- 1. Fan out: `count` requests, at most 32 in flight, results in order.
local started = task.now()
local numbers = {}
for i = 1, count do numbers[i] = i end
local squares, stats = task.map(numbers, function(n)
  return tonumber(http.request { url = srv.url .. "/square/" .. n, timeout = 10 }.body)
end, { concurrency = 32 })
local sum = 0
for i, v in ipairs(squares) do
  assert(v == i * i, "wrong square for " .. i)
  sum = sum + v
end
print(("%d requests in %.0f ms, at most %d in flight; sum of squares = %d")
  :format(count, (task.now() - started) * 1000, stats.peak, sum))

-- 2. A deadline: the slow request is cancelled after 0.2 s (its transfer is aborted).
local ok, err = pcall(task.timeout, 0.2, function()
  return http.request { url = srv.url .. "/slow" }
end)
assert(not ok and task.is_timeout(err))
print("slow request: " .. tostring(err))

-- 3. Structured concurrency: one failing child cancels its siblings; the error surfaces here.
local cancelled = 0
ok, err = pcall(task.scope, function(s)
  for _ = 1, 3 do
    s:spawn(function()
      local _guard <close> = setmetatable({}, { __close = function(_, e)
        if task.is_cancelled(e) then cancelled = cancelled + 1 end
      end })
      http.request { url = srv.url .. "/slow" }
    end)
  end
  s:spawn(function()
    task.sleep(0.05)
    error("worker 4 gave up")
  end)
end)
assert(not ok and tostring(err):find("worker 4 gave up"))
print(("scope: %q; %d siblings cancelled"):format(tostring(err), cancelled))
assert(cancelled == 3)
print("done")
