/*
 * bench_crc32c.c - throughput of the CRC-32C versions on extent-sized
 * buffers: the cost of verifying reads (docs/STORAGE.md).
 *
 * Prints a header line and one tab-separated row per (version, size), the
 * median of 5 timed repetitions after a warm-up.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>

#include "bench_common.h"
#include "nflash/crc32c.h"

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
	nf_bench_args(argc, argv,
		"usage: bench_crc32c\n"
		"\n"
		"Throughput of the CRC-32C versions on extent-sized buffers (4 KiB to\n"
		"1 MiB): the cost of verifying reads (docs/STORAGE.md).\n",
		NULL, 0);
	static const size_t sizes[] = { 4096, 8192, 131072, 1 << 20 };
	const size_t total = 256u << 20;   /* bytes checksummed per repetition */
	uint8_t *buf = malloc(1 << 20);
	if (!buf)
		return 1;
	for (size_t i = 0; i < (1 << 20); i++)
		buf[i] = (uint8_t)(i * 131 + 7);
	struct utsname u;
	uname(&u);
	printf("# bench_crc32c: %s %s, crc32c instructions %s, 256 MiB per repetition, median of 5\n", u.nodename,
	       u.release, nf_crc32c_hw_available() ? "yes" : "no");
	printf("version\tbuffer_B\tGB_per_s\tus_per_128KiB_extent\n");
	for (int v = 0; v < 2; v++) {
		if (v == 0 && !nf_crc32c_hw_available())
			continue;
		uint32_t (*f)(uint32_t, const void *, size_t) = v == 0 ? nf_crc32c_hw : nf_crc32c_sw;
		for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
			size_t n = sizes[k], reps = total / n / (v ? 8 : 1);
			double t[5];
			volatile uint32_t sink = f(0, buf, n);
			for (int r = 0; r < 5; r++) {
				double t0 = now();
				for (size_t i = 0; i < reps; i++)
					sink += f(0, buf, n);
				t[r] = now() - t0;
			}
			(void)sink;
			qsort(t, 5, sizeof(double), cmp_d);
			double gbs = (double)reps * n / t[2] / 1e9;
			printf("%s\t%zu\t%.2f\t%.1f\n", v == 0 ? "hardware" : "table", n, gbs,
			       131072 / gbs / 1e3);
		}
	}
	free(buf);
	return 0;
}
