"""Runs one function of another (stopped) process on an emulated CPU, over that process's memory.

snug's kernels for instructions this machine lacks (AVX512-BF16 on a CPU without it) are tested
by running them on Bochs's model of a CPU that has them (bochscpu-python). The test process
calls `snug_testkit::emulate::call`, which starts this script and waits for it; the script maps
every readable page of the test process into the emulated CPU's address space at the same
virtual address, copying each page from /proc/PID/mem the first time the emulated code touches
it, runs `fn(arg)` from a stack the test lent, and on return writes the bytes the code changed
back into the test process. Nothing the code does reaches the real machine: a system call, or
any other fault, stops the run and is reported.

Usage: call.py PID FN ARG FS_BASE STACK_TOP MODEL
Prints one JSON object on success; exits 3 with a message on stderr when the code faulted.
"""

import ctypes
import glob
import json
import os
import sys

import bochscpu
import bochscpu.cpu
import bochscpu.memory

PAGE = 4096
# Where the function returns to: a page below Linux's mmap_min_addr, so never the process's,
# holding `hlt` (which faults at CPL 3: the stop we watch for).
RETURN_GVA = 0x1000
PML4_GPA = 0x10_0000
# Guest physical pages for the process's pages are handed out from here, above the page tables.
FIRST_GPA = 0x1_0000_0000
# Bochs's CPU models, by their index in bochscpu's `cpu.model` list (its sim.rs).
MODELS = {"tigerlake": 29, "sapphire_rapids": 30}
GP_FAULT = 13


def choose_model(name):
    # bochscpu fixes the model at Tiger Lake (AVX-512, no BF16); its parameter can be set through
    # the library's exported Bochs parameter API before the CPU is made.
    lib = ctypes.CDLL(glob.glob(bochscpu.__path__[0] + "/_bochscpu*.so")[0])
    lib.sim_get_param_enum.restype = ctypes.c_void_p
    param = lib.sim_get_param_enum(b"cpu.model")
    set_value = getattr(lib, "_ZN15bx_param_enum_c3setEl")
    set_value.argtypes = [ctypes.c_void_p, ctypes.c_long]
    set_value(param, MODELS[name])


def readable_regions(pid):
    regions = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            perms = fields[1]
            name = fields[5] if len(fields) > 5 else ""
            if perms[0] != "r" or name in ("[vsyscall]", "[vvar]"):
                continue
            regions.append((start, end, perms[1] == "w"))
    return regions


def main():
    pid, fn, arg, fs_base, stack_top = (int(x, 0) for x in sys.argv[1:6])
    choose_model(sys.argv[6])
    mem = open(f"/proc/{pid}/mem", "r+b", buffering=0)

    table = bochscpu.memory.PageMapLevel4Table()
    gva_of = {}
    next_gpa = FIRST_GPA
    for start, end, writable in readable_regions(pid):
        for gva in range(start, end, PAGE):
            table.insert(gva, next_gpa, 1 if writable else 0)
            gva_of[next_gpa] = gva
            next_gpa += PAGE
    return_gpa = next_gpa
    table.insert(RETURN_GVA, return_gpa, 0)
    for hva, gpa in table.commit(PML4_GPA):
        bochscpu.memory.page_insert(gpa, hva)
    ret_hva = bochscpu.memory.allocate_host_page()
    ctypes.memmove(ret_hva, b"\xf4" * PAGE, PAGE)
    bochscpu.memory.page_insert(return_gpa, ret_hva)

    # The pages the code touched: gpa -> (host page, the bytes it started with).
    touched = {}

    def missing_page(gpa):
        gva = gva_of.get(gpa & ~(PAGE - 1))
        if gva is None:
            raise RuntimeError(f"emulated code reached guest physical {gpa:#x}, no page of ours")
        mem.seek(gva)
        # A page listed readable that cannot be read was unmapped meanwhile: the run fails
        # rather than see zeros there.
        original = mem.read(PAGE)
        if len(original) != PAGE:
            raise RuntimeError(f"page {gva:#x} of process {pid} could not be read")
        hva = bochscpu.memory.allocate_host_page()
        ctypes.memmove(hva, original, PAGE)
        bochscpu.memory.page_insert(gpa & ~(PAGE - 1), hva)
        touched[gpa & ~(PAGE - 1)] = (hva, original)

    session = bochscpu.Session()
    session.missing_page_handler = missing_page

    state = bochscpu.State()
    bochscpu.cpu.set_long_mode(state)
    state.cr3 = PML4_GPA
    # OSFXSR, OSXMMEXCPT, OSXSAVE; x87, SSE, AVX and AVX-512 state enabled; the SysV defaults
    # for MXCSR and the x87 control word (every exception masked, round to nearest).
    state.cr4 = state.cr4 | (1 << 9) | (1 << 10) | (1 << 18)
    state.xcr0 = 0xE7
    state.mxcsr = 0x1F80
    state.fpcw = 0x37F
    # SysV: at entry rsp + 8 is 16-byte aligned, and [rsp] is the return address.
    rsp = (stack_top & ~0xF) - 8
    state.rsp = rsp
    state.rip = fn
    state.rdi = arg
    code = bochscpu.Segment()
    code.present, code.selector, code.base, code.limit, code.attr = True, 0x33, 0, 0xFFFFFFFF, 0x22FB
    data = bochscpu.Segment()
    data.present, data.selector, data.base, data.limit, data.attr = True, 0x2B, 0, 0xFFFFFFFF, 0xCF3
    fs = bochscpu.Segment()
    fs.present, fs.selector, fs.base, fs.limit, fs.attr = True, 0, fs_base, 0xFFFFFFFF, 0xCF3
    state.cs, state.ds, state.ss, state.es, state.gs, state.fs = code, data, data, data, data, fs
    session.cpu.state = state
    bochscpu.memory.virt_write(PML4_GPA, rsp, list(RETURN_GVA.to_bytes(8, "little")))

    fault = []

    def exception(sess, cpu_id, vector, error_code):
        fault.append((vector, error_code, sess.cpu.state.rip))
        sess.stop()

    hook = bochscpu.Hook()
    hook.exception = exception
    session.run([hook])
    vector, error_code, rip = fault[0] if fault else (None, None, None)
    # Bochs reports the hlt's fault with rip past it.
    if vector != GP_FAULT or rip is None or rip & ~(PAGE - 1) != RETURN_GVA:
        sys.stderr.write(
            f"the emulated code faulted: vector {vector}, error code {error_code}, "
            f"rip {rip if rip is None else hex(rip)}\n"
        )
        sys.stderr.flush()
        os._exit(3)

    # The runs of changed bytes, all found before any is written back.
    changes = []
    for gpa, (hva, original) in touched.items():
        now = ctypes.string_at(hva, PAGE)
        if now == original:
            continue
        # Only the changed runs of bytes: the rest of the page may be another thread's.
        i = 0
        while i < PAGE:
            if now[i] == original[i]:
                i += 1
                continue
            j = i
            while j < PAGE and now[j] != original[j]:
                j += 1
            changes.append((gva_of[gpa] + i, now[i:j]))
            i = j
    written = 0
    for at, data in changes:
        mem.seek(at)
        if mem.write(data) != len(data):
            raise RuntimeError(f"writing {len(data)} bytes back at {at:#x} fell short")
        written += len(data)
    final = session.cpu.state
    print(json.dumps({"rax": final.rax, "pages": len(touched), "bytes_written": written}))
    sys.stdout.flush()
    # The bindings' objects crash the interpreter's teardown; everything is written by now.
    os._exit(0)


if __name__ == "__main__":
    main()
