#!/usr/bin/env python3
"""test_layers.py — the lint of tests/lint/layers.py refuses what it should, on trees made for it.

Run as `python3 tests/lint/test_layers.py [ROOT]` (ctest: lint_layers_refuses). Each case writes
Lua into a temporary directory and runs the lint's reading of it (layers.nested_requires), or the
whole lint as a program on a copy of ROOT's checked folders with one module added, and expects
the refusal (exit status 1, the FILE:LINE line) or the pass. Only the standard library is used.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # no __pycache__ of layers.py left in the source tree
sys.path.insert(0, HERE)
import layers  # noqa: E402  (the lint under test, next to this file)

ROOT = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(HERE, "..", ".."))


class NestedRequires(unittest.TestCase):
    """layers.nested_requires: which requires are inside a block and not marked lazy."""

    def lines(self, source):
        with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
            f.write(source)
        try:
            return layers.nested_requires(f.name)
        finally:
            os.remove(f.name)

    def test_a_require_in_a_function_is_refused(self):
        self.assertEqual(self.lines('local M = {}\nfunction M.f()\n  return require("moonbox.x").g()\nend\n'
                                    'return M\n'), [3])

    def test_every_form_counts(self):
        src = ("local function f(name)\n"
               "  local a = require \"moonbox.a\"\n"
               "  local b = require('moonbox.b').c\n"
               "  local ok, d = pcall(require, \"moonbox.d\")\n"
               "  return require(name)\n"
               "end\n")
        self.assertEqual(self.lines(src), [2, 3, 4, 5])

    def test_blocks_other_than_functions_count(self):
        src = ("if os.getenv(\"X\") then\n  require \"moonbox.a\"\nend\n"
               "for i = 1, 2 do require \"moonbox.b\" end\n"
               "while false do require \"moonbox.c\" end\n"
               "repeat require \"moonbox.d\" until true\n"
               "do require \"moonbox.e\" end\n")
        self.assertEqual(self.lines(src), [2, 4, 5, 6, 7])

    def test_top_level_requires_pass(self):
        src = ('local a = require "moonbox.a"\n'
               'local M = { parse = require("moonbox.b").parse,\n'
               '  quote = require("moonbox.c").quote }\n'
               'M.x = require("moonbox.d").x\n'
               'local function f() return a end\n'
               'M.f = f\n'
               'return M\n')
        self.assertEqual(self.lines(src), [])

    def test_lazy_on_the_line_or_the_comment_lines_above_passes(self):
        src = ("local function f()\n"
               "  local a = require \"moonbox.a\" -- lazy: a C library only f needs\n"
               "  -- lazy: another one,\n"
               "  -- explained on two lines\n"
               "  local b = require \"moonbox.b\"\n"
               "  -- lazy: a comment above code does not reach past it\n"
               "  local c = 1\n"
               "  local d = require \"moonbox.d\"\n"
               "  -- a comment that is not lazy:\n"
               "  local e = require \"moonbox.e\"\n"
               "  return a, b, c, d, e\n"
               "end\n")
        self.assertEqual(self.lines(src), [8, 10])

    def test_words_that_are_not_requires_or_blocks(self):
        # Strings, comments, long strings, fields named like keywords or like require, `...`
        # before end and a goto label before end: none opens or closes a block or is a require.
        src = ('local t = { ["end"] = 1, ["function"] = "require \\"x\\"" }\n'
               'local s = [[\nfunction require end\n]] -- function require\n'
               '--[==[ do require "x" ]==]\n'
               'local function v(...) if ... then return ... end end\n'
               'local function g(r) for _, x in ipairs(r) do if x then goto next end ::next:: end end\n'
               'local function h(o) return o.require, o:require() end\n'
               'return t, s, v, g, h\n')
        self.assertEqual(self.lines(src), [])

    def test_blocks_that_do_not_balance_are_reported(self):
        with self.assertRaises(ValueError):
            self.lines("local function f()\n  if x then\nend\n")
        with self.assertRaises(ValueError):
            self.lines("local x = 1\nend\n")


class WholeLint(unittest.TestCase):
    """layers.py as ctest runs it, on a copy of ROOT's checked folders with one module added."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="layers-test-")
        for folder in ("lua", "runtime", os.path.join("tools", "sandbox")):
            shutil.copytree(os.path.join(ROOT, folder), os.path.join(self.tmp, folder))

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def lint(self, rel, source):
        with open(os.path.join(self.tmp, rel), "w", encoding="utf-8") as f:
            f.write(source)
        r = subprocess.run([sys.executable, os.path.join(HERE, "layers.py"), self.tmp],
                           capture_output=True, text=True)
        return r.returncode, r.stderr

    def test_the_tree_as_it_is_passes(self):
        code, err = self.lint(os.path.join("lua", "moonbox", "ok_for_test.lua"),
                              'local json = require "moonbox.json"\nreturn json\n')
        self.assertEqual((code, err), (0, ""))

    def test_a_require_in_a_function_is_refused_by_file_and_line(self):
        code, err = self.lint(os.path.join("lua", "moonbox", "bad_for_test.lua"),
                              "local M = {}\n\n--- f() -> the encoder.\nfunction M.f()\n"
                              "  local json = require \"moonbox.json\"\n  return json\nend\nreturn M\n")
        self.assertEqual(code, 1)
        self.assertIn("lua/moonbox/bad_for_test.lua:5: require inside a function or block: move it "
                      "to the top of the module", err)
        self.assertIn("-- lazy: reason", err)

    def test_a_lazy_comment_lets_it_pass(self):
        code, err = self.lint(os.path.join("lua", "moonbox", "lazy_for_test.lua"),
                              "local M = {}\nfunction M.f()\n  -- lazy: libcurl, for this test\n"
                              "  return require \"moonbox.http\"\nend\nreturn M\n")
        self.assertEqual((code, err), (0, ""))


if __name__ == "__main__":
    unittest.main(verbosity=2)
