// The C++ wrappers: RAII ownership, moves, and errors carrying status and message.
#include <glake.hpp>

#include <string>
#include <vector>

#include "common.hpp"

namespace {

glake::Config cpp_config() { return glake::Config().read_env(); }

TEST(Hpp, AllocationsFreeThemselves) {
  glake::Pool pool(cpp_config());
  {
    glake::Allocation a = pool.allocate(5 * MiB);
    EXPECT_TRUE(a);
    EXPECT_EQ(pool.stats().allocation.all.current, 1);
    glake::Allocation b = std::move(a);
    EXPECT_FALSE(a);
    EXPECT_EQ(b.size(), 5 * MiB);
  }
  EXPECT_EQ(pool.stats().allocation.all.current, 0);
}

TEST(Hpp, ErrorsCarryStatusAndMessage) {
  glake::Pool pool(cpp_config());
  try {
    pool.malloc(0);
    FAIL() << "expected an error";
  } catch (const glake::Error& e) {
    EXPECT_EQ(e.status(), GLAKE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(e.message().find("size 0"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("GLAKE_STATUS_INVALID_ARGUMENT"), std::string::npos);
  }
  void* p = pool.malloc(MiB);
  pool.free(p);
  EXPECT_THROW(pool.free(p), glake::Error);
}

TEST(Hpp, StreamsAndCopies) {
  glake::Pool pool(cpp_config());
  glake::Stream stream(pool);
  glake::Allocation a = pool.allocate(2 * MiB, stream);
  const std::string text = "stream-scoped bytes";
  std::string back(text.size(), '\0');
  pool.copy_to_device(a.get(), text.data(), text.size(), stream);
  pool.copy_to_host(back.data(), a.get(), back.size(), stream);
  stream.synchronize();
  EXPECT_EQ(back, text);
  a.record_stream(nullptr);
  a.free();
  EXPECT_FALSE(a);
  EXPECT_NE(pool.snapshot_json().find("\"segments\""), std::string::npos);
}

TEST(Hpp, SwapsWaitingAndStreamOrdered) {
  glake::Pool pool(cpp_config());
  glake::Stream copy(pool);
  void* p = pool.malloc_swappable(4 * MiB);
  const std::string text = "bytes that leave and come back";
  std::string back(text.size(), '\0');
  pool.copy_to_device(p, text.data(), text.size());
  pool.swap_out(p);
  EXPECT_EQ(pool.stats().swapped_bytes.current, static_cast<int64_t>(4 * MiB));
  pool.swap_in(p);
  pool.swap_out_async(p, copy);
  EXPECT_THROW(pool.swap_out_async(p, copy), glake::Error);  // already leaving
  EXPECT_EQ(pool.swap_finish(true), 1u);
  pool.swap_in_async(p, copy);
  pool.copy_to_host(back.data(), p, back.size());
  pool.synchronize();
  EXPECT_EQ(back, text);
  pool.free(p);
}

TEST(Hpp, RegionsSleepAndWake) {
  glake::Pool pool(cpp_config());
  void* p = nullptr;
  {
    glake::Region region(pool, "weights");
    p = pool.malloc(6 * MiB);
  }
  void* shared = pool.malloc(MiB);  // after the region: the shared pool
  const std::string text = "weights that sleep and wake";
  std::string back(text.size(), '\0');
  pool.copy_to_device(p, text.data(), text.size());
  pool.synchronize();
  const int64_t awake = pool.stats().reserved_bytes.all.current;
  pool.sleep("weights");
  EXPECT_EQ(pool.region_info("weights").asleep, 1u);
  EXPECT_LE(pool.stats().reserved_bytes.all.current, awake - static_cast<int64_t>(6 * MiB));
  EXPECT_THROW(pool.sleep("weights"), glake::Error);  // already asleep
  pool.wake("weights");
  EXPECT_EQ(pool.region_info("weights").allocated_bytes, 6 * MiB);
  pool.copy_to_host(back.data(), p, back.size());
  pool.synchronize();
  EXPECT_EQ(back, text);
  try {
    pool.wake("nothing");
    FAIL() << "expected an error";
  } catch (const glake::Error& e) {
    EXPECT_EQ(e.status(), GLAKE_STATUS_INVALID_ARGUMENT);
  }
  pool.free(p);
  pool.free(shared);
}

TEST(Hpp, PoolsMove) {
  glake::Pool first(cpp_config());
  glake::Pool second = std::move(first);
  EXPECT_EQ(first.handle(), nullptr);
  glake::Allocation a = second.allocate(1000);
  EXPECT_TRUE(a);
}

}  // namespace

TEST(Hpp, TransfersCopyBothWays) {
  glake::Pool pool(cpp_config());
  glake::Transfer transfer(0, pool.backend());
  const std::size_t len = 20 * MiB + 5;
  glake::Allocation a = pool.allocate(len);
  std::vector<unsigned char> src(len), back(len, 0);
  for (std::size_t i = 0; i < len; i++) src[i] = static_cast<unsigned char>(i * 13 + 1);
  transfer.to_device(a.get(), src.data(), len);
  transfer.to_host(back.data(), a.get(), len, nullptr, /*async=*/true);
  EXPECT_EQ(back, src);
  glake_transfer_stats stats = transfer.stats();
  EXPECT_EQ(stats.copies, 2u);
  EXPECT_EQ(stats.engine_bytes, 2u * len);
  glake::Transfer moved = std::move(transfer);
  EXPECT_EQ(transfer.handle(), nullptr);
  try {
    moved.to_device(a.get(), nullptr, 16);
    FAIL() << "expected an error";
  } catch (const glake::Error& e) {
    EXPECT_EQ(e.status(), GLAKE_STATUS_NULL_POINTER);
  }
}

// SmartSwap's hooks as a custom operator carries them: nothing before attach(), a step's ops,
// tensors and the pool's allocations after it.
TEST(Hpp, SwapManagerHooksRecordSteps) {
  auto& manager = glake::swap::SwapManager::instance();
  manager.begin_hook("unattached");  // no pool yet: does nothing
  manager.post_hook();
  EXPECT_EQ(manager.end_hook().ops, 0u);
  glake::Pool pool(cpp_config());
  manager.attach(pool);
  void* weights = pool.malloc(4 * MiB);
  for (int step = 0; step < 2; step++) {
    manager.stage_hook(GLAKE_PHASE_FORWARD);
    manager.begin_hook("gmm_forward");
    manager.tensor_hook(weights, 4 * MiB);
    void* act = pool.malloc(2 * MiB);
    manager.tensor_hook(act, 2 * MiB);
    manager.post_hook();
    manager.stage_hook(GLAKE_PHASE_BACKWARD);
    manager.begin_hook("gmm_backward");
    manager.tensor_hook(act, 2 * MiB);
    pool.free(act);
    manager.post_hook();
    glake_profile_summary summary = manager.end_hook();
    EXPECT_EQ(summary.ops, 2u);
    EXPECT_EQ(summary.tensors, 1u);
    EXPECT_EQ(summary.base_bytes, 4 * MiB);
    EXPECT_EQ(summary.peak_bytes, 6 * MiB);
  }
  EXPECT_THROW(manager.post_hook(), glake::Error);  // no op running
  manager.detach();
  pool.free(weights);
}

// The same hooks driving a SmartSwap session: after a warm-up and a profiled step, steps run
// within a target 60% of their unplanned peak, and every activation comes back intact.
TEST(Hpp, SwapManagerSwapsToMeetItsTarget) {
  const std::size_t layers = 6, act = 4 * MiB;
  glake::Pool pool(cpp_config());
  glake_smartswap_settings settings{};
  settings.target_bytes = layers * act * 6 / 10;
  settings.warmup_iterations = 1;
  settings.config.d2h_bytes_per_s = settings.config.h2d_bytes_per_s = 1ull << 40;
  settings.config.prefetch = 1;
  settings.config.preference = GLAKE_SWAP_BETTER_PERFORMANCE;
  auto& manager = glake::swap::SwapManager::instance();
  manager.enable(pool, settings);
  for (int step = 0; step < 4; step++) {
    pool.reset_peak_stats();
    std::vector<void*> acts;
    manager.stage_hook(GLAKE_PHASE_FORWARD);
    for (std::size_t l = 0; l < layers; l++) {
      manager.begin_hook("gmm_forward");
      void* a = pool.malloc(act);
      manager.tensor_hook(a, act);
      std::vector<unsigned char> data(act, static_cast<unsigned char>(step * 16 + l));
      pool.copy_to_device(a, data.data(), act);
      pool.synchronize();
      manager.post_hook();
      acts.push_back(a);
    }
    manager.stage_hook(GLAKE_PHASE_BACKWARD);
    for (std::size_t l = layers; l-- > 0;) {
      manager.begin_hook("gmm_backward");
      manager.tensor_hook(acts[l], act);
      std::vector<unsigned char> back(act);
      pool.copy_to_host(back.data(), acts[l], act);
      pool.synchronize();
      EXPECT_EQ(back, std::vector<unsigned char>(act, static_cast<unsigned char>(step * 16 + l)));
      pool.free(acts[l]);
      manager.post_hook();
    }
    manager.end_hook();
    if (step >= 2) {
      EXPECT_LE(static_cast<uint64_t>(pool.stats().reserved_bytes.all.peak), settings.target_bytes);
    }
  }
  glake_smartswap_report report = manager.report();
  EXPECT_EQ(report.phase, static_cast<uint32_t>(GLAKE_SMARTSWAP_STABLE));
  EXPECT_GT(report.planned_swaps, 0u);
  EXPECT_EQ(report.swapped_out, 2 * report.planned_swaps);
  EXPECT_EQ(report.swapped_in, report.swapped_out);
  manager.detach();
  EXPECT_EQ(manager.report().planned_swaps, 0u);
}
