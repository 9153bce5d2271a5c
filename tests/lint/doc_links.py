#!/usr/bin/env python3
"""doc_links.py — the manual stands alone: every link in the repository's Markdown resolves.

Run as `python3 tests/lint/doc_links.py [ROOT]` (ctest: lint_doc_links). It exits 1, listing
each problem as FILE:LINE: what, when

  - a relative link in any .md file (docs/, README.md, bench/, ...; build directories excepted)
    points at a file or directory that does not exist;
  - a link `page.md#anchor` (or `#anchor` within the page) names no heading of that page
    (GitHub's slugs: lowercase, punctuation removed, spaces to '-', `-1`, `-2` for repeats);
  - a link leaves the repository: a relative path climbing above the root, an absolute path,
    or a file: URL;
  - a source file names a page that does not exist (`docs/page.md`), or a section of it that
    is not there (`docs/page.md, "Heading"` or `docs/page.md ("Heading", "Other")`: a heading
    that is or begins with that name, else at least that text in the page);
  - any text file of the project mentions the design notes the repository does not contain
    (the patterns in FORBIDDEN below) or cites a document by section sign (a section sign is
    fine only after an RFC number, which names a public standard).

The files are what git tracks or would track (ignored files and build trees are not the
project's). Links with a scheme (https:, mailto:) are not fetched: the suite sends no traffic
beyond loopback. Code blocks and code spans are not Markdown links and are skipped. Only the
standard library is used, so the lint needs nothing but python3; ctest fails it loudly when
python3 is missing (see CMakeLists.txt), it never skips.
"""

import fnmatch
import os
import re
import subprocess
import sys
import urllib.parse

# Mentions of documents that live outside the repository. This file is the one place they
# may appear (it is excluded from the scan below).
FORBIDDEN = [
    "render-api.md",
    "render-api §",
    "DESIGN.md",
    "DESIGN §",
    "STYLE.md",
    "../shared",
    "shared/design",
]

SKIP_DIRS = {".git", "node_modules", "__pycache__"}
TEXT_LIMIT = 4 << 20  # bytes; larger files are data, not prose

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:name|id)\s*=\s*\"([^\"]+)\"", re.I)
REF_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(<[^>]*>|\S+)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
LINE_ANCHOR = re.compile(r"^L\d+(-L\d+)?$")
DOC_MENTION = re.compile(r"(?<![\w/.-])(docs/[\w./-]+\.md)")
QUOTED_HEADINGS = re.compile(r'^(?:,\s*|\s*\(\s*)((?:"[^"]+"(?:,\s*|\s+and\s+)?)+)')


def ignored_dirs(root):
    """The directory patterns anchored at the root in .gitignore (/build*/, /bench/out/, ...)."""
    pats = []
    try:
        with open(os.path.join(root, ".gitignore")) as fh:
            for line in fh:
                line = line.strip()
                if line.startswith("/") and line.endswith("/") and not line.startswith("/!"):
                    pats.append(line.strip("/"))
    except OSError:
        pass
    return pats


def project_files(root):
    """The project's files, relative to root: what git tracks or would track (ignored files
    and build trees left out). Without git, a walk that skips .gitignore's anchored
    directories and every CMake build tree."""
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True).stdout
        files = sorted(set(f for f in out.decode("utf-8", "replace").split("\0") if f))
        for rel in files:
            full = os.path.join(root, rel)
            if os.path.isfile(full) and not os.path.islink(full):
                yield rel
        return
    except (OSError, subprocess.CalledProcessError):
        pass
    skip = ignored_dirs(root)
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        keep = []
        for d in sorted(dirnames):
            rel = os.path.normpath(os.path.join(rel_dir, d))
            if d in SKIP_DIRS or any(fnmatch.fnmatch(rel, p) for p in skip) \
                    or (rel_dir == "." and d.startswith("build")) \
                    or os.path.exists(os.path.join(dirpath, d, "CMakeCache.txt")):
                continue
            keep.append(d)
        dirnames[:] = keep
        for f in sorted(filenames):
            full = os.path.join(dirpath, f)
            if os.path.isfile(full) and not os.path.islink(full):
                yield os.path.relpath(full, root)


