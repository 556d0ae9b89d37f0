/* A snapshot of segments, blocks and stitched ranges, as JSON. */
#include "example.h"

int main(void) {
  glake_pool *pool = example_pool();
  void *p[4];
  char *json = NULL;
  int i;

  for (i = 0; i < 4; i++) CHECK(glake_malloc(pool, (size_t)(i + 1) * 3 * MIB, NULL, &p[i]));
  CHECK(glake_free(pool, p[1]));
  CHECK(glake_snapshot_json(pool, &json));
  printf("%s\n", json);
  glake_string_free(json);
  CHECK(glake_stats_json(pool, &json));
  printf("%s\n", json);
  glake_string_free(json);
  for (i = 0; i < 4; i++)
    if (i != 1) CHECK(glake_free(pool, p[i]));
  CHECK(glake_pool_destroy(pool));
  return 0;
}
