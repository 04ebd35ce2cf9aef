/*
 * nvidia-smi: simgpu's small stand-in for NVIDIA's, for containers on a host
 * without a GPU. It asks NVML (libnvidia-ml.so.1, found by soname like the
 * driver's) and prints what NVIDIA's prints, in its classic layout:
 *
 *   nvidia-smi                 the device table and the process list
 *   nvidia-smi -L              one line per GPU with its UUID
 *   nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,memory.free,
 *              utilization.gpu --format=csv[,noheader][,nounits]
 *
 * Memory comes from nvmlDeviceGetMemoryInfo, so inside a managed container
 * libcgpu's interposition makes it show the container's limit. The process
 * list keeps the processes this /proc shows (in a container: its own). simgpu
 * records a process in a container under its pid there, so two containers'
 * processes can share a pid: such a pid is listed once, its usage "N/A".
 * Exit status 0, 2 for bad usage, 9 when NVML cannot start (as NVIDIA's).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nvml.h"

#define WIDTH 77 /* between the outer bars */
#define MIB (1024ULL * 1024ULL)
#define MAX_PROCS 64
#define MAX_GPUS 16
#define SHOWN 8 /* processes shown per GPU */

static void rule(char corner, char fill, const int *cuts, int ncuts, char end)
{
    putchar(corner);
    for (int i = 1; i <= WIDTH; i++) {
        int cut = 0;
        for (int c = 0; c < ncuts; c++)
            cut |= cuts[c] == i;
        putchar(cut ? '+' : fill);
    }
    putchar(end);
    putchar('\n');
}

static void line(const char *text)
{
    printf("|%-*.*s|\n", WIDTH, WIDTH, text);
}

static void cells(const char *a, const char *b, const char *c)
{
    printf("|%-31.31s|%-22.22s|%-22.22s|\n", a, b, c);
}

static const int CUTS[] = {32, 55};

static void process_name(unsigned pid, char *out, size_t len)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%u/cmdline", pid);
    FILE *f = fopen(path, "re");
    out[0] = '\0';
    if (f) {
        size_t n = fread(out, 1, len - 1, f);
        out[n] = '\0';
        fclose(f);
    }
    if (out[0] == '\0')
        snprintf(out, len, "-");
}

static int visible_pid(unsigned pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%u", pid);
    return access(path, F_OK) == 0;
}

