// Misuse: every mistake is an error status with a message, never a crash.
#include "common.hpp"

namespace {

TEST(Misuse, NullArguments) {
  glake_pool* pool = make_pool();
  EXPECT_EQ(glake_malloc(pool, 64, nullptr, nullptr), GLAKE_STATUS_NULL_POINTER);
  EXPECT_NE(last_message().find("out is NULL"), std::string::npos);
  EXPECT_EQ(glake_record_stream(pool, nullptr, nullptr), GLAKE_STATUS_NULL_POINTER);
  EXPECT_EQ(glake_get_stats(pool, nullptr), GLAKE_STATUS_NULL_POINTER);
  EXPECT_EQ(glake_snapshot_json(pool, nullptr), GLAKE_STATUS_NULL_POINTER);
  EXPECT_EQ(glake_config_default(nullptr), GLAKE_STATUS_NULL_POINTER);
  glake_pool* out = nullptr;
  EXPECT_EQ(glake_pool_create(nullptr, &out), GLAKE_STATUS_NULL_POINTER);
  EXPECT_EQ(glake_empty_cache(nullptr), GLAKE_STATUS_NULL_POINTER);
  glake_string_free(nullptr);
  EXPECT_EQ(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
}

TEST(Misuse, BadPointersAndSizes) {
  glake_pool* pool = make_pool();
  void* p = nullptr;
  EXPECT_EQ(glake_malloc(pool, 0, nullptr, &p), GLAKE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(glake_malloc(pool, SIZE_MAX, nullptr, &p), GLAKE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(glake_malloc(pool, std::size_t(1) << 50, nullptr, &p), GLAKE_STATUS_OUT_OF_MEMORY);
  EXPECT_NE(last_message().find("larger than the device"), std::string::npos);
  ASSERT_EQ(glake_malloc(pool, 8 * MiB, nullptr, &p), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(glake_free(pool, static_cast<char*>(p) + 4096), GLAKE_STATUS_INVALID_POINTER);
  EXPECT_NE(last_message().find("inside memory of this pool"), std::string::npos);
  int stack_value = 0;
  EXPECT_EQ(glake_free(pool, &stack_value), GLAKE_STATUS_INVALID_POINTER);
  EXPECT_NE(last_message().find("not allocated by this pool"), std::string::npos);
  EXPECT_EQ(glake_free(pool, p), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(glake_free(pool, p), GLAKE_STATUS_DOUBLE_FREE);
  EXPECT_EQ(glake_record_stream(pool, p, nullptr), GLAKE_STATUS_DOUBLE_FREE);
  EXPECT_EQ(glake_set_memory_fraction(pool, -1.0), GLAKE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(glake_set_memory_fraction(pool, 2.0), GLAKE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
}

TEST(Misuse, BadConfigs) {
  glake_pool* out = nullptr;
  glake_config config = test_config();
  config.flags = 0x100;
  EXPECT_EQ(glake_pool_create(&config, &out), GLAKE_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(last_message().find("unknown bits"), std::string::npos);
  config = test_config();
  config.struct_size = 8;
  EXPECT_EQ(glake_pool_create(&config, &out), GLAKE_STATUS_INVALID_ARGUMENT);
  config = test_config();
  config.stitch = 7;
  EXPECT_EQ(glake_pool_create(&config, &out), GLAKE_STATUS_INVALID_ARGUMENT);
  config = test_config();
  config.memory_fraction = 0.0;
  EXPECT_EQ(glake_pool_create(&config, &out), GLAKE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
}

TEST(Misuse, UseAfterPoolDestroy) {
  glake_pool* pool = make_pool();
  void* p = nullptr;
  ASSERT_EQ(glake_malloc(pool, 4 * MiB, nullptr, &p), GLAKE_STATUS_SUCCESS);
  // Destroying with a live allocation releases it (with a warning in the log).
  EXPECT_EQ(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(glake_free(pool, p), GLAKE_STATUS_INVALID_HANDLE);
  EXPECT_NE(last_message().find("not a live pool"), std::string::npos);
  EXPECT_EQ(glake_malloc(pool, 64, nullptr, &p), GLAKE_STATUS_INVALID_HANDLE);
  EXPECT_EQ(glake_pool_destroy(pool), GLAKE_STATUS_INVALID_HANDLE);
}

}  // namespace
