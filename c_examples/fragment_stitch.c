/* Fragment a 1 GiB budget, then ask for more contiguous memory than any hole: the pool
 * stitches free blocks into one range instead of reserving more. Watch the stats. */
#include "example.h"

#define BLOCKS 16

static void print_stats(glake_pool *pool, const char *when) {
  glake_stats s;
  CHECK(glake_get_stats(pool, &s));
  printf("%-28s allocated %5lld MiB  reserved %5lld MiB  stitches %lld  reuse hits %lld\n", when,
         (long long)(s.allocated_bytes.all.current >> 20),
         (long long)(s.reserved_bytes.all.current >> 20), (long long)s.stitches,
         (long long)s.stitch_reuse_hits);
}

int main(void) {
  glake_pool *pool = example_pool();
  void *whole = NULL, *blocks[BLOCKS], *big = NULL;
  glake_stats s;
  int i;
  size_t budget = 1024 * MIB;
  uint64_t total = 0;

  /* Take 1 GiB as one segment, then cap the pool there: it may not grow any more. */
  CHECK(glake_malloc(pool, budget, NULL, &whole));
  CHECK(glake_free(pool, whole));
  CHECK(glake_get_stats(pool, &s));
  total = (uint64_t)s.reserved_bytes.all.current;
  CHECK(glake_set_memory_fraction(pool, 1e-9));
  for (i = 0; i < BLOCKS; i++) CHECK(glake_malloc(pool, 64 * MIB, NULL, &blocks[i]));
  for (i = 0; i < BLOCKS; i += 2) CHECK(glake_free(pool, blocks[i]));
  print_stats(pool, "after freeing every other:");

  CHECK(glake_malloc(pool, 256 * MIB, NULL, &big));
  print_stats(pool, "after a 256 MiB request:");
  CHECK(glake_get_stats(pool, &s));
  if (s.stitches != 1 || (uint64_t)s.reserved_bytes.all.current != total) {
    fprintf(stderr, "expected one stitch and no growth\n");
    return 1;
  }
  CHECK(glake_free(pool, big));
  CHECK(glake_malloc(pool, 256 * MIB, NULL, &big));
  print_stats(pool, "same request again:");
  CHECK(glake_free(pool, big));
  for (i = 1; i < BLOCKS; i += 2) CHECK(glake_free(pool, blocks[i]));
  CHECK(glake_pool_destroy(pool));
  return 0;
}
