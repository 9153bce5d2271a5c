#!/usr/bin/env python3
"""layers.py — each folder imports only what its layer may (docs/architecture.md, "Folders").

Run as `python3 tests/lint/layers.py [ROOT]` (ctest: lint_layers). It exits 1, listing each
violation as FILE:LINE: what, when

  - a C file of runtime/ or tools/sandbox/ includes a Lua header (lua.h, lualib.h, lauxlib.h,
    luaconf.h, lua.hpp) or bindings/mb.h: runtime/ is C without Lua, and the sandbox helper
    links no Lua at all;
  - a module under lua/moonbox/render/ requires moonbox.local.* or moonbox.schedule*: the Render
    client is used by both, and must not depend on the backend it talks to or on the scheduler;
  - a module under lua/moonbox/local/http/ (the wire) requires moonbox.local.engine* or
    moonbox.local.state: handlers decode a request, call the service, and encode its answer;
    records and the engine belong to the service;
  - lua/moonbox/local/service.lua requires moonbox.local.http* or moonbox.local.wire: the
    service knows nothing of HTTP;
  - a module under lua/moonbox/local/engine/ requires a moonbox.local.* module outside the
    engine: the engine is below the service and knows no records, service or wire.

  - a module under lua/moonbox/render/ reads or sleeps on core's clock (core.now, core.sleep,
    core.timer): the client has one clock, task's (task.now, task.sleep, task.timeout), which a
    dry run drives. No file is exempt: the simulated clock is built on real time by
    moonbox.dryrun (lua/moonbox/dryrun.lua), outside render/, which is also where the dry run is
    assembled from moonbox local's service, routes and simulated engine (render/ may not require
    moonbox.local.*; render/dryrun.lua keeps only render.dry_run's hooks).

  - the modules under lua/ require one another in a cycle (a require inside a function counts
    as much as one at the top): each such cycle is listed once, by its modules.

  - a module under lua/ uses require inside a function body or another block (if, for, while,
    repeat, do) without a `-- lazy:` comment saying why, on that line or on the comment lines
    right above it: requires go at the top of the module, where what it depends on and the
    order things load in can be seen. The exceptions are a C library loaded only when needed
    (libcurl, libmicrohttpd, SQLite, libpq, libedit, libarchive: each a separate .so,
    CMakeLists.txt moonbox_lazy_module), a module that loads one, and a dynamic require(name).

A Lua require is any `require "name"`, `require 'name'` or `require("name")` (also inside
pcall(require, "name")) outside a comment; for the top-level rule, any use of the name require
(the file is read token by token: strings, comments and long brackets are skipped).
tests/lint/test_layers.py (ctest: lint_layers_refuses) checks that the lint refuses what it should. Only the standard library is used, so the lint
needs nothing but python3; ctest fails it loudly when python3 is missing (CMakeLists.txt).
"""

import os
import re
import sys

LUA_HEADERS = {"lua.h", "lualib.h", "lauxlib.h", "luaconf.h", "lua.hpp", "mb.h"}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')
REQUIRE = re.compile(r'''require\s*\(?\s*["']([\w.]+)["']''')
PCALL_REQUIRE = re.compile(r'''pcall\s*\(\s*require\s*,\s*["']([\w.]+)["']''')

# (folder, file suffixes, kind, predicate on the imported name, why)
RULES = [
    ("runtime", (".c", ".h"), "include",
     lambda name: os.path.basename(name) in LUA_HEADERS,
     "runtime/ is C without Lua: its callbacks report to the binding that owns the operation"),
    ("tools/sandbox", (".c", ".h"), "include",
     lambda name: os.path.basename(name) in LUA_HEADERS,
     "the sandbox helper is a separate program with no Lua"),
    ("lua/moonbox/render", (".lua",), "require",
     lambda name: name.startswith("moonbox.local.") or name == "moonbox.local"
     or name.startswith("moonbox.schedule"),
     "the Render client may not depend on the local backend or on the scheduler"),
    ("lua/moonbox/local/http", (".lua",), "require",
     lambda name: name == "moonbox.local.engine" or name.startswith("moonbox.local.engine.")
     or name == "moonbox.local.state",
     "the wire calls the service, never the engine or the records directly"),
    ("lua/moonbox/local/service.lua", (".lua",), "require",
     lambda name: name.startswith("moonbox.local.http") or name == "moonbox.local.wire",
     "the service knows nothing of HTTP: the wire encodes its answers and errors"),
    ("lua/moonbox/local/engine", (".lua",), "require",
     lambda name: name.startswith("moonbox.local.") and not name.startswith("moonbox.local.engine"),
     "the engine is below the service: it knows no records, no service and no wire"),
]


