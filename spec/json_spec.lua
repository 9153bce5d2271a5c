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