def read_text(path):
    """The file's text, or None for binary or very large files."""
    try:
        if os.path.getsize(path) > TEXT_LIMIT:
            return None
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def strip_code_spans(line):
    """The line with `code spans` blanked (same length, so columns stay meaningful)."""
    out, i = [], 0
    while i < len(line):
        if line[i] == "`":
            j = i
            while j < len(line) and line[j] == "`":
                j += 1
            run = line[i:j]
            end = line.find(run, j)
            if end < 0:
                out.append(line[i:j])
                i = j
                continue
            out.append(" " * (end + len(run) - i))
            i = end + len(run)
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


def prose_lines(text):
    """(line number, line) for the lines outside fenced code blocks."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                    and line.strip() == m.group(1):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        yield n, line


def slug(text):
    """GitHub's anchor for a heading text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(text):
    """The set of anchors a Markdown page defines: headings (with repeat suffixes) and <a id>."""
    seen, anchors = {}, set()
    prev = None
    for _, line in prose_lines(text):
        heading = None
        m = ATX.match(line)
        if m:
            heading = re.sub(r"[ \t]+#+$", "", m.group(2) or "")
            if heading == "#" * len(heading):
                heading = ""
        elif prev is not None and prev.strip() and SETEXT.match(line) \
                and not prev.lstrip().startswith(("|", "-", "*", ">")) \
                and not ATX.match(prev):
            heading = prev.strip()
        if heading is not None:
            base = slug(heading)
            k = seen.get(base, 0)
            seen[base] = k + 1
            anchors.add(base if k == 0 else "%s-%d" % (base, k))
        for a in HTML_ANCHOR.findall(line):
            anchors.add(a)
        prev = line
    return anchors


def link_targets(line):
    """The targets of inline links and images on one line (code spans already blanked)."""
    i = 0
    while True:
        i = line.find("](", i)
        if i < 0:
            return
        j = i + 2
        if j < len(line) and line[j] == "<":
            end = line.find(">", j)
            if end < 0:
                i = j
                continue
            yield line[j + 1:end]
            i = end
            continue
        depth, k = 0, j
        while k < len(line):
            c = line[k]
            if c == "(":
                depth += 1
            elif c == ")":
                if depth == 0:
                    break
                depth -= 1
            elif c in " \t":
                break  # a title follows: `(target "title")`
            k += 1
        yield line[j:k]
        i = k


