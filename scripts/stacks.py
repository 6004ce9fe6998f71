#!/usr/bin/env python3
"""stacks.py [--after S] [--samples N] [--every S] -- CMD...: runs CMD (a test binary, say) and,
if it is still running after S seconds, stops each of its threads in turn (ptrace), prints where
it is (the instruction pointer) and the code addresses on its stack, N times, then kills it.

A hung GPU test's own watchdog sees only threads blocked in a system call; this also catches a
thread spinning in user space (in the driver or in nodetour). Lines read like the watchdog's
(`WATCHDOG: tid ... exe+OFFSET ... libcuda(NAMES)`), so `scripts/symbolize-watchdog.sh` turns
the `exe+` words into functions and lines of the unstripped binary. Needs no debugger: CMD is
this script's child, which ptrace may stop under Yama's default scope. x86_64 Linux only.
"""
import ctypes
import os
import signal
import struct
import subprocess
import sys
import time

PTRACE_GETREGS, PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 12, 17, 0x4206, 0x4207
WALL = 0x40000000
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def elf_exports(path):
    """(address, name) of the functions an ELF64 shared object exports, sorted."""
    try:
        data = open(path, "rb").read()
    except OSError:
        return []
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for s in sections:
        if s[1] != 11:  # SHT_DYNSYM
            continue
        strtab = sections[s[6]]
        for off in range(s[4], s[4] + s[5], 24):
            name, info, _, shndx, value, _ = struct.unpack_from("<IBBHQQ", data, off)
            if value and shndx and info & 0xF == 2:  # STT_FUNC
                end = data.index(b"\0", strtab[4] + name)
                out.append((value, data[strtab[4] + name:end].decode(errors="replace")))
    return sorted(out)


def maps_of(pid):
    """(start, end, file offset, path) of the executable mappings, and every mapping."""
    code, every = [], []
    for line in open(f"/proc/{pid}/maps"):
        f = line.split()
        a, b = (int(x, 16) for x in f[0].split("-"))
        path = f[5] if len(f) > 5 else ""
        every.append((a, b))
        if "x" in f[1] and path:
            code.append((a, b, int(f[2], 16), path))
    return code, every


def where(addr, code, exe, exports):
    for a, b, off, path in code:
        if a <= addr < b:
            fo = addr - a + off
            if path == exe:
                return f"exe+{hex(fo)}"
            name = os.path.basename(path)
            if "libcuda" in name:
                syms = exports.setdefault(path, elf_exports(path))
                best = None
                for v, n in syms:  # sorted: the last at or below the file offset (.text maps 1:1)
                    if v > fo:
                        break
                    best = n
                return f"libcuda({best or '?'}+{hex(fo)})"
            return f"{name}+{hex(fo)}"
    return None


def sample(pid, tid, exe, exports):
    if libc.ptrace(PTRACE_SEIZE, tid, None, None) != 0:
        return f"(ptrace refused: {os.strerror(ctypes.get_errno())})"
    try:
        libc.ptrace(PTRACE_INTERRUPT, tid, None, None)
        os.waitpid(tid, WALL)
        regs = (ctypes.c_ulonglong * 27)()
        if libc.ptrace(PTRACE_GETREGS, tid, None, ctypes.byref(regs)) != 0:
            return f"(no registers: {os.strerror(ctypes.get_errno())})"
        rip, rsp = regs[16], regs[19]
        code, every = maps_of(pid)
        end = next((b for a, b in every if a <= rsp < b), rsp)
        length = min(end - rsp, 2 << 20)
        with open(f"/proc/{pid}/mem", "rb") as m:
            m.seek(rsp)
            stack = m.read(length)
        words = [where(rip, code, exe, exports) or hex(rip)]
        for (v,) in struct.iter_unpack("<Q", stack[: len(stack) // 8 * 8]):
            w = where(v, code, exe, exports)
            if w and (w.startswith("exe+") or w.startswith("libcuda")):
                if not words or words[-1] != w:
                    words.append(w)
        return "at " + " ".join(words[:400])
    finally:
        libc.ptrace(PTRACE_DETACH, tid, None, None)


def main():
    args = sys.argv[1:]
    after, samples, every = 60.0, 3, 2.0
    while args and args[0] != "--":
        flag, value = args[0], args[1]
        args = args[2:]
        if flag == "--after":
            after = float(value)
        elif flag == "--samples":
            samples = int(value)
        elif flag == "--every":
            every = float(value)
        else:
            sys.exit(f"unknown flag {flag}")
    cmd = args[1:]
    child = subprocess.Popen(cmd)
    try:
        child.wait(timeout=after)
        sys.exit(child.returncode)
    except subprocess.TimeoutExpired:
        pass
    exe = os.readlink(f"/proc/{child.pid}/exe")
    exports = {}
    print(f"STACKS: {cmd[0]} still running after {after}s", file=sys.stderr, flush=True)
    for k in range(samples):
        for tid in sorted(int(t) for t in os.listdir(f"/proc/{child.pid}/task")):
            base = f"/proc/{child.pid}/task/{tid}"
            try:
                name = open(f"{base}/comm").read().strip()
                state = open(f"{base}/stat").read().rsplit(") ", 1)[1].split()[0]
                wchan = open(f"{base}/wchan").read().strip()
            except OSError:
                continue
            line = sample(child.pid, tid, exe, exports)
            print(f"WATCHDOG: sample {k} tid {tid} {name!r} state {state} wchan {wchan} {line}",
                  file=sys.stderr, flush=True)
        time.sleep(every)
    child.send_signal(signal.SIGKILL)
    child.wait()
    sys.exit(124)


if __name__ == "__main__":
    main()
