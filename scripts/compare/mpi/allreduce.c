/* The reference of scripts/compare/mpi-compare.sh: MPI_Allreduce (f32 sum, in place) timed the way
 * `nodetour perf` times its allreduce: back to back, each collective timed alone on rank 0,
 * the median of the timed iterations after warm-ups. Every result is checked.
 *   allreduce SIZES_BYTES... (each a multiple of 4)   env ITERS (default 50), WARMUP (5) */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    int iters = getenv("ITERS") ? atoi(getenv("ITERS")) : 50;
    int warmup = getenv("WARMUP") ? atoi(getenv("WARMUP")) : 5;
    if (iters < 1) iters = 1;
    double *t = malloc(sizeof(double) * (size_t)iters);
    int bad = 0;
    for (int a = 1; a < argc; a++) {
        size_t bytes = strtoull(argv[a], NULL, 10), count = bytes / 4;
        float *in = malloc(count * 4 + 4), *data = malloc(count * 4 + 4);
        for (size_t i = 0; i < count; i++) in[i] = (float)(rank + 1) + (float)(i % 7);
        for (int k = 0; k < warmup + iters; k++) {
            memcpy(data, in, count * 4);
            double s = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, data, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            if (k >= warmup) t[k - warmup] = MPI_Wtime() - s;
        }
        /* sum over ranks of (r + 1) + i % 7: exact in f32 for these magnitudes */
        for (size_t i = 0; i < count; i++) {
            float want = (float)(world * (world + 1) / 2) + (float)world * (float)(i % 7);
            if (data[i] != want) { bad = 1; break; }
        }
        qsort(t, (size_t)iters, sizeof(double), cmp);
        if (rank == 0) printf("MPI_ROW bytes=%zu us=%.2f check=%s\n", bytes, t[iters / 2] * 1e6, bad ? "wrong" : "ok");
        fflush(stdout);
        free(in);
        free(data);
    }
    free(t);
    MPI_Finalize();
    return bad;
}
