/* Allocate, write, read back and free; then print what the pool holds. */
#include <string.h>

#include "example.h"

int main(void) {
  glake_pool *pool = example_pool();
  void *small = NULL, *large = NULL;
  char hello[] = "hello from glake";
  char back[sizeof hello];
  glake_stats stats;

  CHECK(glake_malloc(pool, 1000, NULL, &small));
  CHECK(glake_malloc(pool, 100 * MIB, NULL, &large));
  CHECK(glake_copy_to_device(pool, large, hello, sizeof hello, NULL));
  CHECK(glake_copy_to_host(pool, back, large, sizeof back, NULL));
  CHECK(glake_stream_synchronize(pool, NULL));
  if (memcmp(hello, back, sizeof hello) != 0) {
    fprintf(stderr, "bytes did not survive the round trip\n");
    return 1;
  }
  CHECK(glake_get_stats(pool, &stats));
  printf("allocated %lld bytes in %lld allocations; reserved %lld bytes\n",
         (long long)stats.allocated_bytes.all.current, (long long)stats.allocation.all.current,
         (long long)stats.reserved_bytes.all.current);
  CHECK(glake_free(pool, small));
  CHECK(glake_free(pool, large));
  CHECK(glake_empty_cache(pool));
  CHECK(glake_get_stats(pool, &stats));
  printf("after free and empty_cache: reserved %lld bytes\n",
         (long long)stats.reserved_bytes.all.current);
  CHECK(glake_pool_destroy(pool));
  return stats.reserved_bytes.all.current == 0 ? 0 : 1;
}