def strip_lua_comment(line):
    """The line without a trailing -- comment (strings holding -- are rare enough here)."""
    out, quote, i = [], None, 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\":
                out.append(line[i:i + 2])
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif line.startswith("--", i):
            break
        out.append(c)
        i += 1
    return "".join(out)


def imports(path, kind):
    """(line number, imported name) for each include or require in the file."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if kind == "require":
        # Long comments --[[ ... ]] and --[==[ ... ]==] count as comments too.
        text = re.sub(r"--\[(=*)\[.*?\]\1\]", lambda m: "\n" * m.group(0).count("\n"), text,
                      flags=re.S)
    for n, line in enumerate(text.split("\n"), 1):
        if kind == "include":
            m = INCLUDE.match(line)
            if m:
                yield n, m.group(1)
        else:
            code = strip_lua_comment(line)
            for rx in (REQUIRE, PCALL_REQUIRE):
                for m in rx.finditer(code):
                    yield n, m.group(1)


CORE_CLOCK = re.compile(r"\bcore\s*\.\s*(now|sleep|timer)\b")
CLOCK_FOLDER, CLOCK_EXEMPT = "lua/moonbox/render", set()


def clock_problems(root):
    """FILE:LINE lines for each use of core's clock in the Render client (see above)."""
    out = []
    base = os.path.join(root, CLOCK_FOLDER)
    for dirpath, _, files in os.walk(base):
        for name in sorted(files):
            if not name.endswith(".lua") or name in CLOCK_EXEMPT:
                continue
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            text = re.sub(r"--\[(=*)\[.*?\]\1\]", lambda m: "\n" * m.group(0).count("\n"), text,
                          flags=re.S)
            for n, line in enumerate(text.split("\n"), 1):
                m = CORE_CLOCK.search(strip_lua_comment(line))
                if m:
                    out.append(f"{os.path.relpath(path, root)}:{n}: core.{m.group(1)}: the Render client has "
                               "one clock, task's (task.now, task.sleep, task.timeout), which a dry run drives")
    return out


# A Lua token: a long bracket (comment or string), a comment, a quoted string, a name,
# `..`, `...` or `::` (after which a keyword is a keyword), or any other character (numbers, operators,
# punctuation: nothing the block structure depends on).
LUA_TOKEN = re.compile(r"""--\[(=*)\[.*?\]\1\]|\[(=*)\[.*?\]\2\]|--[^\n]*|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'"""
                       r"""|[A-Za-z_]\w*|\.\.\.?|::|\n|\S""", re.S)
BLOCK_OPEN = {"function", "if", "while", "for", "repeat", "do"}
LAZY = "-- lazy:"

