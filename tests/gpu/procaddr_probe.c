/*
 * procaddr_probe.c: does every lookup of a wrapped name end at libcgpu's
 * wrapper, on this driver? (tests/gpu/validate.sh; issue 36, item 3)
 *
 *   procaddr_probe --lib LIBCGPU --driver         no libcgpu loaded: print the
 *                                                 driver's own answers
 *   procaddr_probe --lib LIBCGPU [--expect FILE]  with libcgpu preloaded and a
 *                                                 region: check its answers
 *
 * The names are those libcgpu exports (cu*, read from LIBCGPU's dynamic
 * symbol table), asked for as callers ask cuGetProcAddress: without _ptsz /
 * _ptds and without a _vN suffix. Each is asked of cuGetProcAddress_v2 and of
 * the CUDA 11 cuGetProcAddress, at CUDA versions 11030, 12000, 12080 and the
 * driver's own, with flags 0 (DEFAULT), 1 (LEGACY_STREAM) and 2
 * (PER_THREAD_DEFAULT_STREAM). One line per query:
 *
 *   q NAME VERSION FLAGS API rc=N SYMBOL OBJECT ALIASES
 *
 * SYMBOL is the exported symbol the answer is ("-": none starts there, an
 * internal entry point), OBJECT the file it lies in, ALIASES the names of
 * libcgpu's list that dlsym finds at the same address ("-": none). With libcgpu a query
 * FAILs when the driver answered and libcgpu's answer is not one of its
 * wrappers (dladdr puts it in libcgpu, and dlsym(RTLD_DEFAULT, SYMBOL), which
 * must lie in libcgpu, is the same pointer), or a wrapper of another name, or,
 * with --expect (the --driver output), not the variant the driver picked
 * where that is an exported symbol, or a different result code. It also
 * checks that dlsym on the driver's handle, and the C library's dlsym taken
 * with dlvsym, hand out the wrappers. Exit status 1 when anything failed.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long cuuint64_t;
typedef CUresult (*getproc_v2_fn)(const char *, void **, int, cuuint64_t, int *);
typedef CUresult (*getproc_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*init_fn)(unsigned int);
typedef CUresult (*version_fn)(int *);
typedef void *(*dlsym_fn)(void *, const char *);

#define MAX_NAMES 512

static char *names[MAX_NAMES]; /* libcgpu's exported cu* names */
static size_t nnames;
static char *bases[MAX_NAMES]; /* the names callers ask cuGetProcAddress for */
static size_t nbases;
static int failures;

static void fail(const char *fmt, const char *a, const char *b)
{
    printf("FAIL ");
    printf(fmt, a, b);
    printf("\n");
    failures++;
}

/* The cu* functions LIB defines, from its section headers' .dynsym. */
static int read_names(const char *lib)
{
    int fd = open(lib, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0)
        return -1;
    const unsigned char *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED || (size_t)st.st_size < sizeof(ElfW(Ehdr)))
        return -1;
    const ElfW(Ehdr) *eh = (const ElfW(Ehdr) *)map;
    if (memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0 ||
        eh->e_shoff + (size_t)eh->e_shnum * sizeof(ElfW(Shdr)) > (size_t)st.st_size)
        return -1;
    const ElfW(Shdr) *sh = (const ElfW(Shdr) *)(map + eh->e_shoff);
    for (unsigned i = 0; i < eh->e_shnum; i++) {
        if (sh[i].sh_type != SHT_DYNSYM || sh[i].sh_link >= eh->e_shnum)
            continue;
        const ElfW(Sym) *sym = (const ElfW(Sym) *)(map + sh[i].sh_offset);
        const char *str = (const char *)(map + sh[sh[i].sh_link].sh_offset);
        size_t n = sh[i].sh_size / sizeof(ElfW(Sym));
        for (size_t k = 0; k < n && nnames < MAX_NAMES; k++) {
            const char *name = str + sym[k].st_name;
            if (sym[k].st_shndx != SHN_UNDEF && (sym[k].st_info & 0xf) == STT_FUNC &&
                strncmp(name, "cu", 2) == 0)
                names[nnames++] = strdup(name);
        }
    }
    return nnames > 0 ? 0 : -1;
}

/* The name cuGetProcAddress is asked for: no _ptsz/_ptds, no _vN. */
static char *base_of(const char *name)
{
    char *b = strdup(name);
    size_t n = strlen(b);
    if (n > 5 && (strcmp(b + n - 5, "_ptsz") == 0 || strcmp(b + n - 5, "_ptds") == 0))
        b[n -= 5] = '\0';
    if (n > 3 && b[n - 3] == '_' && b[n - 2] == 'v' && b[n - 1] >= '2' && b[n - 1] <= '9')
        b[n - 3] = '\0';
    return b;
}

