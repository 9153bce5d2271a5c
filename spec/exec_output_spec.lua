-- The exec output path: response:read_output (bindings/http.c) and the output event decoder
-- (runtime/output_event.c) against moonbox's own HTTP server on loopback, compared with the
-- general JSON decoder (lua-cjson) on the same events.
local http = require "moonbox.http"
local with_server = require("spec.support.http_server").with
local sse = require "moonbox.sse"
local cjson = require "cjson"


-- Payloads whose JSON text exercises every escape, NUL, a surrogate pair, raw UTF-8 and raw
-- bytes that are not UTF-8 (a JSON decoder copies those as they are).
local DATA_TEXTS = {
  [["hi\n"]],
  [["a\u0000b\u0000"]],
  [["quote \" backslash \\ slash \/ \b\f\n\r\t"]],
  [["\u00e9\u20ac\ud83d\ude00 and é€"]],
  "\"raw \255\254 bytes\"",
  [[""]],
  '"' .. string.rep("0123456789abcdef\\n", 4096) .. '"',
}

describe("sse.decode_output", function()
  it("decodes exactly what the JSON decoder does, for both streams and both key orders", function()
    for _, text in ipairs(DATA_TEXTS) do
      for _, stream in ipairs({ "stdout", "stderr" }) do
        local want = cjson.decode('{"data":' .. text .. '}').data
        for _, json in ipairs({ '{"stream":"' .. stream .. '","data":' .. text .. '}',
          ' { "data" : ' .. text .. ' ,\n "stream" : "' .. stream .. '" } ' }) do
          local s, bytes = sse.decode_output(json)
          assert.are.equal(stream, s, json:sub(1, 60))
          assert.are.equal(want, bytes, json:sub(1, 60))
        end
      end
    end
  end)

  it("gives back the bytes of random strings the JSON encoder escaped", function()
    -- quotes, backslashes, controls, NULs, high bytes, each at every offset of an 8-byte word
    local alphabet = { "a", "b", "\"", "\\", "/", "\n", "\0", "\1", "\31", " ", "\127", "\128", "\255", "é" }
    math.randomseed(13)
    for _ = 1, 500 do
      local parts = {}
      for k = 1, math.random(0, 80) do parts[k] = alphabet[math.random(#alphabet)] end
      local text = table.concat(parts)
      local stream, bytes = sse.decode_output(cjson.encode({ stream = "stdout", data = text }))
      assert.are.equal("stdout", stream)
      assert.are.equal(text, bytes)
    end
  end)

  it("declines every other shape, leaving it to the JSON decoder", function()
    for _, json in ipairs({
      '{"stream":"stdout"}', '{"data":"x"}', '{"stream":"stdin","data":"x"}',
      '{"stream":"stdout","data":"x","extra":1}', '{"stream":"stdout","data":1}',
      '{"stream":"stdout","data":"lone \\ud800 surrogate"}', '{"stream":"stdout","data":"\\udc00"}',
      '{"stream":"stdout","data":"bad \\x escape"}', '{"stream":"stdout","data":"raw \1 control"}',
      '{"stream":"stdout","data":"unterminated}', '{"stream":"stdout","data":"x"} trailing',
      '{"stream":"stdout","stream":"stderr"}', '[]', '',
    }) do
      assert.is_nil(sse.decode_output(json), json)
    end
  end)
end)

describe("response:read_output", function()
  it("delivers the exact bytes of every output event, however the stream is cut", with_server(function(srv)
    -- one stream of events, written in pieces that cut events, lines and escapes anywhere
    local events, want = {}, { stdout = {}, stderr = {} }
    for i, text in ipairs(DATA_TEXTS) do
      local stream = i % 3 == 0 and "stderr" or "stdout"
      events[#events + 1] = "event: output\ndata: {\"stream\":\"" .. stream .. "\",\"data\":" .. text .. "}\n\n"
      local t = want[stream]
      t[#t + 1] = cjson.decode('{"data":' .. text .. '}').data
    end
    -- an output event of another shape arrives raw, as does every other event
    events[#events + 1] = 'event: output\ndata: {"stream":"stdout","data":"odd","extra":true}\n\n'
    events[#events + 1] = 'event: exit\r\ndata: {"exit_code":\r\ndata: 3}\r\n\r\n'
    local body = table.concat(events)
    srv:route("GET", "/run", function(_, res)
      local w = res:stream(200, { ["Content-Type"] = "text/event-stream" })
      local i, step = 1, 1
      while i <= #body do
        w:write(body:sub(i, i + step - 1))
        i = i + step
        step = step % 97 + 1 -- 1 to 97 bytes, so every boundary is hit somewhere
      end
      w:close()
    end)
    local resp <close> = http.stream { url = srv.url .. "/run" }
    local got, raw = { stdout = {}, stderr = {} }, {}
    while true do
      local event, stream, payload = resp:read_output()
      if not event then break end
      if stream then
        assert.are.equal("output", event)
        local t = got[stream]
        t[#t + 1] = payload
      else
        raw[#raw + 1] = { event, payload }
      end
    end
    assert.are.equal(table.concat(want.stdout), table.concat(got.stdout))
    assert.are.equal(table.concat(want.stderr), table.concat(got.stderr))
    assert.are.same({ { "output", '{"stream":"stdout","data":"odd","extra":true}' },
      { "exit", '{"exit_code":\n3}' } }, raw)
  end))

  it("raises malformed_response for an event past the size limit", with_server(function(srv)
    srv:route("GET", "/big", function(_, res)
      local w = res:stream(200, { ["Content-Type"] = "text/event-stream" })
      w:write('event: output\ndata: {"stream":"stdout","data":"' .. string.rep("x", 4096) .. '"}\n\n')
      w:close()
    end)
    local resp <close> = http.stream { url = srv.url .. "/big", max_event = 1024 }
    local ok, err = pcall(resp.read_output, resp)
    assert.is_false(ok)
    assert.are.equal("malformed_response", err.code)
  end))
end)
