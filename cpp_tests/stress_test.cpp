// Many threads allocating, writing, checking and freeing on one pool at once.
#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "common.hpp"

namespace {

TEST(Stress, ThreadsShareOnePool) {
  glake_pool* pool = make_pool();
  constexpr int kThreads = 8;
  constexpr int kOps = 1500;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1234 + t);
      glake_stream stream = nullptr;
      if (glake_stream_create(pool, &stream) != GLAKE_STATUS_SUCCESS) {
        ++failures;
        return;
      }
      struct Live {
        void* ptr;
        uint64_t tag;
      };
      std::vector<Live> live;
      for (int i = 0; i < kOps; ++i) {
        bool grow = live.empty() || (rng() % 100) < 55;
        if (grow && live.size() < 64) {
          std::size_t size = (rng() % 4 == 0) ? (1 + rng() % (24 * MiB)) : (1 + rng() % 8192);
          void* p = nullptr;
          if (glake_malloc(pool, size, stream, &p) != GLAKE_STATUS_SUCCESS) {
            ++failures;
            continue;
          }
          uint64_t tag = rng();
          glake_copy_to_device(pool, p, &tag, sizeof tag < size ? sizeof tag : size, stream);
          live.push_back({p, size >= sizeof tag ? tag : 0});
        } else {
          std::size_t index = rng() % live.size();
          Live item = live[index];
          live[index] = live.back();
          live.pop_back();
          if (item.tag != 0) {
            uint64_t back = 0;
            glake_copy_to_host(pool, &back, item.ptr, sizeof back, stream);
            glake_stream_synchronize(pool, stream);
            if (back != item.tag) ++failures;
          }
          if (glake_free(pool, item.ptr) != GLAKE_STATUS_SUCCESS) ++failures;
        }
      }
      for (auto& item : live)
        if (glake_free(pool, item.ptr) != GLAKE_STATUS_SUCCESS) ++failures;
      glake_stream_synchronize(pool, stream);
      glake_stream_destroy(pool, stream);
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  glake_stats s;
  ASSERT_EQ(glake_get_stats(pool, &s), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(s.allocation.all.current, 0);
  EXPECT_EQ(s.allocated_bytes.all.current, 0);
  EXPECT_EQ(s.requested_bytes.all.current, 0);
  EXPECT_EQ(glake_empty_cache(pool), GLAKE_STATUS_SUCCESS);
  ASSERT_EQ(glake_get_stats(pool, &s), GLAKE_STATUS_SUCCESS);
  EXPECT_EQ(s.reserved_bytes.all.current, 0);
  EXPECT_EQ(glake_pool_destroy(pool), GLAKE_STATUS_SUCCESS);
}

}  // namespace
