#!/usr/bin/env bash
# code-shape.sh: the shape of the code: the largest source files and the longest functions.
#   scripts/code-shape.sh            print the 15 largest files and the 25 longest functions
#   scripts/code-shape.sh --check    also fail where a source file is over 1,000 lines, a
#                                    formation step (comm/form/) or a function of an executor
#                                    over 100, or a crate's top-level modules import each
#                                    other in a circle
# Sources: the crates' src/, the root src/ and examples/ (tests and benches are not counted).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 - "${1:-}" <<'EOF'
import os, re, sys

check = sys.argv[1] == "--check"
roots = ["src", "examples"] + [os.path.join("crates", c, d) for c in sorted(os.listdir("crates"))
                                for d in ("src", "examples")]
files = []
for root in roots:
    for dirpath, _, names in os.walk(root):
        files += [os.path.join(dirpath, n) for n in names if n.endswith(".rs")]

sizes, funcs = [], []
fn_start = re.compile(r"^(\s*)(?:pub(?:\([a-z:]+\))? )?(?:const )?(?:async )?(?:unsafe )?fn (\w+)")
for f in files:
    lines = open(f, encoding="utf-8").read().split("\n")
    sizes.append((len(lines) - 1, f))
    for i, line in enumerate(lines):
        m = fn_start.match(line)
        if not m or line.rstrip().endswith(";"):
            continue
        indent = m.group(1)
        for j in range(i + 1, len(lines)):
            if lines[j] == indent + "}":
                funcs.append((j - i + 1, f"{f}:{i + 1}", m.group(2)))
                break

print("largest files (lines):")
for n, f in sorted(sizes, reverse=True)[:15]:
    print(f"  {n:6}  {f}")
print("longest functions (lines):")
for n, where, name in sorted(funcs, reverse=True)[:25]:
    print(f"  {n:6}  {name}  {where}")
# Formation's steps (issue 36: none over ~100 lines): the communicator's formation files.
formation = re.compile(r"crates/nodetour-ring/src/comm/(form/|host_job\.rs)")
steps = sorted((f for f in funcs if formation.search(f[1])), reverse=True)
print("longest formation steps (lines; --check fails over 100):")
for n, where, name in steps[:8]:
    print(f"  {n:6}  {name}  {where}")
long_steps = [f for f in steps if f[0] > 100]
# The executors (issue 51: none of their functions over 100 lines): the host ring, the GPU
# rings, the CPU executor of the stream program, the collective value, the communicator.
executor = re.compile(
    r"crates/nodetour-ring/src/(host/|gpu_ring/|gpu\.rs|cpu_streams\.rs|call\.rs|comm/)")
exec_fns = sorted((f for f in funcs if executor.search(f[1]) and "tests.rs" not in f[1]),
                  reverse=True)
print("longest functions of the executors (lines; --check fails over 100):")
for n, where, name in exec_fns[:5]:
    print(f"  {n:6}  {name}  {where}")
long_exec = [f for f in exec_fns if f[0] > 100]
# Import circles between folders: a crate's top-level modules (a folder, or a file directly
# under src/) and the `crate::X` paths each one names outside comments.
print("import circles between a crate's top-level modules (folders or files):")
circles = 0
for crate in sorted(os.listdir("crates")):
    src = os.path.join("crates", crate, "src")
    edges = {}
    for f in files:
        if not f.startswith(src + os.sep):
            continue
        unit = os.path.relpath(f, src).split(os.sep)[0].removesuffix(".rs")
        for line in open(f, encoding="utf-8"):
            if line.lstrip().startswith("//"):
                continue
            for m in re.finditer(r"crate::(\w+)", line):
                if m.group(1) != unit:
                    edges.setdefault(unit, set()).add(m.group(1))
    # Strongly connected components (Tarjan), those of two or more modules.
    index, low, stack, on, out = {}, {}, [], set(), []
    def visit(v):
        index[v] = low[v] = len(index)
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
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    for comp in out:
        circles += 1
        print(f"  {crate}: " + " <-> ".join(comp))
if not circles:
    print("  none")
over = [(n, f) for n, f in sizes if n > 1000]
if check and over:
    print("over 1,000 lines: " + ", ".join(f"{f} ({n})" for n, f in over))
    sys.exit(1)
if check and circles:
    print(f"{circles} import circle(s) between top-level modules")
    sys.exit(1)
if check and long_steps:
    print("formation steps over 100 lines: " + ", ".join(f"{w} {m} ({n})" for n, w, m in long_steps))
    sys.exit(1)
if check and long_exec:
    print("executor functions over 100 lines: " + ", ".join(f"{w} {m} ({n})" for n, w, m in long_exec))
    sys.exit(1)
EOF
