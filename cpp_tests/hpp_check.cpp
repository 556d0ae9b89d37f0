// glake.hpp compiles as strict C++17 and C++20 with every warning an error.
#include <glake.hpp>

int glake_hpp_check();
int glake_hpp_check() {
  glake::Config config;
  config.host();
  return static_cast<int>(config.backend);
}
