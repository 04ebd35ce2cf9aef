/*
 * kernels.h: the PTX module of the workloads. simgpu takes any module and
 * times a kernel by its name (sleep_<us>); NVIDIA's driver JIT-compiles this
 * PTX, where sleep_0 returns at once and sleep_50 spins on %globaltimer for
 * 50 us, so the same programs run on both.
 */
#ifndef CGPU_TEST_KERNELS_H
#define CGPU_TEST_KERNELS_H

static const char kernels_ptx[] =
    ".version 7.0\n"
    ".target sm_52\n"
    ".address_size 64\n"
    "\n"
    ".visible .entry sleep_0()\n"
    "{\n"
    "    ret;\n"
    "}\n"
    "\n"
    ".visible .entry sleep_50()\n"
    "{\n"
    "    .reg .pred %p<2>;\n"
    "    .reg .b64 %rd<4>;\n"
    "    mov.u64 %rd1, %globaltimer;\n"
    "$L_spin:\n"
    "    mov.u64 %rd2, %globaltimer;\n"
    "    sub.s64 %rd3, %rd2, %rd1;\n"
    "    setp.lt.u64 %p1, %rd3, 50000;\n"
    "    @%p1 bra $L_spin;\n"
    "    ret;\n"
    "}\n";

#endif
