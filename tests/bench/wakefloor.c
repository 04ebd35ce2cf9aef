/*
 * wakefloor: what one wake-up of a thread costs this host, the floor under
 * any dispatcher that sleeps between its steps.
 *
 * A thread sleeps in futex_waitv(2) on WORDS shared words (as a dispatcher
 * sleeps on its containers' doorbells) until a deadline SLEEP_US ahead, ROUNDS
 * times, and nothing else: it prints its own CPU time per wake-up in
 * microseconds (CLOCK_THREAD_CPUTIME_ID: the kernel's work to sleep and wake
 * it included). On a virtual machine that is tens of microseconds.
 *
 * With "ring", a child process bumps the first word and wakes it every
 * SLEEP_US instead (as libcgpu's watcher rings a doorbell when it answers a
 * drain), and the thread's deadline stays a second ahead: armed at every
 * wait, it never expires. A timer that expires costs a virtual machine
 * more than a wake by another process.
 *
 *   wakefloor WORDS SLEEP_US ROUNDS [ring]
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449
#endif
#define FUTEX2_SIZE_U32 0x02
#define MAX_WORDS 128

struct waitv {
	uint64_t val;
	uint64_t uaddr;
	uint32_t flags;
	uint32_t reserved;
};

static double seconds(clockid_t clock)
{
	struct timespec t;

	clock_gettime(clock, &t);
	return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int parse(const char *text, long low, long high, long *out)
{
	char *end;

	errno = 0;
	*out = strtol(text, &end, 10);
	return errno == 0 && *end == '\0' && end != text && *out >= low && *out <= high;
}

/* The child of "ring": bump the first word and wake its waiter every sleep_us. */
static void ring(uint32_t *word, long sleep_us, long rounds)
{
	const struct timespec pause = { .tv_sec = sleep_us / 1000000,
					.tv_nsec = sleep_us % 1000000 * 1000 };

	for (long i = 0; i < rounds; i++) {
		nanosleep(&pause, NULL);
		__atomic_add_fetch(word, 1, __ATOMIC_SEQ_CST);
		syscall(SYS_futex, word, FUTEX_WAKE, 1, NULL, NULL, 0); /* shared: no FUTEX_PRIVATE_FLAG */
	}
	_exit(0);
}

int main(int argc, char **argv)
{
	long words, sleep_us, rounds, ahead_us;
	struct waitv waiters[MAX_WORDS];
	uint32_t *shared;
	pid_t ringer = 0;
	double start;
	int rung;

	rung = argc == 5 && strcmp(argv[4], "ring") == 0;
	if ((argc != 4 && !rung) || !parse(argv[1], 1, MAX_WORDS, &words) ||
	    !parse(argv[2], 1, 1000000, &sleep_us) || !parse(argv[3], 1, 100000, &rounds)) {
		fprintf(stderr, "usage: wakefloor WORDS(1-%d) SLEEP_US(1-1000000) ROUNDS [ring]\n",
			MAX_WORDS);
		return 2;
	}
	/* Shared words, not private ones: the kernel keys them as it keys the
	 * doorbells in the containers' region files. */
	shared = mmap(NULL, MAX_WORDS * sizeof(*shared), PROT_READ | PROT_WRITE,
		      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (shared == MAP_FAILED) {
		perror("wakefloor: mmap");
		return 1;
	}
	for (long i = 0; i < words; i++)
		waiters[i] = (struct waitv){ .val = 0, .uaddr = (uintptr_t)&shared[i],
					     .flags = FUTEX2_SIZE_U32 };
	if (rung) {
		ringer = fork();
		if (ringer < 0) {
			perror("wakefloor: fork");
			return 1;
		}
		if (ringer == 0)
			ring(&shared[0], sleep_us, rounds);
	}
	ahead_us = rung ? 1000000 + sleep_us : sleep_us;
	start = seconds(CLOCK_THREAD_CPUTIME_ID);
	for (long i = 0; i < rounds; i++) {
		struct timespec deadline;
		long nsec, woke;

		waiters[0].val = __atomic_load_n(&shared[0], __ATOMIC_SEQ_CST);
		clock_gettime(CLOCK_MONOTONIC, &deadline);
		nsec = deadline.tv_nsec + ahead_us % 1000000 * 1000;
		deadline.tv_sec += ahead_us / 1000000 + nsec / 1000000000;
		deadline.tv_nsec = nsec % 1000000000;
		woke = syscall(SYS_futex_waitv, waiters, (unsigned int)words, 0, &deadline,
			       CLOCK_MONOTONIC);
		/* A ring wakes it (or came just before it slept: EAGAIN); else only
		 * the deadline may. */
		if (rung ? woke != 0 && errno != EAGAIN : woke >= 0 || errno != ETIMEDOUT) {
			perror("wakefloor: futex_waitv");
			return 1;
		}
	}
	printf("%.1f\n", (seconds(CLOCK_THREAD_CPUTIME_ID) - start) / (double)rounds * 1e6);
	if (ringer > 0)
		waitpid(ringer, NULL, 0);
	return 0;
}
