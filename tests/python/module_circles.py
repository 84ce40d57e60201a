#!/usr/bin/env python3
"""Import circles between the modules of one crate, from its `use` lines and inline paths.

    python3 tests/python/module_circles.py <crate src dir> [--check] [prefix...] [--only prefix...]

Prints each strongly connected component (an import circle) of the module graph with its
edges, and how many there are. With prefixes, only circles touching a module under one of
them; with `--only`, the graph is first cut down to the modules under those prefixes (e.g.
`--only http dispatch` for the gateway's request path). A module uses another when it names a
path into it (`use crate::a::b`, `use super::x`, `crate::a::f()`, `child::f()`); a path to an
item another module re-exports (`pub use`) leads to where the item is defined. Test code
(`tests*.rs`, `*_tests.rs`, a trailing `#[cfg(test)] mod`) is left out. With `--check`, exits
1 when it prints a circle (the test command holds the gateway's request path to none).
"""
import os, re, sys
from collections import defaultdict

src = sys.argv[1]
args = sys.argv[2:]
check = '--check' in args
args = [a for a in args if a != '--check']
only = []
if '--only' in args:
    i = args.index('--only')
    only, args = args[i+1:], args[:i]
prefixes = args
mods = {}  # module path tuple -> file
for root, _, files in os.walk(src):
    for f in files:
        if not f.endswith('.rs'):
            continue
        rel = os.path.relpath(os.path.join(root, f), src)
        parts = rel[:-3].split(os.sep)
        if parts[-1] in ('mod', 'lib', 'main'):
            parts = parts[:-1]
        if parts and (parts[-1] == 'tests' or parts[-1].endswith('_tests')):
            continue
        if 'tests' in parts:
            continue
        mods[tuple(parts)] = os.path.join(root, f)

def strip(text):
    text = re.sub(r'//[^\n]*', '', text)
    # drop #[cfg(test)] mod tests { ... } blocks (to end of file: they sit last by convention)
    m = re.search(r'#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod \w+\s*\{', text)
    if m:
        text = text[:m.start()]
    return text

def expand(tree):
    """Expand a use tree `a::{b, c::d}` into paths."""
    tree = tree.strip()
    out = []
    depth = 0
    i = tree.find('{')
    if i < 0:
        return [tree.split(' as ')[0].strip()]
    head = tree[:i]
    body = tree[i+1:tree.rfind('}')]
    items, cur = [], ''
    for ch in body:
        if ch == '{': depth += 1
        if ch == '}': depth -= 1
        if ch == ',' and depth == 0:
            items.append(cur); cur = ''
        else:
            cur += ch
    items.append(cur)
    for it in items:
        if it.strip():
            out += [head + p for p in expand(it)]
    return out

reexports = {}  # module -> {name: (module it is written in, path)}

def resolve(cur, path, depth=0):
    segs = [s for s in path.split('::') if s]
    if not segs:
        return None
    if segs[0] == 'crate':
        base, segs = [], segs[1:]
    elif segs[0] in ('super', 'self'):
        base = list(cur)
        while segs and segs[0] in ('super', 'self'):
            if segs[0] == 'super':
                base = base[:-1]
            segs = segs[1:]
    else:
        # a child module of the current one named directly (e.g. `events::Writer` after `mod events`)
        base = list(cur)
        if tuple(base + [segs[0]]) not in mods:
            return None
    full = base + segs
    for n in range(len(full), -1, -1):
        if tuple(full[:n]) in mods:
            m = tuple(full[:n])
            # an item the module re-exports resolves to where it is defined
            if n < len(full) and depth < 8 and full[n] in reexports.get(m, {}):
                at, target = reexports[m][full[n]]
                r = resolve(at, target, depth + 1)
                if r is not None:
                    return r
            return m
    return None

for m, f in mods.items():
    text = strip(open(f).read())
    table = {}
    for u in re.finditer(r'\bpub(?:\([^)]*\))?\s+use\s+([^;]+);', text):
        for p in expand(u.group(1)):
            p = p.replace(' ', '')
            name = p.split('::')[-1]
            if name not in ('*', 'self'):
                table[name] = (m, p)
    reexports[m] = table

edges = defaultdict(set)
for m, f in mods.items():
    text = strip(open(f).read())
    paths = []
    for u in re.finditer(r'\buse\s+([^;]+);', text):
        paths += expand(u.group(1))
    for p in re.finditer(r'\b((?:crate|super|self)(?:::\w+)+)', text):
        paths.append(p.group(1))
    for p in re.finditer(r'(?<![:\w])([a-z_]\w*)::[A-Za-z_]', text):
        if p.group(1) not in ('crate', 'super', 'self'):
            paths.append(p.group(1) + '::x')
    for p in paths:
        t = resolve(m, p.replace(' ', ''))
        if t is not None and t != m:
            edges[m].add(t)

if only:
    keep = lambda m: any('::'.join(m) == p or '::'.join(m).startswith(p + '::') for p in only)
    edges = defaultdict(set, {m: {t for t in ts if keep(t)} for m, ts in edges.items() if keep(m)})
    mods = {m: f for m, f in mods.items() if keep(m)}
# Tarjan SCC
index, low, stack, on, sccs = {}, {}, [], set(), []
counter = [0]
sys.setrecursionlimit(10000)
def visit(v):
    index[v] = low[v] = counter[0]; counter[0] += 1
    stack.append(v); on.add(v)
    for w in edges.get(v, ()):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1:
            sccs.append(comp)
for v in list(mods):
    if v not in index:
        visit(v)
name = lambda m: '::'.join(m) or 'crate'
shown = 0
for comp in sccs:
    names = sorted(name(m) for m in comp)
    if prefixes and not any(n.startswith(p) for n in names for p in prefixes):
        continue
    shown += 1
    print(f'circle of {len(comp)}: ' + ', '.join(names))
    cs = set(comp)
    for m in sorted(comp):
        for t in sorted(edges[m] & cs):
            print(f'    {name(m)} -> {name(t)}')
print(f'{shown} circle(s)')
if check and shown:
    sys.exit(1)
