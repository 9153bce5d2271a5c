-- bench/exec_stream.lua URL MIB MODE — the client side of the exec output path alone: reads
-- bench_server's GET /_exec?mib=MIB (an exec stream of 64 KiB output events, as a backend sends
-- it) and counts the output bytes. MODE `output`: resp:read_output (what sb:exec does);
-- `event`: resp:read_event + JSON decoding per event (what it did before). Prints MB/s of
-- payload. bench/README.md has the commands that compare both with curl into /dev/null.
local http = require "moonbox.http"
local json = require "moonbox.json"
local core = require "moonbox.core"

local url, mib, mode = arg[1], tonumber(arg[2]), arg[3]
local t0 = core.time()
local resp <close> = http.stream { url = url .. "/_exec?mib=" .. mib, buffer = 1024 * 1024 }
local bytes, exit_code = 0, nil
if mode == "output" then
  while true do
    local event, stream, payload = resp:read_output()
    if not event then break end
    if stream then
      bytes = bytes + #payload
    elseif event == "exit" then
      exit_code = json.decode(payload).exit_code
    end
  end
else
  while true do
    local ev = resp:read_event()
    if not ev then break end
    local d = json.decode(ev.data)
    if ev.event == "output" then bytes = bytes + #d.data elseif ev.event == "exit" then exit_code = d.exit_code end
  end
end
local secs = core.time() - t0
assert(exit_code == 0 and bytes >= mib * 1024 * 1024, "got " .. bytes .. " bytes")
print(string.format("%s: %.0f MB/s (%d bytes in %.3f s)", mode, bytes / secs / 1e6, bytes, secs))
