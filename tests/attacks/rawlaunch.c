/*
 * rawlaunch: a hostile preload for tests/attacks. It defines cuLaunchKernel and
 * sends every launch straight to the driver's own cuLaunchKernel, past
 * libcgpu's gate, while libcgpu stays loaded (the process keeps its slot, its
 * memory limit, everything but the gate).
 *
 * It never asks the dynamic loader for the driver's function, so no
 * interposition of dlsym, dlvsym or cuGetProcAddress can hand it a wrapper: it
 * finds the loaded libcuda.so.1 with dl_iterate_phdr and reads the address
 * from that object's own dynamic symbol table. Only a check from outside the
 * process (what the driver saw it run) can tell.
 *
 *   LD_PRELOAD=/librawlaunch.so sharework ...
 */
#define _GNU_SOURCE
#include <elf.h>
#include <link.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cuda.h"

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, CUstream, void **, void **);

struct wanted {
    const char *name;
    void *found;
};

/* A pointer from the dynamic section: glibc relocates most of them in place. */
static uintptr_t dyn_ptr(const struct dl_phdr_info *info, ElfW(Addr) value)
{
    return value >= info->dlpi_addr ? value : info->dlpi_addr + value;
}

/* Symbols in a DT_GNU_HASH table: past the highest bucket's chain end. */
static uint32_t gnu_symbol_count(const uint32_t *table)
{
    uint32_t nbuckets = table[0], offset = table[1], bloom_words = table[2];
    const uint32_t *buckets = (const uint32_t *)((const ElfW(Addr) *)(table + 4) + bloom_words);
    const uint32_t *chain = buckets + nbuckets;
    uint32_t last = 0;
    for (uint32_t i = 0; i < nbuckets; i++)
        if (buckets[i] > last)
            last = buckets[i];
    if (last < offset)
        return offset;
    while ((chain[last - offset] & 1) == 0)
        last++;
    return last + 1;
}

static int visit(struct dl_phdr_info *info, size_t size, void *data)
{
    struct wanted *want = data;
    (void)size;
    if (info->dlpi_name == NULL || strstr(info->dlpi_name, "libcuda.so") == NULL)
        return 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type != PT_DYNAMIC)
            continue;
        const ElfW(Dyn) *dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
        const ElfW(Sym) *symtab = NULL;
        const char *strtab = NULL;
        uint32_t count = 0;
        for (; dyn->d_tag != DT_NULL; dyn++) {
            if (dyn->d_tag == DT_SYMTAB)
                symtab = (const ElfW(Sym) *)dyn_ptr(info, dyn->d_un.d_ptr);
            else if (dyn->d_tag == DT_STRTAB)
                strtab = (const char *)dyn_ptr(info, dyn->d_un.d_ptr);
            else if (dyn->d_tag == DT_HASH)
                count = ((const uint32_t *)dyn_ptr(info, dyn->d_un.d_ptr))[1];
            else if (dyn->d_tag == DT_GNU_HASH && count == 0)
                count = gnu_symbol_count((const uint32_t *)dyn_ptr(info, dyn->d_un.d_ptr));
        }
        if (symtab == NULL || strtab == NULL)
            return 0;
        for (uint32_t s = 0; s < count; s++) {
            if (symtab[s].st_value != 0 && ELF64_ST_TYPE(symtab[s].st_info) == STT_FUNC &&
                strcmp(strtab + symtab[s].st_name, want->name) == 0) {
                want->found = (void *)(info->dlpi_addr + symtab[s].st_value);
                return 1;
            }
        }
    }
    return 0;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, CUstream stream,
                        void **params, void **extra)
{
    static launch_fn real;
    if (real == NULL) {
        struct wanted want = {"cuLaunchKernel", NULL};
        dl_iterate_phdr(visit, &want);
        if (want.found == NULL) {
            fprintf(stderr, "rawlaunch: no libcuda.so loaded\n");
            return CUDA_ERROR_NOT_INITIALIZED;
        }
        real = (launch_fn)want.found;
    }
    return real(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
}
