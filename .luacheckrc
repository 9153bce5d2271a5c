-- luacheck configuration: Lua 5.4, moonbox's library, specs (busted), recipes and benchmarks.
std = "lua54"
max_line_length = 110
codes = true
files["spec/**/*_spec.lua"] = { std = "+busted", max_line_length = 140 }
files["spec/support/*.lua"] = { max_line_length = 140 }
files["bench/*.lua"] = { max_line_length = 140 }
files["spec/**/*.lua"] = { std = "+busted" }
-- recipes the specs run (spec/recipes/) are recipes, not specs: no busted globals
files["spec/recipes/*.lua"] = { std = "lua54" }
exclude_files = { "build*/**" }
-- `local _guard <close> = ...` is used by being closed; the leading underscore says so.
ignore = { "211/_.*" }