static int table(unsigned count)
{
    char driver[80] = "N/A", text[128], a[160], b[160], c[160];
    int cuda = 0;
    nvmlSystemGetDriverVersion(driver, sizeof(driver));
    nvmlSystemGetCudaDriverVersion(&cuda);
    time_t now = time(NULL);
    char stamp[64];
    strftime(stamp, sizeof(stamp), "%a %b %e %H:%M:%S %Y", localtime(&now));
    printf("%s\n", stamp);
    rule('+', '-', NULL, 0, '+');
    snprintf(text, sizeof(text), " NVIDIA-SMI %-12s Driver Version: %-12s CUDA Version: %d.%d",
             driver, driver, cuda / 1000, (cuda % 1000) / 10);
    line(text);
    rule('|', '-', CUTS, 2, '+');
    cells(" GPU  Name        Persistence-M", " Bus-Id        Disp.A ", " Volatile Uncorr. ECC ");
    cells(" Fan  Temp  Perf  Pwr:Usage/Cap", "         Memory-Usage ", " GPU-Util  Compute M. ");
    rule('|', '=', CUTS, 2, '|');

    nvmlProcessInfo_t procs[MAX_PROCS];
    unsigned nprocs[MAX_GPUS] = {0};
    nvmlProcessInfo_t shown[MAX_GPUS][SHOWN];
    int failed = 0;
    for (unsigned i = 0; i < count; i++) {
        nvmlDevice_t dev;
        char name[NVML_DEVICE_NAME_BUFFER_SIZE] = "N/A";
        nvmlPciInfo_t pci;
        nvmlMemory_t mem = {0};
        nvmlUtilization_t util = {0};
        unsigned temp = 0, power = 0;
        nvmlEnableState_t pm = NVML_FEATURE_DISABLED;
        if (nvmlDeviceGetHandleByIndex(i, &dev) != NVML_SUCCESS) {
            failed = 1;
            continue;
        }
        nvmlDeviceGetName(dev, name, sizeof(name));
        if (nvmlDeviceGetPciInfo(dev, &pci) != NVML_SUCCESS)
            snprintf(pci.busId, sizeof(pci.busId), "N/A");
        nvmlDeviceGetMemoryInfo(dev, &mem);
        nvmlDeviceGetUtilizationRates(dev, &util);
        nvmlDeviceGetTemperature(dev, NVML_TEMPERATURE_GPU, &temp);
        nvmlDeviceGetPowerUsage(dev, &power);
        nvmlDeviceGetPersistenceMode(dev, &pm);
        snprintf(a, sizeof(a), " %3u  %-20.20s%-3s  ", i, name,
                 pm == NVML_FEATURE_ENABLED ? "On" : "Off");
        snprintf(b, sizeof(b), " %-16.16s Off ", pci.busId);
        snprintf(c, sizeof(c), " %20s ", "0");
        cells(a, b, c);
        snprintf(a, sizeof(a), " N/A  %3uC    P0   %3uW /  70W ", temp, power / 1000);
        snprintf(text, sizeof(text), "%lluMiB / %lluMiB", mem.used / MIB, mem.total / MIB);
        snprintf(b, sizeof(b), "%21s ", text);
        snprintf(c, sizeof(c), " %6u%%%13s ", util.gpu, "Default");
        cells(a, b, c);
        rule('+', '-', CUTS, 2, '+');

        unsigned n = MAX_PROCS;
        if (nvmlDeviceGetComputeRunningProcesses(dev, &n, procs) != NVML_SUCCESS)
            n = 0;
        for (unsigned p = 0; p < n && i < MAX_GPUS && nprocs[i] < SHOWN; p++) {
            if (!visible_pid(procs[p].pid))
                continue;
            int seen = -1;
            for (unsigned q = 0; q < nprocs[i]; q++)
                if (shown[i][q].pid == procs[p].pid)
                    seen = (int)q;
            if (seen >= 0)
                shown[i][seen].usedGpuMemory = NVML_VALUE_NOT_AVAILABLE;
            else
                shown[i][nprocs[i]++] = procs[p];
        }
    }

    printf("\n");
    rule('+', '-', NULL, 0, '+');
    snprintf(text, sizeof(text), " Processes:%*s", WIDTH - 11, "GPU Memory ");
    line(text);
    snprintf(text, sizeof(text), "  GPU       PID   Type   Process name%*s", WIDTH - 37,
             "Usage      ");
    line(text);
    rule('|', '=', NULL, 0, '|');
    int any = 0;
    for (unsigned i = 0; i < count && i < MAX_GPUS; i++) {
        for (unsigned p = 0; p < nprocs[i]; p++) {
            char pname[256], used[32];
            process_name(shown[i][p].pid, pname, sizeof(pname));
            if (shown[i][p].usedGpuMemory == (unsigned long long)NVML_VALUE_NOT_AVAILABLE)
                snprintf(used, sizeof(used), "N/A");
            else
                snprintf(used, sizeof(used), "%lluMiB", shown[i][p].usedGpuMemory / MIB);
            snprintf(text, sizeof(text), "  %3u  %8u  %5s   %-40.40s %10s ", i, shown[i][p].pid,
                     "C", pname, used);
            line(text);
            any = 1;
        }
    }
    if (!any)
        line("  No running processes found");
    rule('+', '-', NULL, 0, '+');
    return failed;
}

static int list_gpus(unsigned count)
{
    for (unsigned i = 0; i < count; i++) {
        nvmlDevice_t dev;
        char name[NVML_DEVICE_NAME_BUFFER_SIZE] = "", uuid[NVML_DEVICE_UUID_BUFFER_SIZE] = "";
        if (nvmlDeviceGetHandleByIndex(i, &dev) != NVML_SUCCESS)
            return 1;
        nvmlDeviceGetName(dev, name, sizeof(name));
        nvmlDeviceGetUUID(dev, uuid, sizeof(uuid));
        printf("GPU %u: %s (UUID: %s)\n", i, name, uuid);
    }
    return 0;
}