class Checker:
    def __init__(self, root):
        self.root = os.path.realpath(root)
        self.problems = []
        self.anchor_cache = {}

    def problem(self, where, what):
        self.problems.append("%s: %s" % (where, what))

    def anchors(self, rel):
        if rel not in self.anchor_cache:
            self.anchor_cache[rel] = anchors_of(read_text(os.path.join(self.root, rel)) or "")
        return self.anchor_cache[rel]

    def check_link(self, rel, n, target):
        where = "%s:%d" % (rel, n)
        target = target.strip()
        if not target:
            self.problem(where, "empty link target")
            return
        if target.lower().startswith("file:"):
            self.problem(where, "link %s leaves the repository (file: URL)" % target)
            return
        if SCHEME.match(target):
            return  # a public URL: named, not fetched
        path, _, anchor = target.partition("#")
        path = urllib.parse.unquote(path.split("?", 1)[0])
        anchor = urllib.parse.unquote(anchor)
        if path.startswith("/"):
            self.problem(where, "link %s is an absolute path (it leaves the repository)" % target)
            return
        if path:
            dest = os.path.normpath(os.path.join(os.path.dirname(rel), path))
            if dest == ".." or dest.startswith(".." + os.sep):
                self.problem(where, "link %s leaves the repository (it climbs above the root)"
                             % target)
                return
            full = os.path.join(self.root, dest)
            if not os.path.exists(full):
                self.problem(where, "dead link %s (%s does not exist)" % (target, dest))
                return
        else:
            dest = rel
        if anchor:
            full = os.path.join(self.root, dest)
            if dest.endswith(".md") and os.path.isfile(full):
                if anchor not in self.anchors(dest):
                    self.problem(where, "dead anchor %s (no heading of %s has the slug '%s')"
                                 % (target, dest, anchor))
            elif not LINE_ANCHOR.match(anchor):
                self.problem(where, "anchor %s on a non-Markdown target cannot be checked"
                             % target)

    def check_markdown(self, rel, text):
        for n, line in prose_lines(text):
            bare = strip_code_spans(line)
            m = REF_DEF.match(bare)
            if m:
                self.check_link(rel, n, m.group(2).strip("<>"))
                continue
            for target in link_targets(bare):
                self.check_link(rel, n, target)

    def check_mentions(self, rel, text):
        for n, line in enumerate(text.split("\n"), 1):
            hits = [pat for pat in FORBIDDEN if pat in line]
            for pat in hits:
                self.problem("%s:%d" % (rel, n),
                             "mentions '%s', a document outside the repository: "
                             "write what is needed as the project's own text" % pat)
            if hits:
                continue
            for m in re.finditer("\u00a7", line):
                before = line[max(0, m.start() - 24):m.start()]
                if not re.search(r"RFC\s*\d+[\s\d.,\u00a7]*$", before):
                    self.problem("%s:%d" % (rel, n),
                                 "a section sign cites a document by section number; "
                                 "link the project's own page (only RFC sections may be cited so)")
                    break

    def check_doc_mentions(self, rel, text):
        """Code and comments name pages as `docs/page.md, "Heading"`: both must exist."""
        for n, line in enumerate(text.split("\n"), 1):
            for m in DOC_MENTION.finditer(line):
                page = m.group(1).rstrip(".")
                where = "%s:%d" % (rel, n)
                if not os.path.isfile(os.path.join(self.root, page)):
                    self.problem(where, "names %s, which does not exist" % page)
                    continue
                q = QUOTED_HEADINGS.match(line[m.end():])
                if not q:
                    continue
                for name in re.findall(r'"([^"]+)"', q.group(1)):
                    if not self.has_section(page, name):
                        self.problem(where, "names the section \"%s\" of %s, which has no "
                                     "heading (nor text) of that name" % (name, page))

    def has_section(self, page, name):
        """A heading that is, or begins with, name ("Exec" for "Exec: sb:exec, ..."); failing
        that, the name in the page's text (a bullet's lead, a term)."""
        want = slug(name)
        for a in self.anchors(page):
            if a == want or a.startswith(want + "-"):
                return True
        text = read_text(os.path.join(self.root, page)) or ""
        return name.lower() in text.lower()

    def run(self):
        me = os.path.realpath(__file__)
        count = 0
        for rel in project_files(self.root):
            full = os.path.join(self.root, rel)
            if os.path.realpath(full) == me:
                continue
            text = read_text(full)
            if text is None:
                continue
            self.check_mentions(rel, text)
            if not rel.endswith(".md"):
                self.check_doc_mentions(rel, text)
            if rel.endswith(".md"):
                count += 1
                self.check_markdown(rel, text)
        if count == 0:
            self.problem(self.root, "no Markdown files found: wrong root?")
        return count


def main(argv):
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    if not os.path.isfile(os.path.join(root, "README.md")):
        print("doc_links: %s holds no README.md: not the repository's root" % root,
              file=sys.stderr)
        return 2
    checker = Checker(root)
    pages = checker.run()
    for p in checker.problems:
        print(p)
    if checker.problems:
        print("doc_links: %d problem(s) in %d Markdown file(s)" % (len(checker.problems), pages),
              file=sys.stderr)
        return 1
    print("doc_links: %d Markdown file(s), every link resolves" % pages)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