static void collect_bases(void)
{
    for (size_t i = 0; i < nnames; i++) {
        char *b = base_of(names[i]);
        size_t k = 0;
        while (k < nbases && strcmp(bases[k], b) != 0)
            k++;
        if (k == nbases && nbases < MAX_NAMES)
            bases[nbases++] = b;
        else
            free(b);
    }
}

static const char *file_base(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash != NULL ? slash + 1 : path;
}

struct answer {
    char symbol[128];
    char object[256];
    const void *fbase;
};

static void describe(const void *fn, struct answer *a)
{
    Dl_info info;
    snprintf(a->symbol, sizeof a->symbol, "-");
    snprintf(a->object, sizeof a->object, "?");
    a->fbase = NULL;
    if (fn == NULL || dladdr(fn, &info) == 0)
        return;
    if (info.dli_sname != NULL && info.dli_saddr == fn)
        snprintf(a->symbol, sizeof a->symbol, "%s", info.dli_sname);
    if (info.dli_fname != NULL)
        snprintf(a->object, sizeof a->object, "%s", file_base(info.dli_fname));
    a->fbase = info.dli_fbase;
}

/* The --driver line of the same query, or NULL. */
static char **expected;
static size_t nexpected;

static const char *expected_line(const char *key)
{
    size_t len = strlen(key);
    for (size_t i = 0; i < nexpected; i++)
        if (strncmp(expected[i], key, len) == 0 && expected[i][len] == ' ')
            return expected[i];
    return NULL;
}

static void read_expected(const char *path)
{
    FILE *f = fopen(path, "r");
    char line[512];
    if (f == NULL) {
        fprintf(stderr, "procaddr_probe: cannot read %s\n", path);
        exit(2);
    }
    while (fgets(line, sizeof line, f) != NULL) {
        if (strncmp(line, "q ", 2) != 0)
            continue;
        line[strcspn(line, "\n")] = '\0';
        char **grown = realloc(expected, (nexpected + 1) * sizeof *expected);
        if (grown == NULL)
            exit(2);
        expected = grown;
        expected[nexpected++] = strdup(line);
    }
    fclose(f);
}

