// API contract: every status code can be reached, and each comes with its message.
#include <set>

#include "common.hpp"

namespace {

std::set<glake_status> seen;

glake_status note(glake_status status) {
  seen.insert(status);
  return status;
}

TEST(Contract, EveryStatusCodeIsReachable) {
  glake_pool* pool = make_pool(GLAKE_CONFIG_FAULT_INJECTION);
  ASSERT_NE(pool, nullptr);
  void* p = nullptr;

  EXPECT_EQ(note(glake_malloc(pool, 4 * MiB, nullptr, &p)), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(last_message(), "");
  EXPECT_EQ(note(glake_malloc(pool, 0, nullptr, &p)), GLAKE_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(last_message().find("size 0"), std::string::npos);
  EXPECT_EQ(note(glake_free(pool, nullptr)), GLAKE_STATUS_NULL_POINTER);
  int local = 0;
  EXPECT_EQ(note(glake_free(pool, &local)), GLAKE_STATUS_INVALID_POINTER);
  EXPECT_EQ(glake_free(pool, p), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(note(glake_free(pool, p)), GLAKE_STATUS_DOUBLE_FREE);
  EXPECT_NE(last_message().find("double free"), std::string::npos);

  // Out of memory: a cap far below the request; the pool keeps working afterwards.
  EXPECT_EQ(glake_set_memory_fraction(pool, 1e-6), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(note(glake_malloc(pool, 512 * MiB, nullptr, &p)), GLAKE_STATUS_OUT_OF_MEMORY);
  EXPECT_EQ(glake_set_memory_fraction(pool, 1.0), GLAKE_STATUS_SUCCESS);

  // Driver-level failures, injected at the next physical-memory creation.
  const struct {
    glake_status status;
  } injected[] = {{GLAKE_STATUS_DRIVER_ERROR}, {GLAKE_STATUS_UNSUPPORTED},
                  {GLAKE_STATUS_RESOURCE_LIMIT}, {GLAKE_STATUS_INTERNAL},
                  {GLAKE_STATUS_PANIC}};
  for (const auto& item : injected) {
    ASSERT_EQ(glake_empty_cache(pool), GLAKE_STATUS_SUCCESS);
    ASSERT_EQ(glake_pool_inject_fault(pool, GLAKE_CALL_CREATE_PHYSICAL, 1, item.status),
              GLAKE_STATUS_SUCCESS);
    EXPECT_EQ(note(glake_malloc(pool, 64 * MiB, nullptr, &p)), item.status) << last_message();
    EXPECT_FALSE(last_message().empty());
    // The pool still answers afterwards.
    glake_stats stats;
    EXPECT_EQ(glake_get_stats(pool, &stats), GLAKE_STATUS_SUCCESS);
  }
  ASSERT_EQ(glake_malloc(pool, 64 * MiB, nullptr, &p), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(glake_free(pool, p), GLAKE_STATUS_SUCCESS);

  // Injection needs a pool made for it.
  glake_pool* plain = make_pool();
  EXPECT_EQ(note(glake_pool_inject_fault(plain, GLAKE_CALL_MAP, 1, GLAKE_STATUS_DRIVER_ERROR)),
            GLAKE_STATUS_INVALID_STATE);
  EXPECT_EQ(glake_pool_destroy(plain), GLAKE_STATUS_SUCCESS);

  glake_config config = test_config();
  config.device = 99;
  glake_pool* none = nullptr;
  EXPECT_EQ(note(glake_pool_create(&config, &none)), GLAKE_STATUS_NO_DEVICE);

  EXPECT_EQ(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(note(glake_empty_cache(pool)), GLAKE_STATUS_INVALID_HANDLE);

  for (uint32_t s = GLAKE_STATUS_SUCCESS; s <= GLAKE_STATUS_INTERNAL; ++s) {
    EXPECT_TRUE(seen.count(static_cast<glake_status>(s))) << glake_status_name(s) << " not reached";
  }
}

TEST(Contract, StatsFollowAllocations) {
  glake_pool* pool = make_pool();
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_EQ(glake_malloc(pool, 3 * MiB + 1, nullptr, &a), GLAKE_STATUS_SUCCESS);
  ASSERT_EQ(glake_malloc(pool, 100, nullptr, &b), GLAKE_STATUS_SUCCESS);
  glake_stats s;
  ASSERT_EQ(glake_get_stats(pool, &s), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(s.allocation.all.current, 2);
  EXPECT_EQ(s.allocation.large_pool.current, 1);
  EXPECT_EQ(s.allocation.small_pool.current, 1);
  EXPECT_EQ(s.requested_bytes.all.current, static_cast<int64_t>(3 * MiB + 1 + 100));
  EXPECT_GE(s.reserved_bytes.all.current, s.allocated_bytes.all.current);
  EXPECT_EQ(glake_free(pool, a), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(glake_free(pool, b), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(glake_reset_peak_stats(pool), GLAKE_STATUS_SUCCESS);
  ASSERT_EQ(glake_get_stats(pool, &s), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(s.allocated_bytes.all.peak, 0);
  char* json = nullptr;
  ASSERT_EQ(glake_stats_json(pool, &json), GLAKE_STATUS_SUCCESS);
  EXPECT_NE(std::string(json).find("\"num_ooms\":0"), std::string::npos);
  glake_string_free(json);
  EXPECT_EQ(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
}

}  // namespace
