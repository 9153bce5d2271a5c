-- moonbox.json and moonbox.strings: the JSON the local backend puts on the wire.
local json = require "moonbox.json"
local strings = require "moonbox.strings"

describe("json.encode", function()
  it("tells empty arrays from empty objects and sorts keys", function()
    assert.are.equal("[]", json.encode(json.array()))
    assert.are.equal("{}", json.encode({}))
    assert.are.equal('{"a":1,"b":[1,2],"c":null}', json.encode({ c = json.null, b = { 1, 2 }, a = 1 }))
  end)

  it("writes integral floats as integers and refuses NaN", function()
    assert.are.equal("[3,0.5]", json.encode({ 3.0, 0.5 }))
    assert.has_error(function() json.encode({ 0 / 0 }) end)
  end)
end)

describe("strings.utf8_cut", function()
  it("cuts before a sequence that would not fit, never inside one", function()
    local s = "a\226\130\172b" -- a, the euro sign (3 bytes), b
    assert.are.equal(1, strings.utf8_cut(s, 1))
    assert.are.equal(1, strings.utf8_cut(s, 2))
    assert.are.equal(1, strings.utf8_cut(s, 3))
    assert.are.equal(4, strings.utf8_cut(s, 4))
    assert.are.equal(5, strings.utf8_cut(s, 9))
    assert.are.equal(0, strings.utf8_cut(s, 0))
  end)

  it("without a limit splits off an incomplete sequence at the end", function()
    assert.are.equal(1, strings.utf8_cut("a\240\159\152")) -- 3 of the 4 bytes of an emoji
    assert.are.equal(5, strings.utf8_cut("a\240\159\152\128"))
    assert.are.equal(2, strings.utf8_cut("a\255")) -- invalid anyway: kept for json_quote to replace
  end)
end)

describe("strings.json_quote", function()
  it("escapes quotes, backslashes and control characters", function()
    assert.are.equal([["a\"b\\c\n\r\t\u0000\u001f"]], strings.json_quote('a"b\\c\n\r\t\0\31'))
  end)

  it("keeps valid UTF-8 and replaces invalid bytes with U+FFFD", function()
    assert.are.equal('"é€😀"', strings.json_quote("é€😀"))
    local r = "\239\191\189"
    assert.are.equal('"a' .. r .. 'b"', strings.json_quote("a\255b"))
    assert.are.equal('"' .. r .. r .. r .. '"', strings.json_quote("\237\160\128")) -- a surrogate
    assert.are.equal('"x' .. r .. r .. '"', strings.json_quote("x\226\130")) -- each byte of a cut sequence
    assert.are.equal('"\239\191\189\239\191\189"', strings.json_quote("\192\175")) -- overlong "/"
  end)

  -- The rule, byte by byte, as plainly as it can be written: what the word-at-a-time C pass must
  -- give for every input.
  local ESC = { ['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t",
    ["\b"] = "\\b", ["\f"] = "\\f" }
  local function reference(s)
    local out, i = { '"' }, 1
    while i <= #s do
      local b = s:byte(i)
      local len = (b >= 0xC2 and b <= 0xDF and 2) or (b >= 0xE0 and b <= 0xEF and 3) or (b >= 0xF0 and b <= 0xF4
        and 4) or 1
      local seq = s:sub(i, i + len - 1)
      if b < 0x80 then
        local c = string.char(b)
        out[#out + 1] = ESC[c] or (b < 0x20 and string.format("\\u%04x", b)) or c
        i = i + 1
      elseif len > 1 and #seq == len and utf8.len(seq) == 1 then
        out[#out + 1] = seq
        i = i + len
      else
        out[#out + 1] = "\239\191\189"
        i = i + 1
      end
    end
    out[#out + 1] = '"'
    return table.concat(out)
  end

  it("quotes every special byte at every offset of a word as the plain rule does", function()
    local specials = { '"', "\\", "\n", "\0", "\31", "\127", "é", "€", "😀", "\255", "\237\160\128", "\192\175",
      "\226\130", "\244\144\128\128" }
    for _, sp in ipairs(specials) do
      for off = 0, 17 do
        for tail = 0, 9 do
          local s = ("a"):rep(off) .. sp .. ("b"):rep(tail)
          assert.are.equal(reference(s), strings.json_quote(s), string.format("%q", s))
        end
      end
    end
    -- and random bytes, long enough for the word loop
    math.randomseed(13)
    for _ = 1, 300 do
      local t = {}
      for k = 1, math.random(0, 200) do
        t[k] = string.char(math.random() < 0.8 and math.random(0x20, 0x7e) or math.random(0, 255))
      end
      local s = table.concat(t)
      assert.are.equal(reference(s), strings.json_quote(s), string.format("%q", s))
    end
  end)

  it("round-trips through lua-cjson", function()
    local s = "line1\nline2\t\"quoted\" \\ é"
    assert.are.equal(s, json.decode(strings.json_quote(s)))
  end)

  it("decodes whole numbers as integers (within 2^53) and the rest as floats", function()
    local v = json.decode('{"size":6,"limit":1000,"neg":-3,"big":9007199254740993,"half":1.5,"exp":1e3,' ..
      '"list":[1,2.5,{"deep":7}],"huge":1e300}')
    assert.are.same({ "integer", "integer", "integer", "float", "float", "integer", "integer", "float",
      "integer", "float" }, { math.type(v.size), math.type(v.limit), math.type(v.neg), math.type(v.big),
      math.type(v.half), math.type(v.exp), math.type(v.list[1]), math.type(v.list[2]),
      math.type(v.list[3].deep), math.type(v.huge) })
    assert.are.equal("6", tostring(v.size))
    assert.are.equal(7, json.decode("7"))
    assert.are.equal("integer", math.type(json.decode("7")))
  end)

  it("agrees with utf8_valid", function()
    assert.is_true(strings.utf8_valid("plain é"))
    assert.is_false(strings.utf8_valid("bad \255"))
  end)
end)