/* Whether `name` is one of the comma-separated `list`. */
static int in_list(const char *list, const char *name)
{
    size_t len = strlen(name);
    for (const char *p = list; *p != '\0';) {
        const char *end = strchr(p, ',');
        size_t n = end != NULL ? (size_t)(end - p) : strlen(p);
        if (n == len && strncmp(p, name, len) == 0)
            return 1;
        p += n + (end != NULL);
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *lib = NULL, *expect = NULL;
    int driver_only = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--lib") == 0 && i + 1 < argc)
            lib = argv[++i];
        else if (strcmp(argv[i], "--expect") == 0 && i + 1 < argc)
            expect = argv[++i];
        else if (strcmp(argv[i], "--driver") == 0)
            driver_only = 1;
        else {
            fprintf(stderr, "usage: procaddr_probe --lib LIBCGPU [--driver | --expect FILE]\n");
            return 2;
        }
    }
    if (lib == NULL || read_names(lib) != 0) {
        fprintf(stderr, "procaddr_probe: no cu* functions in %s\n", lib ? lib : "(no --lib)");
        return 2;
    }
    collect_bases();
    if (expect != NULL)
        read_expected(expect);
    setvbuf(stdout, NULL, _IOLBF, 0);

    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (cuda == NULL) {
        fprintf(stderr, "procaddr_probe: %s\n", dlerror());
        return 2;
    }
    init_fn init = (init_fn)dlsym(cuda, "cuInit");
    version_fn get_version = (version_fn)dlsym(cuda, "cuDriverGetVersion");
    getproc_v2_fn getproc_v2 = (getproc_v2_fn)dlsym(cuda, "cuGetProcAddress_v2");
    getproc_fn getproc = (getproc_fn)dlsym(cuda, "cuGetProcAddress");
    int driver = 0;
    if (init == NULL || get_version == NULL || getproc_v2 == NULL || init(0) != 0 ||
        get_version(&driver) != 0) {
        fprintf(stderr, "procaddr_probe: the driver does not initialise\n");
        return 2;
    }

    /* libcgpu: where its own cuGetProcAddress_v2 is */
    struct answer self;
    describe(dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2"), &self);
    if (!driver_only && strcmp(self.object, file_base(lib)) != 0) {
        printf("FAIL cuGetProcAddress_v2 resolves to %s, not libcgpu: is it preloaded?\n",
               self.object);
        return 1;
    }
    printf("driver %d, %zu names from %s, %zu asked\n", driver, nnames, file_base(lib), nbases);

    const int versions[] = {11030, 12000, 12080, driver};
    const unsigned long long flag_set[] = {0, 1, 2};
    size_t queries = 0, answered = 0;
    for (size_t b = 0; b < nbases; b++)
        for (size_t v = 0; v < sizeof versions / sizeof *versions; v++) {
            if (v == 3 && (driver == 11030 || driver == 12000 || driver == 12080))
                continue;
            for (size_t f = 0; f < 3; f++)
                for (int api = 0; api < 2; api++) {
                    if (api == 1 && getproc == NULL)
                        continue;
                    void *fn = NULL;
                    int status = 0;
                    CUresult rc = api == 0 ? getproc_v2(bases[b], &fn, versions[v], flag_set[f],
                                                        &status)
                                           : getproc(bases[b], &fn, versions[v], flag_set[f]);
                    struct answer a;
                    describe(rc == 0 ? fn : NULL, &a);
                    char key[256];
                    snprintf(key, sizeof key, "q %s %d %llu %s", bases[b], versions[v],
                             flag_set[f], api == 0 ? "v2" : "v1");
                    /* the names of libcgpu's list the driver exports at this address */
                    char aliases[1024] = "";
                    size_t used = 0;
                    for (size_t k = 0; rc == 0 && k < nnames; k++)
                        if (dlsym(cuda, names[k]) == fn && used + strlen(names[k]) + 2 < sizeof aliases)
                            used += (size_t)snprintf(aliases + used, sizeof aliases - used, "%s%s",
                                                     used ? "," : "", names[k]);
                    printf("%s rc=%d %s %s %s\n", key, rc, rc == 0 ? a.symbol : "-",
                           rc == 0 ? a.object : "-", used ? aliases : "-");
                    queries++;
                    if (driver_only)
                        continue;
                    const char *want = expected_line(key);
                    if (want != NULL) {
                        int want_rc = -1;
                        char want_symbol[128] = "", want_object[256] = "", want_aliases[1024] = "";
                        sscanf(want + strlen(key), " rc=%d %127s %255s %1023s", &want_rc,
                               want_symbol, want_object, want_aliases);
                        if (want_rc != rc)
                            fail("%s: the driver answered %s", key, want + strlen(key) + 1);
                        else if (rc == 0 && strcmp(want_symbol, "-") != 0 &&
                                 strcmp(want_symbol, a.symbol) != 0 &&
                                 !in_list(want_aliases, a.symbol))
                            fail("%s: libcgpu answered another variant than the driver (%s)",
                                 key, want + strlen(key) + 1);
                    }
                    if (rc != 0)
                        continue;
                    answered++;
                    char *family = base_of(a.symbol);
                    void *by_name = dlsym(RTLD_DEFAULT, a.symbol);
                    struct answer global;
                    describe(by_name, &global);
                    if (a.fbase != self.fbase)
                        fail("%s: the answer lies in %s, not in libcgpu", key, a.object);
                    else if (by_name != fn || global.fbase != self.fbase)
                        fail("%s: %s is not what dlsym(RTLD_DEFAULT) finds in libcgpu", key,
                             a.symbol);
                    else if (strcmp(family, bases[b]) != 0)
                        fail("%s: libcgpu answered with %s", key, a.symbol);
                    free(family);
                }
        }

    /* dlsym on the driver's handle, and the C library's dlsym by way of dlvsym */
    size_t absent = 0, checked = 0;
    const char *dlsym_versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    dlsym_fn libc_dlsym = NULL;
    for (size_t i = 0; i < 3 && libc_dlsym == NULL; i++)
        libc_dlsym = (dlsym_fn)dlvsym(RTLD_DEFAULT, "dlsym", dlsym_versions[i]);
    struct answer ds;
    describe((void *)libc_dlsym, &ds);
    printf("dlvsym(RTLD_DEFAULT, \"dlsym\") -> %s %s\n", ds.symbol, ds.object);
    if (!driver_only && ds.fbase != self.fbase)
        fail("dlvsym hands out the %s of %s", ds.symbol, ds.object);
    for (size_t i = 0; i < nnames && !driver_only; i++) {
        void *direct = dlsym(cuda, names[i]);
        if (direct == NULL) {
            printf("absent %s (libcgpu wraps it, the driver does not export it)\n", names[i]);
            absent++;
            continue;
        }
        checked++;
        void *global = dlsym(RTLD_DEFAULT, names[i]);
        void *via_dlvsym = libc_dlsym != NULL ? libc_dlsym(cuda, names[i]) : global;
        struct answer a;
        describe(direct, &a);
        if (direct != global || a.fbase != self.fbase)
            fail("dlsym(libcuda, %s) hands out %s", names[i], a.object);
        if (via_dlvsym != global)
            fail("%s: the dlsym dlvsym gives hands out another function%s", names[i], "");
    }
    printf("procaddr_probe: driver %d, %zu queries, %zu answered, %zu dlsym checks, "
           "%zu names the driver lacks, %d failures\n",
           driver, queries, answered, checked, absent, failures);
    return failures != 0;
}
