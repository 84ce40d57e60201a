#!/usr/bin/env python3
"""Rust functions longer than a number of lines, longest first.

    python3 tests/python/long_functions.py [--check] [limit] <file or dir>...

Counts each function from its `fn` line to its closing brace and prints those over `limit`
(60 by default) with their place. Test code (`tests*.rs`, `*_tests.rs`, a trailing
`#[cfg(test)] mod`) is left out. With `--check`, exits 1 when any is found (the test
command holds the gateway's request path to 100 lines)."""
import os, re, sys
args = sys.argv[1:]
check = '--check' in args
args = [a for a in args if a != '--check']
limit = 60
if args and args[0].isdigit():
    limit, args = int(args[0]), args[1:]
files = []
for a in args:
    if os.path.isdir(a):
        for root, _, fs in os.walk(a):
            files += [os.path.join(root, f) for f in fs if f.endswith('.rs')]
    else:
        files.append(a)
out = []
for f in files:
    base = os.path.basename(f)
    if base.startswith('tests') or base.endswith('_tests.rs') or '/tests/' in f:
        continue
    lines = open(f).read().split('\n')
    # cut test modules
    for i, l in enumerate(lines):
        if re.match(r'\s*#\[cfg\(test\)\]', l) and i + 1 < len(lines) and re.match(r'\s*(pub\s+)?mod\s+\w+\s*\{', lines[i+1]):
            lines = lines[:i]; break
    i = 0
    while i < len(lines):
        m = re.match(r'\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?fn\s+(\w+)', lines[i])
        if not m:
            i += 1; continue
        depth, started, j = 0, False, i
        while j < len(lines):
            code = re.sub(r'//.*', '', lines[j])
            code = re.sub(r'"(?:\\.|[^"\\])*"', '""', code)
            code = re.sub(r"'(?:\\.|[^'\\])'", "''", code)
            if not started and ';' in code and '{' not in code:
                break  # a declaration without a body
            for ch in code:
                if ch == '{': depth += 1; started = True
                elif ch == '}': depth -= 1
            if started and depth == 0:
                break
            j += 1
        if started:
            out.append((j - i + 1, f, m.group(1), i + 1))
        i += 1
for n, f, name, line in sorted(out, reverse=True):
    if n > limit:
        print(f'{n:4} {f}:{line} {name}')
if check and any(n > limit for n, *_ in out):
    sys.exit(1)
