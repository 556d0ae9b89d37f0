// The C++ wrappers: RAII ownership, moves, and errors carrying status and message.
#include <glake.hpp>

#include <string>

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

TEST(Hpp, PoolsMove) {
  glake::Pool first(cpp_config());
  glake::Pool second = std::move(first);
  EXPECT_EQ(first.handle(), nullptr);
  glake::Allocation a = second.allocate(1000);
  EXPECT_TRUE(a);
}

}  // namespace
