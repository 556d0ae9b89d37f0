/* Stream-ordered reuse: memory freed on one stream is reused there at once; memory also used on
 * a second stream (record_stream) is reused only after that stream's work is done. */
#include "example.h"

int main(void) {
  glake_pool *pool = example_pool();
  glake_stream s1 = NULL, s2 = NULL;
  void *a = NULL, *b = NULL, *c = NULL;
  static char data[4096];

  CHECK(glake_stream_create(pool, &s1));
  CHECK(glake_stream_create(pool, &s2));

  CHECK(glake_malloc(pool, 8 * MIB, s1, &a));
  CHECK(glake_free(pool, a));
  CHECK(glake_malloc(pool, 8 * MIB, s1, &b));
  printf("freed and reallocated on s1: %s\n", a == b ? "same block, at once" : "different block");

  /* b is written on s2 too: tell the pool, then free it. */
  CHECK(glake_copy_to_device(pool, b, data, sizeof data, s2));
  CHECK(glake_record_stream(pool, b, s2));
  CHECK(glake_free(pool, b));
  CHECK(glake_stream_synchronize(pool, s2));
  CHECK(glake_malloc(pool, 8 * MIB, s1, &c));
  printf("after s2 finished, reused on s1: %s\n", b == c ? "yes" : "no (still pending)");

  CHECK(glake_free(pool, c));
  CHECK(glake_stream_destroy(pool, s1));
  CHECK(glake_stream_destroy(pool, s2));
  CHECK(glake_pool_destroy(pool));
  return 0;
}
