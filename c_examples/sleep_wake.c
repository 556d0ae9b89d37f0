/* Sleep and wake a region of weight-like buffers: sleep gives their device memory back with
 * every address kept, wake restores the same bytes at the same addresses. Prints the memory
 * given back and the speed of both; GLAKE_EXAMPLE_SLEEP_MIB sets the region's size and
 * GLAKE_EXAMPLE_SLEEP_CYCLES the number of sleep/wake cycles (2), after which every byte is
 * compared. */
#define _POSIX_C_SOURCE 199309L
#include <string.h>
#include <time.h>

#include "example.h"

#define BUFFERS 8

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void fill(unsigned char *bytes, size_t n, unsigned seed) {
  size_t i;
  for (i = 0; i < n; i++) bytes[i] = (unsigned char)((i * 2654435761u + seed) >> 7);
}

int main(void) {
  glake_pool *pool = example_pool();
  const char *env = getenv("GLAKE_EXAMPLE_SLEEP_MIB");
  size_t total = (env != NULL ? (size_t)strtoull(env, NULL, 10) : 512) * MIB;
  size_t each = total / BUFFERS, i;
  void *buffers[BUFFERS];
  unsigned char *host = malloc(each), *back = malloc(each);
  glake_stats stats;
  glake_region_info info;
  long long awake;
  double t0, slept, woke;
  int failed = 0, cycle;
  const char *cycles_env = getenv("GLAKE_EXAMPLE_SLEEP_CYCLES");
  int cycles = cycles_env != NULL ? atoi(cycles_env) : 2;
  double slowest_sleep = 0, slowest_wake = 0;

  if (host == NULL || back == NULL || each == 0) return 1;
  CHECK(glake_region_begin(pool, "weights"));
  for (i = 0; i < BUFFERS; i++) CHECK(glake_malloc(pool, each, NULL, &buffers[i]));
  CHECK(glake_region_end(pool));
  for (i = 0; i < BUFFERS; i++) {
    fill(host, each, (unsigned)i);
    CHECK(glake_copy_to_device(pool, buffers[i], host, each, NULL));
    CHECK(glake_stream_synchronize(pool, NULL));
  }
  CHECK(glake_get_stats(pool, &stats));
  awake = (long long)stats.reserved_bytes.all.current;
  /* Pinning host memory runs at a few GB/s: made ahead, the first sleep runs at the link's
     speed (GLAKE_EXAMPLE_NO_PREPARE=1 leaves it to the first sleep). */
  if (getenv("GLAKE_EXAMPLE_NO_PREPARE") == NULL) {
    size_t made = 0;
    t0 = now();
    CHECK(glake_sleep_prepare(pool, "weights", &made));
    printf("prepare: %.3f s, %zu bytes of host memory made\n", now() - t0, made);
  }
  if (cycles < 1) cycles = 1;
  for (cycle = 0; cycle < cycles; cycle++) {
    t0 = now();
    CHECK(glake_sleep(pool, "weights", GLAKE_SLEEP_KEEP));
    slept = now() - t0;
    CHECK(glake_get_stats(pool, &stats));
    CHECK(glake_get_region_info(pool, "weights", &info));
    if (cycle > 0 && slept > slowest_sleep) slowest_sleep = slept;
    if (cycle < 2 || cycle == cycles - 1)
      printf("sleep %d: %.3f s (%.1f GB/s), reserved %lld -> %lld bytes, host copy %llu bytes\n",
           cycle, slept, (double)total / slept / 1e9, awake,
           (long long)stats.reserved_bytes.all.current, (unsigned long long)info.host_bytes);
    if (stats.reserved_bytes.all.current > awake - (long long)total) {
      fprintf(stderr, "sleep kept device memory\n");
      failed = 1;
    }
    t0 = now();
    CHECK(glake_wake(pool, "weights"));
    woke = now() - t0;
    if (cycle > 0 && woke > slowest_wake) slowest_wake = woke;
    if (cycle < 2 || cycle == cycles - 1)
      printf("wake %d: %.3f s (%.1f GB/s)\n", cycle, woke, (double)total / woke / 1e9);
  }
  if (cycles > 2)
    printf("%d cycles; after the first, the slowest sleep %.1f GB/s, the slowest wake %.1f GB/s\n",
           cycles, (double)total / slowest_sleep / 1e9, (double)total / slowest_wake / 1e9);
  for (i = 0; i < BUFFERS; i++) {
    fill(host, each, (unsigned)i);
    CHECK(glake_copy_to_host(pool, back, buffers[i], each, NULL));
    CHECK(glake_stream_synchronize(pool, NULL));
    if (memcmp(host, back, each) != 0) {
      fprintf(stderr, "buffer %zu differs after wake\n", i);
      failed = 1;
    }
  }
  for (i = 0; i < BUFFERS; i++) CHECK(glake_free(pool, buffers[i]));
  CHECK(glake_pool_destroy(pool));
  free(host);
  free(back);
  if (!failed) printf("every byte back at the same address\n");
  return failed;
}
