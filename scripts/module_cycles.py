#!/usr/bin/env python3
"""Fails when the modules of a Rust crate import each other in a circle.

Reads every `.rs` file under a crate's `src/` (default: crates/dlbridge/src) as text, without
building it, and draws an arrow from one file to another wherever the first names an item of the
second: a `use` line, or a path in the code (`crate::a::b`, `super::x`, `self::x`, a child module's
`x::f`, a name brought in by a `use`). Not arrows: `mod` declarations, and a module's re-exports of
its own descendants (`pub use child::Thing`); a path through such a re-export arrives at the file
that defines the item. Comments and string literals are skipped; `cfg` attributes are not read
(every feature at once).

Two levels are checked: modules (each file, and each inline module such as a file's
`mod tests { ... }`, which is a child of its file like any other), and folders (the files of
each sibling folder taken as one, so the rooms of a layer depend on each other one way). Exit 1
and every circle printed (with the names that tie it) when there is one; 0 otherwise.

    python3 scripts/module_cycles.py [SRC_DIR] [--verbose]   # check a crate
    python3 scripts/module_cycles.py --self-test             # prove it finds a planted circle
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

DEFAULT_SRC = Path(__file__).resolve().parent.parent / "crates" / "dlbridge" / "src"

# --------------------------------------------------------------------------------------------
# Lexing: comments and literals out, then tokens.

_RAW_STR = re.compile(r'(?:b|c)?r(#*)"')


def strip(text: str) -> str:
    """The text with comments, strings and char literals blanked (newlines kept)."""
    out: list[str] = []
    i, n = 0, len(text)

    def blank(s: str) -> str:
        return "".join(c if c == "\n" else " " for c in s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif (m := _RAW_STR.match(text, i)) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = '"' + m.group(1)
            j = text.find(end, m.end())
            j = n if j < 0 else j + len(end)
            out.append(blank(text[i:j]))
            i = j
        elif c == '"' or (c in "bc" and text.startswith('"', i + 1) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_"))):
            j = i + (1 if c == '"' else 2)
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(blank(text[i : j + 1]))
            i = j + 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{1F600}', b'x') or a lifetime ('a, 'static).
            m = re.compile(r"'(?:\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'").match(text, i)
            if m:
                out.append(blank(m.group(0)))
                i = m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


_TOKEN = re.compile(r"\$?[A-Za-z_][A-Za-z0-9_]*|r#[A-Za-z_][A-Za-z0-9_]*|::|[{}();,*!<>#\[\]=]|\S")


def tokens(text: str) -> list[str]:
    """The tokens of stripped text (identifiers, `::`, single punctuation)."""
    return [t[2:] if t.startswith("r#") else t for t in _TOKEN.findall(text)]


# --------------------------------------------------------------------------------------------
# The crate: modules, their files, imports and paths.

Mod = tuple  # a module path: () is the crate root, ("python", "import") python/import.rs


class Crate:
    def __init__(self, src: Path):
        self.src = src
        self.files: dict[Mod, Path] = {}  # module -> file (inline modules: their file)
        self.inline: set[Mod] = set()
        self.macros: dict[str, Mod] = {}  # macro_rules! name -> module that defines it
        # module -> name -> (absolute path the name stands for, is the binding a re-export of a descendant)
        self.imports: dict[Mod, dict[str, tuple[Mod, bool]]] = defaultdict(dict)
        self.globs: dict[Mod, list[Mod]] = defaultdict(list)
        self.refs: list[tuple[Mod, Mod, str]] = []  # (from module, absolute path, how it was named)
        for path in sorted(src.rglob("*.rs")):
            rel = path.relative_to(src).with_suffix("").parts
            if rel == ("lib",) or rel == ("main",):
                mod: Mod = ()
            elif rel[-1] == "mod":
                mod = tuple(rel[:-1])
            else:
                mod = tuple(rel)
            self.files[mod] = path
        for mod, path in list(self.files.items()):
            self._read(mod, tokens(strip(path.read_text(encoding="utf-8"))))

    def file_of(self, mod: Mod) -> Mod:
        """The file module an (inline) module lives in."""
        while mod in self.inline:
            mod = mod[:-1]
        return mod

    def is_mod(self, mod: Mod) -> bool:
        return mod in self.files or mod in self.inline

    # ---- reading one file

    def _read(self, filemod: Mod, toks: list[str]) -> None:
        stack: list[tuple[Mod, int]] = [(filemod, -1)]  # (module, brace depth its body opened at)
        depth = 0
        i, n = 0, len(toks)
        while i < n:
            t = toks[i]
            cur = stack[-1][0]
            if t == "{":
                depth += 1
            elif t == "}":
                depth -= 1
                if len(stack) > 1 and depth == stack[-1][1]:
                    stack.pop()
            elif t == "mod" and i + 2 < n and re.match(r"[A-Za-z_]\w*$", toks[i + 1]) and toks[i + 2] == "{":
                child = cur + (toks[i + 1],)
                self.inline.add(child)
                self.files[child] = self.files[filemod]
                stack.append((child, depth))
                i += 2
                continue
            elif t == "mod":
                i += 2  # `mod name;` declares a child: not an arrow
                continue
            elif t == "macro_rules" and i + 2 < n and toks[i + 1] == "!":
                self.macros[toks[i + 2]] = filemod
            elif t == "use" and (i == 0 or toks[i - 1] not in ("::",)):
                j = i + 1
                while j < n and toks[j] != ";":
                    j += 1
                public = self._is_pub(toks, i)
                for path, name in self._use_tree(toks[i + 1 : j]):
                    absolute = self._absolute(cur, path)
                    if absolute is None:
                        continue
                    child_reexport = public and absolute[: len(cur)] == cur and len(absolute) > len(cur)
                    if name == "*":
                        self.globs[cur].append(absolute)
                    elif name not in ("self", "_"):
                        self.imports[cur][name] = (absolute, child_reexport)
                    if not child_reexport:
                        self.refs.append((cur, absolute, "use " + "::".join(path)))
                i = j
                continue
            elif re.match(r"\$?[A-Za-z_]\w*$", t) and (i == 0 or toks[i - 1] != "::"):
                j = i
                path = [t]
                while j + 2 < n and toks[j + 1] == "::" and re.match(r"\$?[A-Za-z_]\w*$", toks[j + 2]):
                    path.append(toks[j + 2])
                    j += 2
                macro = j + 1 < n and toks[j + 1] == "!"
                if i > 0 and toks[i - 1] == "in":
                    pass  # a visibility, `pub(in crate::x)`: not an arrow
                elif path[0] in ("crate", "$crate", "super", "self") and len(path) > 1:
                    absolute = self._absolute(cur, path)
                    if absolute is not None:
                        if macro:
                            absolute = ("!" + absolute[-1],)
                        self.refs.append((cur, absolute, "::".join(path)))
                elif len(path) > 1 or not macro:
                    # A child module's path (`fastcall::run`) or a name a `use` brought in; which
                    # one is known once every file is read: kept as a relative reference.
                    self.refs.append((cur, ("?",) + tuple(path), "::".join(path)))
                i = j + 1
                continue
            i += 1

    @staticmethod
    def _is_pub(toks: list[str], i: int) -> bool:
        j = i - 1
        if j >= 0 and toks[j] == ")":
            while j >= 0 and toks[j] != "(":
                j -= 1
            j -= 1
        return j >= 0 and toks[j] == "pub"

    def _use_tree(self, toks: list[str]) -> list[tuple[list[str], str]]:
        """Leaves of a use tree: (path, the name it binds; "*" for a glob)."""
        out: list[tuple[list[str], str]] = []

        def parse(pos: int, prefix: list[str]) -> int:
            path = list(prefix)
            while pos < len(toks):
                t = toks[pos]
                if t == "::":
                    pos += 1
                elif t == "{":
                    pos += 1
                    while pos < len(toks) and toks[pos] != "}":
                        pos = parse(pos, path)
                        if pos < len(toks) and toks[pos] == ",":
                            pos += 1
                    return pos + 1
                elif t == "*":
                    out.append((path, "*"))
                    return pos + 1
                elif t in (",", "}"):
                    break
                elif t == "as":
                    out.append((path, toks[pos + 1]))
                    return pos + 2
                else:
                    path.append(t)
                    pos += 1
            if path and path != prefix:
                out.append((path, path[-1] if path[-1] != "self" else path[-2] if len(path) > 1 else "self"))
            return pos

        parse(0, [])
        return out

    def _absolute(self, cur: Mod, path: list[str]) -> Mod | None:
        """An absolute module path for a path written in module `cur` (None: another crate)."""
        head = path[0]
        if head in ("crate", "$crate"):
            return tuple(p for p in path[1:] if p != "self")
        if head in ("super", "self"):
            base = list(cur)
            k = 0
            while k < len(path) and path[k] in ("super", "self"):
                if path[k] == "super":
                    base.pop()
                k += 1
            return tuple(base) + tuple(p for p in path[k:] if p != "self")
        if self.is_mod(cur + (head,)) or (cur + (head,)) in self.files:
            return cur + tuple(path)
        # Rust 2018: a bare path names a child module, a name a `use` of this module brought in
        # (known once every file is read: marked "@"), or another crate (std, pyo3, ...).
        child = cur + (head,)
        if any(m[: len(child)] == child for m in self.files):
            return cur + tuple(path)
        return cur + ("@" + head,) + tuple(path[1:])

    # ---- resolving

    def resolve(self, path: Mod, seen: frozenset = frozenset()) -> Mod | None:
        """The module (file) that defines what an absolute path names, through re-exports (None:
        another crate's)."""
        cur: Mod = ()
        if path[:1] and path[0].startswith("!"):  # an exported macro: where macro_rules! is
            return self.macros.get(path[0][1:], ())
        for k, seg in enumerate(path):
            if seg.startswith("@"):  # a name a `use` of `cur` brought in, or another crate
                binding = self.imports.get(cur, {}).get(seg[1:])
                key = (cur, seg)
                if binding is None or key in seen:
                    return None
                return self.resolve(binding[0] + tuple(path[k + 1 :]), seen | {key})
            nxt = cur + (seg,)
            if self.is_mod(nxt):
                cur = nxt
                continue
            binding = self.imports.get(cur, {}).get(seg)
            key = (cur, seg)
            if binding is not None and key not in seen:
                return self.resolve(binding[0] + tuple(path[k + 1 :]), seen | {key})
            for g in self.globs.get(cur, []):
                key = (cur, "*", g)
                if key in seen:
                    continue
                target = self.resolve(g + tuple(path[k:]), seen | {key})
                if target is not None and (target != self.resolve(g, seen | {key}) or self.defines(target, seg)):
                    return target
            return cur
        return cur

    def defines(self, mod: Mod, name: str) -> bool:
        return name in self.imports.get(mod, {})

    def edges(self) -> dict[Mod, dict[Mod, set[str]]]:
        """file -> file -> the names that tie them."""
        out: dict[Mod, dict[Mod, set[str]]] = defaultdict(lambda: defaultdict(set))
        for cur, path, how in self.refs:
            if path[:1] == ("?",):
                rel = path[1:]
                head = rel[0]
                if self.is_mod(cur + (head,)):
                    if len(rel) == 1:
                        continue  # a bare word named like a child module (a field, a binding)
                    absolute = cur + rel
                else:
                    scope = cur
                    binding = None
                    while True:  # a name bound by a `use` here (or, in an inline module, above it)
                        binding = self.imports.get(scope, {}).get(head)
                        if binding is not None or scope not in self.inline:
                            break
                        scope = scope[:-1]
                    if binding is None:
                        continue
                    absolute = binding[0] + rel[1:]
                    if not binding[1] and len(rel) == 1:
                        continue  # the `use` line itself already counted
                path = absolute
            resolved = self.resolve(path)
            if resolved is None:
                continue
            target, source = resolved, cur
            if target != source and target in self.files:
                out[source][target].add(how)
        return out


# --------------------------------------------------------------------------------------------
# Circles.


def circles(graph: dict) -> list[list]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict = {}
    low: dict = {}
    on: set = set()
    stack: list = []
    found: list[list] = []
    counter = 0
    nodes = set(graph) | {t for ts in graph.values() for t in ts}
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return sorted(found, key=lambda c: (-len(c), c))


def folder_graph(crate: Crate, edges: dict) -> dict:
    """Files collapsed into sibling folders: for each pair of files, the arrow between the two
    children of their deepest common ancestor folder that hold them (a folder's mod.rs counts as
    the folder itself, so a parent and its children are not compared)."""
    out: dict = defaultdict(lambda: defaultdict(set))
    for a, targets in edges.items():
        for b, how in targets.items():
            a, b = crate.file_of(a), crate.file_of(b)
            k = 0
            while k < len(a) and k < len(b) and a[k] == b[k]:
                k += 1
            if k == len(a) or k == len(b):
                continue  # one contains the other: a file graph's matter
            na, nb = a[: k + 1], b[: k + 1]
            if na == a and nb == b:
                continue  # two files side by side: the file graph has it
            out[na][nb] |= {f"{name(a)} -> {name(b)}: {h}" for h in how}
    return out


NAMES: dict = {}


def name(mod: Mod) -> str:
    return NAMES.get(mod) or ("/".join(mod) if mod else "lib.rs")


def check(src: Path, verbose: bool = False, out=sys.stdout) -> int:
    crate = Crate(src)
    for m in crate.inline:
        f = crate.file_of(m)
        NAMES[m] = name(f) + "::" + "::".join(m[len(f) :])
    edges = crate.edges()
    bad = 0
    for level, graph in (("module", edges), ("folder", folder_graph(crate, edges))):
        for comp in circles(graph):
            bad += 1
            print(f"circle of {len(comp)} {level}s: {', '.join(name(m) for m in comp)}", file=out)
            members = set(comp)
            for a in comp:
                for b in sorted(graph.get(a, {})):
                    if b in members:
                        print(f"  {name(a)} -> {name(b)}: {', '.join(sorted(graph[a][b]))}", file=out)
    if verbose:
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f"{name(a)} -> {name(b)}: {', '.join(sorted(edges[a][b]))}", file=out)
    if bad:
        print(f"{src}: {bad} circle(s) between modules; every arrow must run one way", file=out)
        return 1
    files = sum(1 for m in crate.files if m not in crate.inline)
    print(f"{src}: no circles between its {files} files (and their inline modules) or their folders", file=out)
    return 0


