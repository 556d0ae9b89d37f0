/* Copy a large pageable buffer to the device and back through the copy engine, and compare
 * with the pool's plain copy call (the driver's own path). */
#include <string.h>
#include <time.h>

#include "example.h"

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(void) {
  const size_t len = 64 * MIB + 3;
  glake_pool *pool = example_pool();
  glake_transfer *transfer = NULL;
  glake_transfer_stats stats;
  uint32_t backend = 0;
  unsigned char *src = malloc(len), *back = malloc(len);
  void *dst = NULL;
  double start, engine, driver;
  size_t i;

  if (src == NULL || back == NULL) return 1;
  for (i = 0; i < len; i++) src[i] = (unsigned char)(i * 31 + 7);
  memset(back, 0, len);
  CHECK(glake_pool_backend(pool, &backend));
  CHECK(glake_transfer_create(backend, 0, GLAKE_TRANSFER_READ_ENV, &transfer));
  CHECK(glake_malloc(pool, len, NULL, &dst));

  start = seconds();
  CHECK(glake_memcpy_htod(transfer, dst, src, len, NULL, 0));
  engine = seconds() - start;
  CHECK(glake_memcpy_dtoh(transfer, back, dst, len, NULL, 0));
  if (memcmp(src, back, len) != 0) {
    fprintf(stderr, "bytes did not survive the round trip\n");
    return 1;
  }
  start = seconds();
  CHECK(glake_copy_to_device(pool, dst, src, len, NULL));
  CHECK(glake_stream_synchronize(pool, NULL));
  driver = seconds() - start;
  CHECK(glake_transfer_get_stats(transfer, &stats));
  printf("64 MiB pageable to the device: engine %.2f GB/s (%u paths), driver %.2f GB/s\n",
         (double)len / engine / 1e9, stats.paths, (double)len / driver / 1e9);
  CHECK(glake_free(pool, dst));
  CHECK(glake_transfer_destroy(transfer));
  CHECK(glake_pool_destroy(pool));
  free(src);
  free(back);
  return stats.engine_bytes == 2 * (uint64_t)len ? 0 : 1;
}
