/*
 * vforker: a process whose main thread waits in vfork(), holding GPU memory,
 * for tests/attacks (issue 36: a process that never reports a ptrace stop).
 *
 * One command per line of stdin, one answer line each (its name first):
 *
 *   ready          pid (in its pid namespace)
 *   alloc BYTES    cuMemAlloc through the driver API (libcgpu preloaded); rc
 *   vfork          answers "vfork child=PID", then vfork()s: the child never
 *                  execs nor exits, so this process's main thread waits in
 *                  vfork() (the kernel's "D" state) until it is killed
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cuda.h"

int main(void)
{
    CUcontext context = NULL;
    char line[256];
    while (fgets(line, sizeof line, stdin) != NULL) {
        if (strncmp(line, "ready", 5) == 0) {
            printf("ready pid=%d\n", (int)getpid());
        } else if (strncmp(line, "alloc ", 6) == 0) {
            CUresult rc = CUDA_SUCCESS;
            CUdevice dev;
            CUdeviceptr p = 0;
            if (context == NULL) {
                rc = cuInit(0);
                if (rc == CUDA_SUCCESS)
                    rc = cuDeviceGet(&dev, 0);
                if (rc == CUDA_SUCCESS)
                    rc = cuCtxCreate(&context, 0, dev);
            }
            if (rc == CUDA_SUCCESS)
                rc = cuMemAlloc(&p, strtoull(line + 6, NULL, 0));
            printf("alloc rc=%d\n", (int)rc);
        } else if (strncmp(line, "vfork", 5) == 0) {
            printf("vfork ok\n");
            fflush(stdout);
            pid_t child = vfork();
            if (child == 0) {
                /* its own descriptor table: the parent's pipes close with the parent */
                close(0);
                close(1);
                close(2);
                for (;;)
                    syscall(SYS_pause);  /* never exec, never exit: the parent waits */
            }
            printf("vfork returned\n");
        } else {
            printf("unknown\n");
        }
        fflush(stdout);
    }
    return 0;
}
