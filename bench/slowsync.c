/* slowsync: make every fsync/fdatasync of a process take at least SLOWSYNC_US microseconds
 * longer, as on a network volume (cloud block storage commits in 1-10 ms), for benchmarks of
 * what a slower disk costs. Loaded with LD_PRELOAD (bench/latency.py --fsync-delay MS builds it).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

/* the real call's result, SLOWSYNC_US microseconds later */
static int slowed(int rc) {
    const char *v = getenv("SLOWSYNC_US");
    if (v) usleep((useconds_t)atol(v));
    return rc;
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    return slowed(real(fd));
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    return slowed(real(fd));
}
