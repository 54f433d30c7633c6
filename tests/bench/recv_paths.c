// Receive paths into memory files, measured apart from the daemon: a sender thread on CPU 0 sends 2 GiB
// over loopback TCP in 1 MiB sends; the receiver on CPU 1 lands them one way, and prints its own CPU
// seconds per GB (user + system, this thread) and its wall time per GB.
//
//   gcc -O2 -o /tmp/recv_paths tests/bench/recv_paths.c -lpthread
//   mount -t tmpfs -o huge=within_size,size=4G none /tmp/huge      # for the modes 5 and 6
//   for m in 0 1 2 3 4 5 6 7 8; do /tmp/recv_paths $m /tmp/huge; done
//
// Modes: 0 recv into one 1 MiB buffer (the floor's receive); 1 recv into a buffer, pwrite into fresh
// memfds (4 KiB pages); 2 recv straight into a mapping of memfds already populated (a recycled pool);
// 3 recv straight into mappings of fresh memfds (each page faulted and zeroed); 4 recv into a buffer,
// pwrite into the recycled memfds; 5 recv into a buffer, pwrite of each 2 MiB into fresh files of a
// huge-page tmpfs (the mount daemon's way); 6 recv straight into mappings of populated files of that tmpfs;
// 7 and 8 the same as 6, received as the daemon reads HTTP/2 frames: each frame's 9-byte head alone, then
// its payload (110,000 bytes, a sample of the benchmarks' mean, and 1 MiB) straight into the mapping.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define TOTAL (2UL << 30)
#define FILE_BYTES (64UL << 20)
#define POOL 8
#define MIB (1UL << 20)

static int port;
static const char *huge_dir = "/tmp/huge";

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *sender(void *unused) {
    (void)unused;
    pin(0);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(0x7f000001);
    if (connect(fd, (void *)&sa, sizeof sa)) { perror("connect"); exit(1); }
    char *buf = malloc(MIB);
    memset(buf, 7, MIB);
    for (size_t sent = 0; sent < TOTAL;) {
        ssize_t n = send(fd, buf, MIB < TOTAL - sent ? MIB : TOTAL - sent, 0);
        if (n <= 0) { perror("send"); exit(1); }
        sent += n;
    }
    close(fd);
    return NULL;
}

static double thread_cpu(void) {
    struct rusage r;
    getrusage(RUSAGE_THREAD, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

// A file of the huge-page tmpfs, unlinked at once.
static int huge_file(void) {
    static int n;
    char path[4096];
    snprintf(path, sizeof path, "%s/recv-paths-%d-%d", huge_dir, getpid(), n++);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) { perror(path); exit(1); }
    unlink(path);
    return fd;
}

// Fills `want` bytes of `buf` from the socket (fewer only at its end).
static ssize_t fill(int fd, char *buf, size_t want) {
    size_t got = 0;
    while (got < want) {
        ssize_t n = recv(fd, buf + got, want - got, 0);
        if (n <= 0) break;
        got += n;
    }
    return got;
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s MODE [HUGE_TMPFS_DIR]\n", argv[0]); return 2; }
    int mode = atoi(argv[1]);
    if (argc > 2) huge_dir = argv[2];
    pin(1);
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(0x7f000001);
    socklen_t len = sizeof sa;
    bind(ls, (void *)&sa, sizeof sa);
    getsockname(ls, (void *)&sa, &len);
    port = ntohs(sa.sin_port);
    listen(ls, 1);
    char *maps[POOL];
    int fds[POOL];
    if (mode == 2 || mode == 4 || mode >= 6) {
        for (int i = 0; i < POOL; i++) {
            fds[i] = mode == 6 ? huge_file() : memfd_create("pool", 0);
            if (ftruncate(fds[i], FILE_BYTES)) { perror("ftruncate"); return 1; }
            maps[i] = mmap(NULL, FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fds[i], 0);
            if (maps[i] == MAP_FAILED) { perror("mmap"); return 1; }
            memset(maps[i], 1, FILE_BYTES);
        }
    }
    pthread_t t;
    pthread_create(&t, NULL, sender, NULL);
    int fd = accept(ls, NULL, NULL);
    char *buf = malloc(2 * MIB);
    double c0 = thread_cpu();
    struct timespec w0, w1;
    clock_gettime(CLOCK_MONOTONIC, &w0);
    size_t got = 0, off = FILE_BYTES;
    int file = -1, mfd = -1;
    char *map = NULL;
    while (got < TOTAL) {
        ssize_t n = 0;
        size_t room = FILE_BYTES - off < MIB ? FILE_BYTES - off : MIB;
        if (off >= FILE_BYTES) {
            // The next file: fresh or recycled, as the mode says.
            if (mode == 1 || mode == 5) {
                if (mfd >= 0) close(mfd);
                mfd = mode == 5 ? huge_file() : memfd_create("f", 0);
            } else if (mode == 3) {
                if (map) { munmap(map, FILE_BYTES); close(mfd); }
                mfd = memfd_create("f", 0);
                if (ftruncate(mfd, FILE_BYTES)) { perror("ftruncate"); return 1; }
                map = mmap(NULL, FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
            } else if (mode == 2 || mode == 4 || mode >= 6) {
                file = (file + 1) % POOL;
            }
            off = 0;
            room = MIB;
        }
        switch (mode) {
        case 0: n = recv(fd, buf, MIB, 0); break;
        case 1: case 4: n = fill(fd, buf, MIB); if (n > 0) pwrite(mode == 1 ? mfd : fds[file], buf, n, off); break;
        case 5: n = fill(fd, buf, 2 * MIB); if (n > 0) pwrite(mfd, buf, n, off); break;
        case 2: case 6: n = recv(fd, maps[file] + off, room, 0); break;
        case 3: n = recv(fd, map + off, room, 0); break;
        case 7: case 8: {
            char head[9];
            size_t frame = mode == 7 ? 110000 : MIB;
            if (fill(fd, head, sizeof head) != sizeof head) break;
            n = fill(fd, maps[file] + off, frame < room ? frame : room);
            break;
        }
        default: fprintf(stderr, "no mode %d\n", mode); return 2;
        }
        if (n <= 0) break;
        off += n;
        got += n;
    }
    double c1 = thread_cpu();
    clock_gettime(CLOCK_MONOTONIC, &w1);
    double gb = got / 1e9, wall = (w1.tv_sec - w0.tv_sec) + (w1.tv_nsec - w0.tv_nsec) / 1e9;
    printf("mode %d: %.3f CPU s/GB, wall %.3f s/GB\n", mode, (c1 - c0) / gb, wall / gb);
    pthread_join(t, NULL);
    return 0;
}
