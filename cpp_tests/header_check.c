/* glake.h alone compiles as strict C99 with every warning an error. */
#include <glake.h>

int glake_header_check(void);
int glake_header_check(void) {
  glake_config config;
  glake_stats stats;
  (void)config;
  (void)stats;
  return GLAKE_STATUS_SUCCESS + (int)GLAKE_BACKEND_HOST + (int)GLAKE_CALL_MAP;
}
