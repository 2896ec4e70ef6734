/*
 * The floor under any request over a Unix socket on this machine: PAIRS
 * pairs of processes exchange ROUNDS 300-byte messages over socketpair(2),
 * and the program prints round trips per second and the CPU (user + system)
 * each round trip cost, both sides together. Used in docs/BENCHMARKS.md.
 *
 *   cc -O2 scripts/socket-pingpong.c -o /tmp/socket-pingpong
 *   /tmp/socket-pingpong 200000 1 && /tmp/socket-pingpong 50000 8
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double seconds(struct timeval t) { return t.tv_sec + t.tv_usec / 1e6; }

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s ROUNDS PAIRS\n", argv[0]);
        return 64;
    }
    int rounds = atoi(argv[1]), pairs = atoi(argv[2]);
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int p = 0; p < pairs; p++) {
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) { perror("socketpair"); return 1; }
        if (fork() == 0) {  /* server: answers each message */
            char buffer[512];
            close(sv[0]);
            for (int i = 0; i < rounds; i++) {
                if (read(sv[1], buffer, sizeof buffer) <= 0) break;
                if (write(sv[1], buffer, 300) != 300) break;
            }
            _exit(0);
        }
        if (fork() == 0) {  /* client: sends, waits for the answer */
            char buffer[512] = {0};
            close(sv[1]);
            for (int i = 0; i < rounds; i++) {
                if (write(sv[0], buffer, 300) != 300) break;
                if (read(sv[0], buffer, sizeof buffer) <= 0) break;
            }
            _exit(0);
        }
        close(sv[0]);
        close(sv[1]);
    }
    while (wait(NULL) > 0) {}
    clock_gettime(CLOCK_MONOTONIC, &end);
    double wall = (end.tv_sec - start.tv_sec) + (end.tv_nsec - start.tv_nsec) / 1e9;
    struct rusage usage;
    getrusage(RUSAGE_CHILDREN, &usage);
    double cpu = seconds(usage.ru_utime) + seconds(usage.ru_stime);
    double total = (double)rounds * pairs;
    printf("pairs %d: %.0f round trips/s, %.1f us CPU per round trip\n", pairs, total / wall, cpu * 1e6 / total);
    return 0;
}
