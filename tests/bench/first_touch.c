// Pages touched for the first time against pages reused, on a huge-page tmpfs: the cost a memory file
// pays when its pages are new to it. Each round writes a file of MB megabytes in 2 MiB writes (whole huge
// pages: the kernel zeroes nothing first), writes it again in place, then deletes it and waits PAUSE
// seconds. On a VM whose balloon driver reports free pages to the host (virtio-balloon's free page
// reporting: `dmesg | grep "Free page reporting"`), pages freed and left alone for a moment go back to
// the host, and the next first touch of them faults in the host: the fresh write then runs at a fraction
// of the rewrite's rate. With PAUSE 0 the pages just freed are taken again at once.
//
//   gcc -O2 -o /tmp/first_touch tests/bench/first_touch.c
//   mkdir -p /tmp/huge && mount -t tmpfs -o huge=always,size=4G none /tmp/huge
//   /tmp/first_touch /tmp/huge 1024 0; /tmp/first_touch /tmp/huge 1024 3; umount /tmp/huge
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define SPAN (2UL << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

// Writes `bytes` of `src` to `fd` from its start in whole spans; exits on a short write.
static void fill(int fd, const char *src, size_t bytes) {
    if (lseek(fd, 0, SEEK_SET) != 0) {
        perror("lseek");
        exit(1);
    }
    for (size_t at = 0; at < bytes; at += SPAN) {
        if (write(fd, src, SPAN) != (ssize_t)SPAN) {
            perror("write");
            exit(1);
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s HUGE_TMPFS_DIR MB PAUSE_SECONDS\n", argv[0]);
        return 2;
    }
    size_t bytes = ((size_t)atol(argv[2]) << 20) / SPAN * SPAN;
    int pause = atoi(argv[3]);
    char path[4096];
    snprintf(path, sizeof path, "%s/first_touch", argv[1]);
    char *src = aligned_alloc(4096, SPAN);
    memset(src, 7, SPAN);
    printf("round,fresh_gb_s,rewrite_gb_s\n");
    for (int round = 0; round < 4; round++) {
        int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
        if (fd < 0) {
            perror(path);
            return 1;
        }
        double t0 = now();
        fill(fd, src, bytes);
        double t1 = now();
        fill(fd, src, bytes);
        double t2 = now();
        printf("%d,%.2f,%.2f\n", round, bytes / 1e9 / (t1 - t0), bytes / 1e9 / (t2 - t1));
        close(fd);
        unlink(path);
        if (pause > 0) {
            sleep(pause);
        }
    }
    free(src);
    return 0;
}
