/* faultfs: make writes or fsyncs of one file fail, for storage-fault tests of real processes.
 *
 * Loaded with LD_PRELOAD into an `asyncrawl run` (or any) process; configured by environment:
 *   FAULTFS_SUFFIX  the file to fail: a path ending in this (e.g. "/state/state.db-wal")
 *   FAULTFS_WHERE   "write" (the write that crosses FAULTFS_AFTER writes half, then fails, as a
 *                   full disk does) or "fsync" (the first fsync/fdatasync after FAULTFS_AFTER
 *                   bytes were written fails; the data was written)
 *   FAULTFS_AFTER   bytes written to the file before the fault
 *   FAULTFS_ARM     optional: a path; the bytes are counted only once a file exists there (a
 *                   test creates it when it has seen what it wants committed before the fault)
 *   FAULTFS_ERRNO   the error (28 ENOSPC, 5 EIO)
 *   FAULTFS_REPORT  a file to which a line "tripped N after M" is appended at exit (or _exit,
 *                   which a process that has closed everything may end with: os._exit)
 * Once tripped, every later write/fsync of the file fails too (and is counted: a writer must not
 * try again). SQLite writes through pwrite64/pwrite/write and syncs with fdatasync/fsync.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static const char *suffix, *arm;
static int where_write, where_fsync, err;
static long long after = -1, written;
static int tripped, calls_after;

static void report(void) {
    static int reported;
    const char *path = getenv("FAULTFS_REPORT");
    if (!path || reported++) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "tripped %d after %d\n", tripped, calls_after);
    fclose(f);
}

__attribute__((constructor)) static void init(void) {
    suffix = getenv("FAULTFS_SUFFIX");
    const char *w = getenv("FAULTFS_WHERE");
    where_write = w && !strcmp(w, "write");
    where_fsync = w && !strcmp(w, "fsync");
    arm = getenv("FAULTFS_ARM");
    if (getenv("FAULTFS_AFTER")) after = atoll(getenv("FAULTFS_AFTER"));
    err = getenv("FAULTFS_ERRNO") ? atoi(getenv("FAULTFS_ERRNO")) : EIO;
    atexit(report);
}

void _exit(int status) {
    static void (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "_exit");
    report();
    real(status);
    __builtin_unreachable();
}

static int ours(int fd) {
    if (!suffix || after < 0) return 0;
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = 0;
    size_t l = strlen(suffix);
    if ((size_t)n < l || strcmp(path + n - l, suffix) != 0) return 0;
    const char *a = __atomic_load_n(&arm, __ATOMIC_ACQUIRE);
    if (a) {  /* not armed yet: the file is left alone */
        if (access(a, F_OK) != 0) return 0;
        __atomic_store_n(&arm, NULL, __ATOMIC_RELEASE);
    }
    return 1;
}

/* how much of a write of `count` bytes to let through; -1: fail it now */
static long long allow(int fd, size_t count) {
    if (!ours(fd)) return (long long)count;
    if (tripped) { if (where_write) { calls_after++; return -1; } }
    if (where_write && written + (long long)count > after) {
        tripped++;
        return (long long)count / 2;  /* a short write, then the error */
    }
    written += count;
    return (long long)count;
}

#define WRAP_WRITE(name, proto, call_part, call_full)                                    \
    ssize_t name proto {                                                                 \
        static ssize_t (*real) proto;                                                    \
        if (!real) real = dlsym(RTLD_NEXT, #name);                                       \
        long long ok = allow(fd, count);                                                 \
        if (ok < 0) { errno = err; return -1; }                                          \
        if (ok < (long long)count) {                                                     \
            if (ok > 0) { size_t count_ = (size_t)ok; (void)count_; call_part; }         \
            errno = err; return -1;                                                      \
        }                                                                                \
        return call_full;                                                                \
    }

WRAP_WRITE(write, (int fd, const void *buf, size_t count), real(fd, buf, count_),
           real(fd, buf, count))
WRAP_WRITE(pwrite, (int fd, const void *buf, size_t count, off_t off),
           real(fd, buf, count_, off), real(fd, buf, count, off))
WRAP_WRITE(pwrite64, (int fd, const void *buf, size_t count, off_t off),
           real(fd, buf, count_, off), real(fd, buf, count, off))

static int sync_fails(int fd) {
    if (!where_fsync || !ours(fd)) return 0;
    if (tripped) { calls_after++; return 1; }
    if (written > after) { tripped++; return 1; }
    return 0;
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "fsync");
    if (sync_fails(fd)) { errno = err; return -1; }
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "fdatasync");
    if (sync_fails(fd)) { errno = err; return -1; }
    return real(fd);
}