# --------------------------------------------------------------------------------------------
# Self-test: a tiny crate with and without a planted circle.


def self_test() -> int:
    import io

    def run(files: dict[str, str]) -> tuple[int, str]:
        with tempfile.TemporaryDirectory() as d:
            for rel, text in files.items():
                p = Path(d, rel)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text)
            buf = io.StringIO()
            return check(Path(d), out=buf), buf.getvalue()

    base = {
        "lib.rs": "mod a;\nmod b;\npub mod room;\npub use a::A;\n",
        "a.rs": "// uses crate::b::B in a comment only\npub struct A;\nconst S: &str = \"crate::b::B\";\n",
        "b.rs": "use crate::A;\npub struct B(A);\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        "room/mod.rs": "mod inner;\npub use inner::Inner;\npub fn door() -> Inner { inner::make() }\n",
        "room/inner.rs": "pub struct Inner;\npub fn make() -> Inner { Inner }\nfn f(_: crate::a::A) {}\n",
    }
    failures = []
    rc, text = run(base)
    if rc != 0:
        failures.append(f"an acyclic crate was refused:\n{text}")
    cyclic = dict(base, **{"a.rs": "pub struct A;\nfn f(_: crate::b::B) {}\n"})
    rc, text = run(cyclic)
    if rc != 1 or "circle of 2 modules: a, b" not in text:
        failures.append(f"a planted two-file circle (a -> b -> a) was not found:\n{text}")
    through_reexport = dict(base, **{"a.rs": "use crate::room::Inner;\npub struct A(Inner);\n"})
    rc, text = run(through_reexport)
    if rc != 1 or "a, room/inner" not in text:
        failures.append(f"a circle through a re-export (a -> room/inner -> a) was not found:\n{text}")
    child_calls_parent = dict(base, **{"room/inner.rs": "pub struct Inner;\npub fn make() -> Inner { super::door() }\n"})
    rc, text = run(child_calls_parent)
    if rc != 1 or "room, room/inner" not in text:
        failures.append(f"a child calling its parent that calls it was not found:\n{text}")
    tests_use_a_user = dict(
        base,
        **{"a.rs": "pub struct A;\n#[cfg(test)]\nmod tests {\n    use super::*;\n    fn f(_: crate::b::B) {}\n}\n"},
    )
    rc, text = run(tests_use_a_user)
    if rc != 0:
        failures.append(f"a test module using a module that uses its file was taken for a circle:\n{text}")
    inline_circle = dict(
        base, **{"a.rs": "pub struct A;\nmod inner {\n    pub fn f() { super::g() }\n}\nfn g() {}\nfn h() { inner::f() }\n"}
    )
    rc, text = run(inline_circle)
    if rc != 1 or "circle of 2 modules: a, a::inner" not in text:
        failures.append(f"a file and its inline module calling each other were not found:\n{text}")
    rooms = dict(
        base,
        **{
            "lib.rs": "mod x;\nmod y;\n",
            "x/mod.rs": "mod p;\nmod q;\n",
            "x/p.rs": "pub fn p() { crate::y::s::s() }\n",
            "x/q.rs": "pub fn q() {}\n",
            "y/mod.rs": "mod s;\nmod t;\n",
            "y/s.rs": "pub fn s() {}\n",
            "y/t.rs": "pub fn t() { crate::x::q::q() }\n",
        },
    )
    for k in ("a.rs", "b.rs", "room/mod.rs", "room/inner.rs"):
        rooms.pop(k)
    rc, text = run(rooms)
    if rc != 1 or "circle of 2 folders: x, y" not in text:
        failures.append(f"two folders importing each other (no file circle) were not found:\n{text}")
    for f in failures:
        print("self-test FAILED:", f)
    if not failures:
        print("self-test: acyclic crates pass; planted file, re-export, parent, inline-module and folder circles found")
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    if "--self-test" in argv:
        return self_test()
    src = Path(args[0]) if args else DEFAULT_SRC
    if not src.is_dir():
        print(f"{src}: not a folder", file=sys.stderr)
        return 2
    return check(src, verbose="--verbose" in argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
