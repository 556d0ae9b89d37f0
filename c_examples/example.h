/* Small helpers shared by the examples: fail loudly with the library's message. */
#ifndef GLAKE_EXAMPLE_H
#define GLAKE_EXAMPLE_H
#include <stdio.h>
#include <stdlib.h>

#include <glake.h>

#define CHECK(call)                                                                   \
  do {                                                                                \
    glake_status status_ = (call);                                                    \
    if (status_ != GLAKE_STATUS_SUCCESS) {                                            \
      fprintf(stderr, "%s:%d: %s failed: %s: %s\n", __FILE__, __LINE__, #call,        \
              glake_status_name(status_), glake_last_error_message());                \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

/* A pool on the GPU when one is usable, else on the host backend; GLAKE_* and GMLake's
 * environment variables apply. */
static glake_pool *example_pool(void) {
  glake_config config;
  glake_pool *pool = NULL;
  uint32_t backend = 0;
  CHECK(glake_init());
  CHECK(glake_config_default(&config));
  config.flags = GLAKE_CONFIG_READ_ENV;
  CHECK(glake_pool_create(&config, &pool));
  CHECK(glake_pool_backend(pool, &backend));
  printf("glake %s, %s backend\n", glake_version(), backend == GLAKE_BACKEND_CUDA ? "cuda" : "host");
  return pool;
}

#define MIB ((size_t)1 << 20)
#endif