/* --query-gpu: one CSV line per GPU with the named fields. */
static int query(unsigned count, char *fields, const char *format)
{
    static const char *const known[] = {"index", "name", "uuid", "memory.total", "memory.used",
                                        "memory.free", "utilization.gpu"};
    int header = strstr(format, "noheader") == NULL;
    int units = strstr(format, "nounits") == NULL;
    if (strncmp(format, "csv", 3) != 0) {
        fprintf(stderr, "nvidia-smi: --format: only csv is supported\n");
        return 2;
    }
    char *names[16];
    int n = 0;
    for (char *save = NULL, *f = strtok_r(fields, ",", &save); f && n < 16;
         f = strtok_r(NULL, ",", &save)) {
        while (*f == ' ')
            f++;
        int ok = 0;
        for (size_t k = 0; k < sizeof(known) / sizeof(known[0]); k++)
            ok |= strcmp(f, known[k]) == 0;
        if (!ok) {
            fprintf(stderr, "Field \"%s\" is not a valid field to query.\n", f);
            return 2;
        }
        names[n++] = f;
    }
    if (header) {
        for (int k = 0; k < n; k++) {
            int mem = strncmp(names[k], "memory.", 7) == 0;
            int pct = strcmp(names[k], "utilization.gpu") == 0;
            printf("%s%s%s", k ? ", " : "", names[k], mem ? " [MiB]" : pct ? " [%]" : "");
        }
        printf("\n");
    }
    for (unsigned i = 0; i < count; i++) {
        nvmlDevice_t dev;
        if (nvmlDeviceGetHandleByIndex(i, &dev) != NVML_SUCCESS)
            return 1;
        char name[NVML_DEVICE_NAME_BUFFER_SIZE] = "", uuid[NVML_DEVICE_UUID_BUFFER_SIZE] = "";
        nvmlMemory_t mem = {0};
        nvmlUtilization_t util = {0};
        nvmlDeviceGetName(dev, name, sizeof(name));
        nvmlDeviceGetUUID(dev, uuid, sizeof(uuid));
        nvmlDeviceGetMemoryInfo(dev, &mem);
        nvmlDeviceGetUtilizationRates(dev, &util);
        for (int k = 0; k < n; k++) {
            const char *f = names[k];
            printf("%s", k ? ", " : "");
            if (strcmp(f, "index") == 0)
                printf("%u", i);
            else if (strcmp(f, "name") == 0)
                printf("%s", name);
            else if (strcmp(f, "uuid") == 0)
                printf("%s", uuid);
            else if (strcmp(f, "utilization.gpu") == 0)
                printf("%u%s", util.gpu, units ? " %" : "");
            else
                printf("%llu%s",
                       (strcmp(f, "memory.total") == 0  ? mem.total
                        : strcmp(f, "memory.used") == 0 ? mem.used
                                                        : mem.free) / MIB,
                       units ? " MiB" : "");
        }
        printf("\n");
    }
    return 0;
}

static int usage(void)
{
    fprintf(stderr, "usage: nvidia-smi [-L | --query-gpu=FIELDS --format=csv[,noheader][,nounits]]\n"
                    "  (simgpu's nvidia-smi: the device table and process list from NVML)\n");
    return 2;
}

int main(int argc, char **argv)
{
    int list = 0;
    char *fields = NULL;
    const char *format = "csv";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-L") == 0 || strcmp(argv[i], "--list-gpus") == 0)
            list = 1;
        else if (strncmp(argv[i], "--query-gpu=", 12) == 0)
            fields = argv[i] + 12;
        else if (strncmp(argv[i], "--format=", 9) == 0)
            format = argv[i] + 9;
        else
            return usage();
    }
    if (nvmlInit() != NVML_SUCCESS) {
        printf("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
               "Make sure that the latest NVIDIA driver is installed and running.\n\n");
        return 9;
    }
    unsigned count = 0;
    if (nvmlDeviceGetCount(&count) != NVML_SUCCESS) {
        printf("Unable to determine the device count.\n");
        return 9;
    }
    int rc = list ? list_gpus(count) : fields ? query(count, fields, format) : table(count);
    fflush(stdout);
    nvmlShutdown();
    return rc;
}
