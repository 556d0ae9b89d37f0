// Shared test helpers: a config for the backend under test (GPU when usable, else host).
#pragma once
#include <gtest/gtest.h>

#include <cstddef>
#include <string>

#include <glake.h>

constexpr std::size_t MiB = std::size_t(1) << 20;

inline glake_config test_config(uint32_t extra_flags = 0) {
  glake_config config;
  EXPECT_EQ(glake_config_default(&config), GLAKE_STATUS_SUCCESS);
  config.flags = GLAKE_CONFIG_READ_ENV | extra_flags;
  return config;
}

inline glake_pool* make_pool(uint32_t extra_flags = 0) {
  glake_config config = test_config(extra_flags);
  glake_pool* pool = nullptr;
  EXPECT_EQ(glake_pool_create(&config, &pool), GLAKE_STATUS_SUCCESS) << glake_last_error_message();
  return pool;
}

inline std::string last_message() { return glake_last_error_message(); }
