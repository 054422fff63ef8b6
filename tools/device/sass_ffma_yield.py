#!/usr/bin/env python3
"""tools/device/sass_ffma_yield.py: a SASS experiment on a built binary (issue 6, FP8 prefill GEMM; tenth session).

Hypothesis (bench/NOTES.md, tenth session): in the prefill kernels' block-scale promotion (64 FFMAs per batch,
acc += tmp * scale) ptxas pairs neighbouring FFMAs that share the scale register through the operand reuse
cache and marks the second of each pair "do not yield" (control bit 45 set with the reuse flag), so one
consumer warp issues its promotion in pairs that the other consumer warpgroup's warp on the same scheduler
cannot break into (its WARPGROUP.ARRIVE / wgmma issue waits); ncu shows 'dispatch' / 'misc' stalls on exactly
those FFMAs. The experiment clears the reuse flags and the bit in every run of >= 32 consecutive FFMAs of the
named kernels (DeepGEMM describes the same observation; this script is this project's own).

Scheduling bits only: every FFMA keeps its operands, so the results are the same bits.

Usage: sass_ffma_yield.py BINARY KERNEL-SUBSTRING [KERNEL-SUBSTRING ...] [--dry-run]
  BINARY: an executable or shared object whose fatbin holds uncompressed sm_90a cubins (nvcc's default here:
  the cubin bytes appear verbatim); KERNEL-SUBSTRING: part of the mangled kernel name, e.g.
  'fp8_prefill_kernelILb1ELi4ELb0' (mode 24's gate_up kernel). Prints what it changed per kernel; exit 1 if
  no named kernel or no FFMA run was found.
Encoding facts used (Volta+ 128-bit SASS, confirmed on this repo's cuobjdump listings): opcode in bits 0-11
of the first 64-bit word (FFMA with three register sources: 0x223); in the second word, bit 45 the yield
control bit, bits 58-61 the operand reuse flags.
"""
import struct
import sys

FFMA_RRR = 0x223
YIELD_BIT = 1 << 45
REUSE_BITS = 0xF << 58
EM_CUDA = 190


def embedded_elfs(data):
    """Offsets of the CUDA ELF images (cubins) inside `data`."""
    out, pos = [], 0
    while True:
        pos = data.find(b"\x7fELF\x02\x01", pos)
        if pos < 0:
            return out
        if len(data) >= pos + 0x40 and struct.unpack_from("<H", data, pos + 0x12)[0] == EM_CUDA:
            out.append(pos)
        pos += 4


def text_sections(data, base):
    """(name, file offset, size) of the .text.* sections of the cubin at `base`."""
    shoff = struct.unpack_from("<Q", data, base + 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, base + 0x3A)
    secs = []
    for i in range(shnum):
        o = base + shoff + i * shentsize
        name, _typ, _flags, _addr, off, size = struct.unpack_from("<IIQQQQ", data, o)
        secs.append((name, off, size))
    stro = base + secs[shstrndx][1]
    out = []
    for name, off, size in secs:
        end = data.index(b"\0", stro + name)
        n = data[stro + name:end].decode(errors="replace")
        if n.startswith(".text."):
            out.append((n[6:], base + off, size))
    return out


def patch(data, start, size, dry):
    """Clears reuse + yield bits in runs of >= 32 FFMAs; returns (runs, changed)."""
    n = size // 16
    ops = [struct.unpack_from("<QQ", data, start + 16 * i) for i in range(n)]
    runs = changed = 0
    i = 0
    while i < n:
        j = i
        while j < n and (ops[j][0] & 0xFFF) == FFMA_RRR:
            j += 1
        if j - i >= 32:
            runs += 1
            for k in range(i, j):
                w0, w1 = ops[k]
                if w1 & REUSE_BITS:
                    changed += 1
                    if not dry:
                        struct.pack_into("<Q", data, start + 16 * k + 8, w1 & ~(REUSE_BITS | YIELD_BIT))
        i = max(j, i + 1)
    return runs, changed


def main(argv):
    dry = "--dry-run" in argv
    args = [a for a in argv[1:] if a != "--dry-run"]
    if len(args) < 2:
        print(__doc__)
        return 2
    path, names = args[0], args[1:]
    data = bytearray(open(path, "rb").read())
    found = 0
    for base in embedded_elfs(data):
        for name, off, size in text_sections(data, base):
            if any(s in name for s in names):
                runs, changed = patch(data, off, size, dry)
                print(f"{name}: {runs} FFMA runs, {changed} FFMAs without reuse / yield bit{' (dry run)' if dry else ''}")
                found += runs > 0
    if not dry:
        with open(path, "r+b") as f:
            f.write(data)
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
