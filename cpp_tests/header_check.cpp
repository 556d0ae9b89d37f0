// glake.h alone compiles as strict C++11..20 with every warning an error.
#include <glake.h>

int glake_header_check();
int glake_header_check() {
  glake_config config = glake_config();
  glake_stats stats = glake_stats();
  (void)config;
  (void)stats;
  return static_cast<int>(GLAKE_STATUS_SUCCESS);
}