def nested_requires(path):
    """Line numbers of each use of `require` inside a block (a function body, if, for, while,
    repeat or do) of the Lua file at path, but those marked lazy: a comment starting `-- lazy:`
    on the require's line, or on one of the comment lines right above it. Any use of the name
    counts: require "x", require("x").f, require(name), pcall(require, "x"); a field named
    require (t.require, t:require) does not. Raises ValueError when the blocks do not balance
    (the file is not Lua this reading can follow)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    lazy_lines, comment_lines, code_lines, found = set(), set(), set(), []
    depth, pending_do, line, prev = 0, 0, 1, None
    for m in LUA_TOKEN.finditer(text):
        tok = m.group(0)
        if tok == "\n":
            line += 1
            continue
        if tok.startswith("--"):
            comment_lines.add(line)
            if tok.startswith(LAZY):
                lazy_lines.add(line)
            line += tok.count("\n")
            continue
        code_lines.add(line)
        if tok[0] in "\"'" or (tok[0] == "[" and len(tok) > 1):
            line += tok.count("\n")
            prev = "string"
            continue
        if prev not in (".", ":"):
            if tok in ("while", "for"):
                depth, pending_do = depth + 1, pending_do + 1
            elif tok == "do" and pending_do:
                pending_do -= 1
            elif tok in BLOCK_OPEN:
                depth += 1
            elif tok in ("end", "until"):
                depth -= 1
                if depth < 0:
                    raise ValueError(f"line {line}: `{tok}` closes no block (the lint misread the file)")
            elif tok == "require" and depth > 0:
                found.append(line)
        prev = tok
    if depth != 0:
        raise ValueError(f"{depth} block(s) still open at the end (the lint misread the file)")

    def lazy(n):
        if n in lazy_lines:
            return True
        n -= 1
        while n in comment_lines and n not in code_lines:
            if n in lazy_lines:
                return True
            n -= 1
        return False
    return sorted({n for n in found if not lazy(n)})


def top_problems(root):
    """FILE:LINE lines for each require of a module under lua/ that is not at its top level and
    not marked `-- lazy:`."""
    out = []
    base = os.path.join(root, "lua")
    for dirpath, _, files in os.walk(base):
        for name in sorted(files):
            if not name.endswith(".lua"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            try:
                lines = nested_requires(path)
            except ValueError as e:
                out.append(f"{rel}: cannot follow its blocks: {e}")
                continue
            for n in lines:
                out.append(f"{rel}:{n}: require inside a function or block: move it to the top of the "
                           "module (local x = require \"moonbox.x\"), or, for a C library loaded only "
                           "when needed or a dynamic require(name), say why on that line or the line "
                           "above with a `-- lazy: reason` comment")
    return out


def module_files(root):
    """{module name: path} of every Lua module under lua/ (a/b/init.lua is a.b)."""
    out = {}
    base = os.path.join(root, "lua")
    for dirpath, _, files in os.walk(base):
        for name in files:
            if name.endswith(".lua"):
                path = os.path.join(dirpath, name)
                mod = os.path.relpath(path, base)[:-4].replace(os.sep, ".")
                if mod.endswith(".init"):
                    mod = mod[:-5]
                out[mod] = path
    return out


def cycle_problems(root):
    """One line per require cycle among the modules under lua/ (Tarjan's strongly connected
    components, iteratively; a component of two or more modules is a cycle)."""
    mods = module_files(root)
    graph = {m: sorted({name for _, name in imports(p, "require") if name in mods and name != m})
             for m, p in mods.items()}
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter[0]
                counter[0] += 1
                stack.append(v)
                on.add(v)
            if i < len(graph[v]):
                work.append((v, i + 1))
                w = graph[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return [f"require cycle among {len(c)} modules: {', '.join(c)} (break it: pass the function in, "
            "or let the lower module register itself)" for c in comps]


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
    problems, checked = clock_problems(root) + cycle_problems(root) + top_problems(root), 0
    for folder, suffixes, kind, bad, why in RULES:
        base = os.path.join(root, folder)
        if os.path.isfile(base):
            walk = [(os.path.dirname(base), None, [os.path.basename(base)])]
        elif os.path.isdir(base):
            walk = os.walk(base)
        else:
            problems.append(f"{folder}: missing (the rule for it cannot be checked)")
            continue
        for dirpath, _, files in walk:
            for name in sorted(files):
                if not name.endswith(suffixes):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                checked += 1
                seen = set()
                for n, imported in imports(path, kind):
                    if bad(imported) and (n, imported) not in seen:
                        seen.add((n, imported))
                        problems.append(f"{rel}:{n}: {kind}s {imported}: {why}")
    if checked == 0:
        problems.append("no file checked: wrong ROOT?")
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"layers: {len(problems)} violation(s) of the import rules in docs/architecture.md",
              file=sys.stderr)
        return 1
    print(f"layers: {checked} files follow the import rules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
