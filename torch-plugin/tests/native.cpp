// Calls libgmlake.so through python/glake/native/gmlake_native.h, as the native allocator
// compiled against torch does, on the host backend. One scenario per run (its name is the
// argument), each in a fresh process; exits nonzero on the first failed check's scenario.
#include "gmlake_native.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <string>
#include <thread>
#include <vector>

// The header's layouts, with the numbers the Rust side asserts for its own structs.
static_assert(sizeof(gmlake_n_pool_id) == 16, "gmlake_n_pool_id");
static_assert(offsetof(gmlake_n_pool_id, second) == 8, "gmlake_n_pool_id.second");
static_assert(sizeof(gmlake_n_block) == 40, "gmlake_n_block");
static_assert(offsetof(gmlake_n_block, requested_size) == 16, "gmlake_n_block.requested_size");
static_assert(offsetof(gmlake_n_block, state) == 24, "gmlake_n_block.state");
static_assert(offsetof(gmlake_n_block, stream) == 32, "gmlake_n_block.stream");
static_assert(sizeof(gmlake_n_segment) == 64, "gmlake_n_segment");
static_assert(offsetof(gmlake_n_segment, stream) == 32, "gmlake_n_segment.stream");
static_assert(offsetof(gmlake_n_segment, is_large) == 40, "gmlake_n_segment.is_large");
static_assert(offsetof(gmlake_n_segment, pool) == 48, "gmlake_n_segment.pool");
static_assert(sizeof(gmlake_n_stitched) == 24, "gmlake_n_stitched");
static_assert(offsetof(gmlake_n_stitched, in_use) == 16, "gmlake_n_stitched.in_use");
static_assert(offsetof(gmlake_n_stitched, pieces) == 20, "gmlake_n_stitched.pieces");
static_assert(sizeof(gmlake_n_event) == 40, "gmlake_n_event");
static_assert(offsetof(gmlake_n_event, device) == 4, "gmlake_n_event.device");
static_assert(offsetof(gmlake_n_event, address) == 8, "gmlake_n_event.address");
static_assert(offsetof(gmlake_n_event, size) == 16, "gmlake_n_event.size");
static_assert(offsetof(gmlake_n_event, pool) == 24, "gmlake_n_event.pool");

static int failures = 0;

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__,  \
                   __LINE__, #cond, gmlake_last_error());                            \
      ++failures;                                                                    \
    }                                                                                \
  } while (0)

static const size_t MiB = size_t{1} << 20;
static const gmlake_n_pool_id SHARED{0, 0};

static bool same(gmlake_n_pool_id a, gmlake_n_pool_id b) {
  return a.first == b.first && a.second == b.second;
}

static bool error_has(const char* text) {
  return std::strstr(gmlake_last_error(), text) != nullptr;
}

static void* alloc(size_t size, gmlake_n_pool_id pool = SHARED) {
  void* p = nullptr;
  int status = gmlake_n_malloc(0, size, size, nullptr, pool, &p, nullptr);
  CHECK(status == GMLAKE_N_OK);
  CHECK(p != nullptr);
  return p;
}

static void release(void* p) {
  int device = -7;
  CHECK(gmlake_n_free(p, 0, &device) == GMLAKE_N_OK);
  CHECK(device == 0);
}

static glake_stats stats(int device) {
  glake_stats out;
  std::memset(&out, 0xff, sizeof out);
  CHECK(gmlake_n_stats(device, &out) == GMLAKE_N_OK);
  return out;
}

static bool all_zero(const glake_stats& s) {
  glake_stats zero;
  std::memset(&zero, 0, sizeof zero);
  return std::memcmp(&s, &zero, sizeof s) == 0;
}

struct Segment {
  gmlake_n_segment info;
  std::vector<gmlake_n_block> blocks;
};

struct Snapshot {
  std::vector<Segment> segments;
  std::vector<gmlake_n_stitched> stitched;

  // The segment holding `p`, or nullptr.
  const Segment* holding(const void* p) const {
    auto at = reinterpret_cast<uint64_t>(p);
    for (const auto& s : segments) {
      if (at >= s.info.address && at < s.info.address + s.info.total_size) return &s;
    }
    return nullptr;
  }
};

static Snapshot snapshot(int device) {
  Snapshot out;
  int status = gmlake_n_snapshot(
      device, &out,
      [](void* ctx, const gmlake_n_segment* segment, const gmlake_n_block* blocks, size_t count) {
        static_cast<Snapshot*>(ctx)->segments.push_back(
            Segment{*segment, std::vector<gmlake_n_block>(blocks, blocks + count)});
      },
      [](void* ctx, const gmlake_n_stitched* range) {
        static_cast<Snapshot*>(ctx)->stitched.push_back(*range);
      });
  CHECK(status == GMLAKE_N_OK);
  return out;
}

static std::vector<gmlake_n_event> take() {
  std::vector<gmlake_n_event> out;
  size_t count = gmlake_n_take_events(&out, [](void* ctx, const gmlake_n_event* event) {
    static_cast<std::vector<gmlake_n_event>*>(ctx)->push_back(*event);
  });
  CHECK(count == out.size());
  return out;
}

static int live(gmlake_n_pool_id pool, std::vector<uint64_t>* out) {
  return gmlake_n_pool_live(0, pool, out, [](void* ctx, uint64_t address) {
    static_cast<std::vector<uint64_t>*>(ctx)->push_back(address);
  });
}

static int uses(gmlake_n_pool_id pool) {
  int out = -1;
  CHECK(gmlake_n_pool_use_count(0, pool, &out) == GMLAKE_N_OK);
  return out;
}

static uint64_t addr(const void* p) { return reinterpret_cast<uint64_t>(p); }

// A malloc and a free, statistics on the way, and the calls' argument checks.
static void round_trip() {
  CHECK(gmlake_n_device_used(0) == 0);
  CHECK(all_zero(stats(0)));
  CHECK(gmlake_n_device_used(0) == 0);  // statistics create no pool

  void* p = nullptr;
  uint32_t pieces = 99;
  CHECK(gmlake_n_malloc(0, 3 * MiB + 5, 3 * MiB + 5, nullptr, SHARED, &p, &pieces) == GMLAKE_N_OK);
  CHECK(p != nullptr);
  CHECK(pieces == 0);
  CHECK(gmlake_n_device_used(0) == 1);
  void* small = alloc(1000);

  void* base = nullptr;
  size_t size = 0;
  CHECK(gmlake_n_base(static_cast<char*>(p) + 100, &base, &size) == GMLAKE_N_OK);
  CHECK(base == p);
  const size_t rounded = 3 * MiB + 512;  // 512-byte units, as PyTorch's
  CHECK(size == rounded);
  glake_stats s = stats(0);
  CHECK(s.allocation.all.current == 2);
  CHECK(s.allocated_bytes.all.current == static_cast<int64_t>(rounded + 1024));
  CHECK(s.requested_bytes.all.current == static_cast<int64_t>(3 * MiB + 5 + 1000));
  CHECK(s.allocated_bytes.large_pool.current == static_cast<int64_t>(rounded));

  int device = -7;
  CHECK(gmlake_n_free(p, 0, &device) == GMLAKE_N_OK);
  CHECK(device == 0);
  device = -7;
  CHECK(gmlake_n_free(small, -1, &device) == GMLAKE_N_OK);  // any device
  CHECK(device == 0);
  void* hinted = alloc(MiB);
  device = -7;
  CHECK(gmlake_n_free(hinted, 5, &device) == GMLAKE_N_OK);  // a wrong hint still finds it
  CHECK(device == 0);
  void* quiet = alloc(MiB);
  CHECK(gmlake_n_free(quiet, 0, nullptr) == GMLAKE_N_OK);

  // A request the caller rounded up itself (PyTorch's roundup_power2_divisions): the rounded
  // bytes are handed out, the bytes asked for are booked as requested.
  const int64_t asked_before = stats(0).requested_bytes.all.allocated;
  void* rounded_up = nullptr;
  CHECK(gmlake_n_malloc(0, 96 * MiB, 84 * MiB, nullptr, SHARED, &rounded_up, nullptr) ==
        GMLAKE_N_OK);
  CHECK(gmlake_n_base(rounded_up, &base, &size) == GMLAKE_N_OK);
  CHECK(size == 96 * MiB);
  s = stats(0);
  CHECK(s.requested_bytes.all.current == static_cast<int64_t>(84 * MiB));
  CHECK(s.requested_bytes.all.allocated - asked_before == static_cast<int64_t>(84 * MiB));
  CHECK(s.active_bytes.all.current == static_cast<int64_t>(96 * MiB));
  release(rounded_up);
  // Freed to the pool (parked), the same request again books the same.
  CHECK(gmlake_n_malloc(0, 96 * MiB, 84 * MiB, nullptr, SHARED, &rounded_up, nullptr) ==
        GMLAKE_N_OK);
  CHECK(stats(0).requested_bytes.all.current == static_cast<int64_t>(84 * MiB));
  release(rounded_up);
  p = reinterpret_cast<void*>(0x1);
  CHECK(gmlake_n_malloc(0, MiB, MiB + 1, nullptr, SHARED, &p, nullptr) == GMLAKE_N_INVALID);
  CHECK(error_has("more than"));
  CHECK(p == reinterpret_cast<void*>(0x1));

  s = stats(0);
  CHECK(s.allocation.all.current == 0);
  CHECK(s.allocated_bytes.all.current == 0);
  CHECK(s.reserved_bytes.all.current > 0);

  // Bad arguments are GMLAKE_N_INVALID with a message, and leave the outputs alone.
  p = reinterpret_cast<void*>(0x1);
  CHECK(gmlake_n_malloc(0, 0, 0, nullptr, SHARED, &p, nullptr) == GMLAKE_N_INVALID);
  CHECK(error_has("size 0"));
  CHECK(p == reinterpret_cast<void*>(0x1));
  CHECK(gmlake_n_malloc(0, MiB, MiB, nullptr, SHARED, nullptr, nullptr) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_malloc(64, MiB, MiB, nullptr, SHARED, &p, nullptr) == GMLAKE_N_INVALID);
  CHECK(error_has("out of range"));
  CHECK(gmlake_n_malloc(-1, MiB, MiB, nullptr, SHARED, &p, nullptr) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_malloc(0, MiB, MiB, nullptr, gmlake_n_pool_id{5, 5}, &p, nullptr) == GMLAKE_N_INVALID);
  CHECK(error_has("not open"));
  CHECK(p == reinterpret_cast<void*>(0x1));
  CHECK(gmlake_n_stats(0, nullptr) == GMLAKE_N_INVALID);
  glake_stats unused;
  CHECK(gmlake_n_stats(-1, &unused) == GMLAKE_N_INVALID);
  CHECK(all_zero(stats(1)));
  CHECK(gmlake_n_device_used(1) == 0);
  CHECK(gmlake_n_device_used(-1) == 0);
  CHECK(gmlake_n_device_used(1000) == 0);

  // Emptying caches: one device, every device, a device not used yet (nothing, no pool).
  CHECK(gmlake_n_empty_cache(0) == GMLAKE_N_OK);
  CHECK(stats(0).reserved_bytes.all.current == 0);
  alloc(2 * MiB);  // kept live: only free memory goes
  CHECK(gmlake_n_empty_cache(-1) == GMLAKE_N_OK);
  CHECK(stats(0).reserved_bytes.all.current == static_cast<int64_t>(2 * MiB));
  CHECK(gmlake_n_empty_cache(3) == GMLAKE_N_OK);
  CHECK(gmlake_n_device_used(3) == 0);
  CHECK(gmlake_n_empty_cache(-2) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_empty_cache(64) == GMLAKE_N_INVALID);
}

// A request beyond the cap is GMLAKE_N_OUT_OF_MEMORY with PyTorch's wording; the pool goes on.
static void out_of_memory() {
  CHECK(gmlake_n_set_memory_fraction(0, 1.5) == GMLAKE_N_INVALID);
  CHECK(error_has("fraction"));
  CHECK(gmlake_n_set_memory_fraction(0, 1.0 / 64) == GMLAKE_N_OK);  // 16 MiB of 1 GiB
  double fraction = 0;
  CHECK(gmlake_n_memory_fraction(0, &fraction) == GMLAKE_N_OK);
  CHECK(fraction == 1.0 / 64);
  CHECK(gmlake_n_memory_fraction(0, nullptr) == GMLAKE_N_INVALID);

  void* held = alloc(8 * MiB);
  void* p = reinterpret_cast<void*>(0x1);
  uint32_t pieces = 99;
  CHECK(gmlake_n_malloc(0, 12 * MiB, 12 * MiB, nullptr, SHARED, &p, &pieces) == GMLAKE_N_OUT_OF_MEMORY);
  CHECK(std::strncmp(gmlake_last_error(), "CUDA out of memory.", 19) == 0);
  CHECK(error_has("12582912 bytes"));
  CHECK(p == reinterpret_cast<void*>(0x1));
  CHECK(pieces == 99);
  glake_stats s = stats(0);
  CHECK(s.num_ooms == 1);
  CHECK(s.allocation.all.current == 1);
  CHECK(s.reserved_bytes.all.current <= static_cast<int64_t>(16 * MiB));

  void* fits = alloc(4 * MiB);
  release(fits);
  release(held);
  CHECK(gmlake_n_malloc(0, 12 * MiB, 12 * MiB, nullptr, SHARED, &p, nullptr) == GMLAKE_N_OK);
  release(p);
  CHECK(gmlake_n_set_memory_fraction(0, 1.0) == GMLAKE_N_OK);
  CHECK(gmlake_n_memory_fraction(0, &fraction) == GMLAKE_N_OK);
  CHECK(fraction == 1.0);
}

// Memory of pools' own allocators counts against the cap with glake's: counting frees cached
// memory first, a count past the cap is out of memory and counts nothing, and uncounting more
// than is counted is refused.
static void outside_memory() {
  CHECK(gmlake_n_set_memory_fraction(0, 1.0 / 64) == GMLAKE_N_OK);  // 16 MiB of 1 GiB
  CHECK(gmlake_n_count_outside(0, 10 * MiB) == GMLAKE_N_OK);
  void* p = nullptr;
  CHECK(gmlake_n_malloc(0, 8 * MiB, 8 * MiB, nullptr, SHARED, &p, nullptr) == GMLAKE_N_OUT_OF_MEMORY);
  void* small = alloc(4 * MiB);
  release(small);
  CHECK(stats(0).reserved_bytes.all.current > 0);
  CHECK(gmlake_n_count_outside(0, 6 * MiB) == GMLAKE_N_OK);  // the cache makes room
  CHECK(stats(0).reserved_bytes.all.current == 0);
  CHECK(gmlake_n_count_outside(0, 1 * MiB) == GMLAKE_N_OUT_OF_MEMORY);
  CHECK(error_has("own allocator"));
  CHECK(gmlake_n_uncount_outside(0, 17 * MiB) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_uncount_outside(0, 16 * MiB) == GMLAKE_N_OK);
  void* whole = alloc(16 * MiB);
  release(whole);
  CHECK(gmlake_n_count_outside(99, 1) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_set_memory_fraction(0, 1.0) == GMLAKE_N_OK);
}

// Stray, interior, NULL and freed pointers are GMLAKE_N_INVALID, and nothing is lost.
static void invalid_pointers() {
  void* p = alloc(8 * MiB);
  glake_stats before = stats(0);
  int device = -7;
  CHECK(gmlake_n_free(reinterpret_cast<void*>(0x1000), 0, &device) == GMLAKE_N_INVALID);
  CHECK(error_has("not allocated by glake"));
  CHECK(device == -7);
  CHECK(gmlake_n_free(reinterpret_cast<void*>(0x1000), -1, &device) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_free(static_cast<char*>(p) + 4096, 0, &device) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_free(nullptr, 0, &device) == GMLAKE_N_INVALID);
  CHECK(error_has("NULL"));
  CHECK(device == -7);
  CHECK(gmlake_n_record_stream(reinterpret_cast<void*>(0x1000), nullptr) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_record_stream(p, nullptr) == GMLAKE_N_OK);
  void* base = nullptr;
  size_t size = 0;
  CHECK(gmlake_n_base(reinterpret_cast<void*>(0x1000), &base, &size) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_base(p, nullptr, &size) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_base(p, &base, nullptr) == GMLAKE_N_INVALID);
  glake_stats after = stats(0);
  CHECK(after.allocation.all.current == before.allocation.all.current);
  CHECK(after.allocated_bytes.all.current == before.allocated_bytes.all.current);
  CHECK(after.reserved_bytes.all.current == before.reserved_bytes.all.current);
  CHECK(gmlake_n_base(p, &base, &size) == GMLAKE_N_OK);
  CHECK(base == p);

  release(p);
  CHECK(gmlake_n_free(p, 0, &device) == GMLAKE_N_INVALID);  // a double free
  CHECK(error_has("double free"));
  CHECK(stats(0).allocation.all.current == 0);
}

// Private pools: uses, allocations named by pool, their segments, and the return to the
// shared pool at the last release.
static void private_pools() {
  const gmlake_n_pool_id id{7, 9};
  const gmlake_n_pool_id other{8, 0};
  CHECK(uses(id) == 0);
  CHECK(gmlake_n_pool_release(0, id) == GMLAKE_N_INVALID);  // not open, no pool yet
  CHECK(gmlake_n_pool_end(0, id) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_pool_retain(0, SHARED) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_pool_begin(0, SHARED) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_pool_retain(64, id) == GMLAKE_N_INVALID);
  int out = -1;
  CHECK(gmlake_n_pool_use_count(0, id, nullptr) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_pool_use_count(-1, id, &out) == GMLAKE_N_INVALID);

  CHECK(gmlake_n_pool_retain(0, id) == GMLAKE_N_OK);
  CHECK(uses(id) == 1);
  CHECK(gmlake_n_pool_begin(0, id) == GMLAKE_N_OK);
  CHECK(uses(id) == 2);
  CHECK(uses(other) == 0);

  void* a = alloc(8 * MiB, id);
  void* b = alloc(1000, id);
  void* c = alloc(8 * MiB);
  CHECK(a != c);
  std::vector<uint64_t> in_pool;
  CHECK(live(id, &in_pool) == GMLAKE_N_OK);
  std::vector<uint64_t> expected{addr(a), addr(b)};
  std::sort(expected.begin(), expected.end());
  CHECK(in_pool == expected);
  std::vector<uint64_t> none;
  CHECK(live(other, &none) == GMLAKE_N_INVALID);
  CHECK(none.empty());

  Snapshot snap = snapshot(0);
  const Segment* sa = snap.holding(a);
  const Segment* sb = snap.holding(b);
  const Segment* sc = snap.holding(c);
  CHECK(sa != nullptr && sb != nullptr && sc != nullptr);
  if (sa && sb && sc) {
    CHECK(same(sa->info.pool, id));
    CHECK(same(sb->info.pool, id));
    CHECK(same(sc->info.pool, SHARED));
    CHECK(sa->info.is_large == 1);
    CHECK(sb->info.is_large == 0);
    CHECK(sc->info.is_large == 1);
    CHECK(sc->blocks.size() >= 1 && sc->blocks[0].address == addr(c));
    CHECK(sc->blocks[0].state == GMLAKE_N_BLOCK_ALLOCATED);
    CHECK(sc->blocks[0].requested_size == 8 * MiB);
  }
  for (const auto& s : snap.segments) {
    CHECK(same(s.info.pool, id) || same(s.info.pool, SHARED));
  }

  CHECK(gmlake_n_pool_end(0, id) == GMLAKE_N_OK);
  CHECK(uses(id) == 2);
  CHECK(gmlake_n_pool_end(0, id) == GMLAKE_N_INVALID);  // no routing left to end
  CHECK(gmlake_n_pool_release(0, id) == GMLAKE_N_OK);
  CHECK(uses(id) == 1);

  // Freed, a's memory stays with the pool: empty_cache keeps it.
  release(a);
  in_pool.clear();
  CHECK(live(id, &in_pool) == GMLAKE_N_OK);
  CHECK(in_pool == std::vector<uint64_t>{addr(b)});
  CHECK(gmlake_n_empty_cache(0) == GMLAKE_N_OK);
  snap = snapshot(0);
  sa = snap.holding(a);
  CHECK(sa != nullptr && same(sa->info.pool, id));

  // The last release: the pool's segments are shared ones, released like any other.
  CHECK(gmlake_n_pool_release(0, id) == GMLAKE_N_OK);
  CHECK(uses(id) == 0);
  CHECK(live(id, &in_pool) == GMLAKE_N_INVALID);
  snap = snapshot(0);
  for (const auto& s : snap.segments) CHECK(same(s.info.pool, SHARED));
  CHECK(gmlake_n_pool_release(0, id) == GMLAKE_N_INVALID);
  CHECK(error_has("not open"));
  release(b);
  release(c);
  CHECK(gmlake_n_empty_cache(0) == GMLAKE_N_OK);
  CHECK(stats(0).reserved_bytes.all.current == 0);
}

// Segment events: off by default, then kept per thread while on, in order.
static void segment_events() {
  CHECK(take().empty());
  release(alloc(8 * MiB));
  CHECK(gmlake_n_empty_cache(0) == GMLAKE_N_OK);
  CHECK(take().empty());  // off by default

  gmlake_n_record_events(1);
  void* p = alloc(20 * MiB);
  std::vector<gmlake_n_event> events = take();
  CHECK(events.size() == 1);
  if (events.size() == 1) {
    CHECK(events[0].kind == GMLAKE_N_SEGMENT_ALLOC);
    CHECK(events[0].device == 0);
    CHECK(events[0].address == addr(p));
    CHECK(events[0].size == 20 * MiB);
    CHECK(same(events[0].pool, SHARED));
  }
  CHECK(take().empty());  // taken events are forgotten
  release(p);
  CHECK(take().empty());  // a free keeps the segment cached
  CHECK(gmlake_n_empty_cache(0) == GMLAKE_N_OK);
  events = take();
  CHECK(events.size() == 1);
  if (events.size() == 1) {
    CHECK(events[0].kind == GMLAKE_N_SEGMENT_FREE);
    CHECK(events[0].address == addr(p));
    CHECK(events[0].size == 20 * MiB);
  }

  // Another thread's events are its own.
  void* q = nullptr;
  std::vector<gmlake_n_event> theirs;
  std::thread other([&] {
    q = alloc(6 * MiB);
    theirs = take();
  });
  other.join();
  CHECK(theirs.size() == 1 && theirs[0].kind == GMLAKE_N_SEGMENT_ALLOC);
  CHECK(theirs.size() == 1 && theirs[0].size == 6 * MiB && theirs[0].address == addr(q));
  CHECK(take().empty());

  // A private pool's segment names its pool.
  const gmlake_n_pool_id id{3, 4};
  CHECK(gmlake_n_pool_retain(0, id) == GMLAKE_N_OK);
  void* r = alloc(4 * MiB, id);
  events = take();
  CHECK(events.size() == 1 && same(events[0].pool, id) && events[0].address == addr(r));
  release(r);
  CHECK(gmlake_n_pool_release(0, id) == GMLAKE_N_OK);

  // Without a callback the events are counted and dropped.
  release(q);
  CHECK(gmlake_n_empty_cache(0) == GMLAKE_N_OK);
  CHECK(gmlake_n_take_events(nullptr, nullptr) == 2);  // q's and r's segments
  CHECK(take().empty());

  // Off again: nothing more is kept.
  gmlake_n_record_events(0);
  void* s = alloc(10 * MiB);
  release(s);
  CHECK(gmlake_n_empty_cache(0) == GMLAKE_N_OK);
  CHECK(take().empty());
  CHECK(stats(0).num_device_free > 0);
}

// The statistics agree with the snapshot: segments, bytes in each state, requested bytes.
static void stats_match_snapshot() {
  void* a = alloc(3 * MiB + 5);
  void* b = alloc(1000);
  void* c = alloc(20 * MiB);
  void* d = alloc(500);
  release(alloc(8 * MiB));  // a cached free segment
  (void)a;
  (void)b;
  (void)d;
  CHECK(c != nullptr);
  glake_stats s = stats(0);
  Snapshot snap = snapshot(0);
  CHECK(snap.stitched.empty());
  CHECK(static_cast<int64_t>(snap.segments.size()) == s.segment.all.current);
  int64_t reserved = 0, small = 0, allocated = 0, requested = 0, segment_allocated = 0;
  uint64_t previous_end = 0;
  for (const auto& seg : snap.segments) {
    CHECK(seg.info.address >= previous_end);  // address order
    previous_end = seg.info.address + seg.info.total_size;
    reserved += seg.info.total_size;
    if (!seg.info.is_large) small += seg.info.total_size;
    segment_allocated += seg.info.allocated_size;
    CHECK(same(seg.info.pool, SHARED));
    CHECK(seg.info.stream == 0);
    CHECK(!seg.blocks.empty());
    uint64_t at = seg.info.address, not_free = 0, asked = 0;
    for (const auto& block : seg.blocks) {
      CHECK(block.address == at);  // contiguous, covering the segment
      at += block.size;
      CHECK(block.state == GMLAKE_N_BLOCK_ALLOCATED || block.state == GMLAKE_N_BLOCK_FREE);
      if (block.state == GMLAKE_N_BLOCK_ALLOCATED) {
        allocated += block.size;
        CHECK(block.requested_size > 0 && block.requested_size <= block.size);
      } else {
        CHECK(block.requested_size == 0);
      }
      if (block.state != GMLAKE_N_BLOCK_FREE) not_free += block.size;
      asked += block.requested_size;
    }
    CHECK(at == seg.info.address + seg.info.total_size);
    CHECK(seg.info.allocated_size == not_free);
    CHECK(seg.info.requested_size == asked);
    requested += asked;
  }
  CHECK(reserved == s.reserved_bytes.all.current);
  CHECK(small == s.reserved_bytes.small_pool.current);
  CHECK(allocated == s.allocated_bytes.all.current);
  CHECK(segment_allocated == s.active_bytes.all.current);
  CHECK(requested == s.requested_bytes.all.current);
  CHECK(requested == static_cast<int64_t>(3 * MiB + 5 + 1000 + 20 * MiB + 500));

  // A device not used yet: no segments, zero statistics, and still no pool.
  Snapshot empty = snapshot(1);
  CHECK(empty.segments.empty() && empty.stitched.empty());
  CHECK(all_zero(stats(1)));
  CHECK(gmlake_n_device_used(1) == 0);
  CHECK(gmlake_n_snapshot(-1, nullptr, nullptr, nullptr) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_snapshot(0, nullptr, nullptr, nullptr) == GMLAKE_N_OK);
}

// A stitched allocation reports its pieces, and the snapshot shows the range and its pieces.
static void stitched() {
  std::vector<void*> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(alloc(6 * MiB));
  for (int i = 0; i < 6; i += 2) release(blocks[i]);
  int64_t reserved = stats(0).reserved_bytes.all.current;

  void* big = nullptr;
  uint32_t pieces = 0;
  CHECK(gmlake_n_malloc(0, 18 * MiB, 18 * MiB, nullptr, SHARED, &big, &pieces) == GMLAKE_N_OK);
  CHECK(pieces == 3);
  glake_stats s = stats(0);
  CHECK(s.stitches == 1);
  CHECK(s.reserved_bytes.all.current == reserved);
  void* base = nullptr;
  size_t size = 0;
  CHECK(gmlake_n_base(static_cast<char*>(big) + 100, &base, &size) == GMLAKE_N_OK);
  CHECK(base == big && size == 18 * MiB);

  Snapshot snap = snapshot(0);
  CHECK(snap.stitched.size() == 1);
  if (snap.stitched.size() == 1) {
    CHECK(snap.stitched[0].address == addr(big));
    CHECK(snap.stitched[0].size == 18 * MiB);
    CHECK(snap.stitched[0].in_use == 1);
    CHECK(snap.stitched[0].pieces == 3);
  }
  int64_t plain = 0, piece_bytes = 0, requested = 0, piece_requested = 0;
  for (const auto& seg : snap.segments) {
    for (const auto& block : seg.blocks) {
      requested += static_cast<int64_t>(block.requested_size);
      if (block.state == GMLAKE_N_BLOCK_ALLOCATED) plain += block.size;
      if (block.state == GMLAKE_N_BLOCK_STITCHED) {
        piece_bytes += block.size;
        piece_requested += static_cast<int64_t>(block.requested_size);
      }
    }
  }
  CHECK(piece_bytes == static_cast<int64_t>(18 * MiB));
  CHECK(plain + piece_bytes == s.allocated_bytes.all.current);
  // The stitched allocation's requested bytes are spread over its pieces.
  CHECK(piece_requested == static_cast<int64_t>(18 * MiB));
  CHECK(requested == s.requested_bytes.all.current);

  // Freed, the range stays cached; the same request reuses it, pieces and all.
  release(big);
  snap = snapshot(0);
  CHECK(snap.stitched.size() == 1 && snap.stitched[0].in_use == 0);
  pieces = 0;
  void* again = nullptr;
  CHECK(gmlake_n_malloc(0, 18 * MiB, 18 * MiB, nullptr, SHARED, &again, &pieces) == GMLAKE_N_OK);
  CHECK(again == big && pieces == 3);
  CHECK(stats(0).stitch_reuse_hits == 1);
  release(again);
  void* plain_block = nullptr;
  pieces = 99;
  CHECK(gmlake_n_malloc(0, 2 * MiB, 2 * MiB, nullptr, SHARED, &plain_block, &pieces) == GMLAKE_N_OK);
  CHECK(pieces == 0);
  release(plain_block);
}

// A graph pool's checkpoint restored: allocations freed since come back at their addresses
// with gmlake_n_malloc_at, counted as any allocation; ranges that are not free memory of the
// pool are refused and change nothing.
static void malloc_at() {
  const gmlake_n_pool_id id{7, 1};
  void* none = reinterpret_cast<void*>(0x1000);
  CHECK(gmlake_n_malloc_at(0, none, 2 * MiB, nullptr, id) == GMLAKE_N_INVALID);  // no pool
  CHECK(error_has("no pool"));
  CHECK(gmlake_n_device_used(0) == 0);
  CHECK(gmlake_n_malloc_at(-1, none, 2 * MiB, nullptr, id) == GMLAKE_N_INVALID);

  CHECK(gmlake_n_pool_begin(0, id) == GMLAKE_N_OK);
  void* a = alloc(6 * MiB, id);
  void* b = alloc(1000, id);
  void* keep = alloc(4 * MiB, id);
  void* shared = alloc(4 * MiB);
  release(shared);  // free memory of the shared pool
  std::vector<uint64_t> checkpoint;
  CHECK(live(id, &checkpoint) == GMLAKE_N_OK);
  glake_stats before = stats(0);
  release(a);
  release(b);

  glake_stats freed = stats(0);
  CHECK(gmlake_n_malloc_at(0, keep, 4 * MiB, nullptr, id) == GMLAKE_N_INVALID);  // live
  CHECK(error_has("not free memory"));
  CHECK(gmlake_n_malloc_at(0, shared, 4 * MiB, nullptr, id) == GMLAKE_N_INVALID);  // shared
  CHECK(gmlake_n_malloc_at(0, a, 6 * MiB, nullptr, SHARED) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_malloc_at(0, a, 6 * MiB, nullptr, gmlake_n_pool_id{9, 9}) == GMLAKE_N_INVALID);
  CHECK(error_has("not open"));
  CHECK(gmlake_n_malloc_at(0, b, 1000, nullptr, id) == GMLAKE_N_INVALID);  // not rounded
  CHECK(gmlake_n_malloc_at(0, none, 2 * MiB, nullptr, id) == GMLAKE_N_INVALID);
  glake_stats after = stats(0);
  CHECK(std::memcmp(&freed, &after, sizeof freed) == 0);

  CHECK(gmlake_n_malloc_at(0, a, 6 * MiB, nullptr, id) == GMLAKE_N_OK);
  CHECK(gmlake_n_malloc_at(0, b, 1024, nullptr, id) == GMLAKE_N_OK);
  CHECK(gmlake_n_malloc_at(0, a, 6 * MiB, nullptr, id) == GMLAKE_N_INVALID);  // live again
  std::vector<uint64_t> restored;
  CHECK(live(id, &restored) == GMLAKE_N_OK);
  CHECK(restored == checkpoint);
  glake_stats now = stats(0);
  CHECK(now.allocation.all.current == before.allocation.all.current);
  CHECK(now.allocated_bytes.all.current == before.allocated_bytes.all.current);
  CHECK(now.allocated_bytes.small_pool.current == before.allocated_bytes.small_pool.current);
  CHECK(now.active_bytes.all.current == before.active_bytes.all.current);
  CHECK(now.requested_bytes.all.current == before.requested_bytes.all.current + 24);
  void* base = nullptr;
  size_t size = 0;
  CHECK(gmlake_n_base(static_cast<char*>(a) + 100, &base, &size) == GMLAKE_N_OK);
  CHECK(base == a && size == 6 * MiB);

  CHECK(gmlake_n_pool_end(0, id) == GMLAKE_N_OK);
  release(a);
  release(b);
  release(keep);
  CHECK(stats(0).allocation.all.current == 0);
  CHECK(gmlake_n_pool_release(0, id) == GMLAKE_N_OK);
}

// A bounded random soak of the whole ABI: valid and hostile calls mixed, from a seeded
// xorshift generator, against a model of what is live (address -> size as gmlake_n_base
// reports it, and its pool). After every call: the status is a documented one, calls
// documented to fail on bad input return GMLAKE_N_INVALID, live allocations never overlap and
// the allocated bytes equal the model's sum; every few calls each open pool's live list
// matches the model. GLAKE_SOAK_OPS sets the calls per seed (default 3000, 3 seeds; raise it
// for a long run, e.g. GLAKE_SOAK_OPS=1000000 cargo test --test native soak).
struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  uint64_t below(uint64_t n) { return next() % n; }
  bool chance(uint64_t percent) { return below(100) < percent; }
};

struct SoakPool {
  gmlake_n_pool_id id;
  int uses = 0;    // retains and begins not yet released
  int routes = 0;  // begins not yet ended
  int generation = 0;
};

struct Live {
  size_t size;
  int pool;  // index into the pools, -1 for the shared pool
  int generation;
  size_t asked;  // the bytes booked as requested
};

static bool documented(int status) { return status >= GMLAKE_N_OK && status <= GMLAKE_N_FAILED; }

static void soak_seed(uint64_t seed, long ops) {
  Rng rng{seed * 0x9E3779B97F4A7C15ull + 1};
  std::vector<SoakPool> pools{{{11, 1}}, {{11, 2}}, {{12, 0}}};
  const gmlake_n_pool_id unknown{99, 99};
  std::map<uint64_t, Live> model;
  std::vector<uint64_t> freed;  // addresses freed earlier, for hostile frees and malloc_at
  void* const streams[] = {nullptr, reinterpret_cast<void*>(0x10), reinterpret_cast<void*>(0x7),
                           reinterpret_cast<void*>(0xdeadbeefull)};
  const int before = failures;

  auto random_size = [&]() -> size_t {
    switch (rng.below(8)) {
      case 0: return 1;
      case 1: return 1 + 2 * rng.below(512);  // odd, small
      case 2: return 1 + rng.below(1 << 20);
      case 3: return 1 + rng.below(4 * MiB);
      case 4: return MiB * (1 + rng.below(4));
      case 5: return 512 * (1 + rng.below(2048));
      default: return 1 + rng.below(64 << 10);
    }
  };
  // -1 for the shared pool, an index into `pools`, or -2 for a pool never opened.
  auto random_pool = [&]() -> int {
    int pool = static_cast<int>(rng.below(pools.size() + 2)) - 1;
    return pool == static_cast<int>(pools.size()) ? -2 : pool;
  };
  auto random_live = [&]() -> std::map<uint64_t, Live>::iterator {
    auto it = model.begin();
    std::advance(it, static_cast<long>(rng.below(model.size())));
    return it;
  };
  auto add = [&](void* p, int pool, size_t asked) {
    void* base = nullptr;
    size_t size = 0;
    CHECK(gmlake_n_base(p, &base, &size) == GMLAKE_N_OK);
    CHECK(base == p && size > 0);
    int generation = pool >= 0 ? pools[static_cast<size_t>(pool)].generation : 0;
    CHECK(model.count(addr(p)) == 0);
    model[addr(p)] = Live{size, pool, generation, asked};
  };
  auto check_model = [&](long op) {
    const int was = failures;
    uint64_t sum = 0;
    uint64_t asked = 0;
    uint64_t end = 0;
    for (const auto& [at, live] : model) {
      CHECK(at >= end);  // no overlap with the one before
      end = at + live.size;
      sum += live.size;
      asked += live.asked;
    }
    glake_stats now = stats(0);
    CHECK(static_cast<uint64_t>(now.allocated_bytes.all.current) == sum);
    CHECK(static_cast<uint64_t>(now.requested_bytes.all.current) == asked);
    CHECK(static_cast<uint64_t>(now.allocation.all.current) == model.size());
    if (failures != was) std::fprintf(stderr, "seed %llu op %ld\n", (unsigned long long)seed, op);
  };
  auto check_pools = [&]() {
    for (size_t i = 0; i < pools.size(); ++i) {
      std::vector<uint64_t> got;
      int status = live(pools[i].id, &got);
      if (pools[i].uses == 0) {
        CHECK(status == GMLAKE_N_INVALID);
        continue;
      }
      CHECK(status == GMLAKE_N_OK);
      std::vector<uint64_t> want;
      for (const auto& [at, l] : model) {
        if (l.pool == static_cast<int>(i) && l.generation == pools[i].generation) want.push_back(at);
      }
      std::sort(got.begin(), got.end());
      CHECK(got == want);
      int count = -1;
      CHECK(gmlake_n_pool_use_count(0, pools[i].id, &count) == GMLAKE_N_OK);
      CHECK(count == pools[i].uses);
    }
  };

  for (long op = 0; op < ops; ++op) {
    const uint64_t kind = rng.below(100);
    int status = GMLAKE_N_OK;
    if (kind < 30) {  // malloc, mostly valid
      int pool = model.size() > 96 ? -2 : random_pool();
      size_t size = random_size();
      if (rng.chance(3)) size = 0;
      if (rng.chance(3)) size = size_t{1} << 62;
      gmlake_n_pool_id id = pool >= 0 ? pools[static_cast<size_t>(pool)].id
                                      : (pool == -1 ? SHARED : unknown);
      void* p = reinterpret_cast<void*>(0x1);
      uint32_t pieces = 7;
      // Now and then a request its caller rounded up (asked for less), or one that claims
      // more asked for than allocated (refused).
      size_t asked = size;
      if (size > 1 && rng.chance(20)) asked = size - rng.below(size);
      const bool overasked = size > 0 && size < (size_t{1} << 62) && rng.chance(3);
      if (overasked) asked = size + 1 + rng.below(4096);
      status = gmlake_n_malloc(0, size, asked, streams[rng.below(4)], id, &p,
                               rng.chance(50) ? &pieces : nullptr);
      CHECK(documented(status));
      bool closed = pool >= 0 && pools[static_cast<size_t>(pool)].uses == 0;
      if (size == 0 || pool == -2 || closed || overasked) {
        CHECK(status == GMLAKE_N_INVALID);
      } else if (size == size_t{1} << 62) {
        CHECK(status == GMLAKE_N_OUT_OF_MEMORY || status == GMLAKE_N_INVALID);
      } else {
        CHECK(status == GMLAKE_N_OK || status == GMLAKE_N_OUT_OF_MEMORY);
      }
      if (status == GMLAKE_N_OK) {
        CHECK(p != nullptr);
        if (p != nullptr) add(p, pool, asked);
      }
    } else if (kind < 55) {  // free: live, freed, interior, random, NULL
      uint64_t which = rng.below(10);
      int device = -7;
      if (which < 6 && !model.empty()) {
        auto it = random_live();
        uint64_t at = it->first;
        status = gmlake_n_free(reinterpret_cast<void*>(at), rng.chance(50) ? 0 : -1, &device);
        CHECK(status == GMLAKE_N_OK);
        CHECK(device == 0);
        model.erase(it);
        freed.push_back(at);
        if (freed.size() > 256) freed.erase(freed.begin());
      } else {
        uint64_t at = 0;
        if (which == 6 && !freed.empty()) at = freed[rng.below(freed.size())];
        if (which == 7 && !model.empty()) {
          auto it = random_live();
          at = it->first + 1 + rng.below(it->second.size > 1 ? it->second.size - 1 : 1);
          if (it->second.size == 1) at = it->first + 1;
        }
        if (which == 8) at = rng.next() | 1;
        if (model.count(at) == 0) {
          status = gmlake_n_free(reinterpret_cast<void*>(at), 0, &device);
          CHECK(status == GMLAKE_N_INVALID);
          CHECK(device == -7);
        }
      }
    } else if (kind < 60) {  // record_stream with odd streams, on live and bad pointers
      // Live memory gets only the default stream, the one stream the host backend knows.
      // Streams the device does not know are refused at once (status 2), on live memory and
      // elsewhere; the default stream on live memory is accepted.
      void* stream = streams[rng.below(4)];
      if (!model.empty() && rng.chance(70)) {
        void* live = reinterpret_cast<void*>(random_live()->first);
        status = gmlake_n_record_stream(live, stream);
        CHECK(status == (stream == nullptr ? GMLAKE_N_OK : GMLAKE_N_INVALID));
      } else {
        uint64_t at = rng.chance(50) || freed.empty() ? (rng.next() | 1) : freed[rng.below(freed.size())];
        if (model.count(at) == 0) {
          status = gmlake_n_record_stream(reinterpret_cast<void*>(at),
                                          rng.chance(50) ? stream : reinterpret_cast<void*>(rng.next()));
          CHECK(status == GMLAKE_N_INVALID);
        }
      }
    } else if (kind < 72) {  // private pools: retain, begin, end, release in random order
      size_t i = rng.below(pools.size() + 1);
      bool known = i < pools.size();
      gmlake_n_pool_id id = known ? pools[i].id : (rng.chance(50) ? unknown : SHARED);
      switch (rng.below(5)) {
        case 0:
          status = gmlake_n_pool_retain(0, id);
          if (known) {
            CHECK(status == GMLAKE_N_OK);
            ++pools[i].uses;
          } else if (same(id, SHARED)) {
            CHECK(status == GMLAKE_N_INVALID);
          } else if (status == GMLAKE_N_OK) {  // an unknown pool opened: close it again
            CHECK(gmlake_n_pool_release(0, id) == GMLAKE_N_OK);
          }
          break;
        case 1:
          if (known && pools[i].routes >= 4) break;
          status = gmlake_n_pool_begin(0, id);
          if (known) {
            CHECK(status == GMLAKE_N_OK);
            ++pools[i].uses;
            ++pools[i].routes;
          } else if (same(id, SHARED)) {
            CHECK(status == GMLAKE_N_INVALID);
          } else if (status == GMLAKE_N_OK) {
            CHECK(gmlake_n_pool_end(0, id) == GMLAKE_N_OK);
            CHECK(gmlake_n_pool_release(0, id) == GMLAKE_N_OK);
          }
          break;
        case 2:
          status = gmlake_n_pool_end(0, id);
          if (known && pools[i].routes > 0 && pools[i].uses > 0) {
            CHECK(status == GMLAKE_N_OK);
            --pools[i].routes;
          } else {
            CHECK(status == GMLAKE_N_INVALID);
          }
          break;
        case 3:
          status = gmlake_n_pool_release(0, id);
          if (known && pools[i].uses > 0) {
            CHECK(status == GMLAKE_N_OK);
            if (--pools[i].uses == 0) {  // the last use: its allocations join the shared pool
              pools[i].routes = 0;
              ++pools[i].generation;
            }
          } else {
            CHECK(status == GMLAKE_N_INVALID);
          }
          break;
        default: {
          int count = -1;
          status = gmlake_n_pool_use_count(0, id, rng.chance(10) ? nullptr : &count);
          if (status == GMLAKE_N_OK && known) CHECK(count == pools[i].uses);
          if (status == GMLAKE_N_OK && !known) CHECK(count == 0);
          break;
        }
      }
      CHECK(documented(status));
    } else if (kind < 78) {  // malloc_at of random ranges
      int pool = random_pool();
      gmlake_n_pool_id id = pool >= 0 ? pools[static_cast<size_t>(pool)].id
                                      : (pool == -1 ? SHARED : unknown);
      uint64_t at = 0;
      size_t size = random_size();
      switch (rng.below(4)) {
        case 0: if (!freed.empty()) at = freed[rng.below(freed.size())]; break;
        case 1: if (!model.empty()) at = random_live()->first; break;
        case 2: if (!freed.empty()) at = freed[rng.below(freed.size())] + 512 * rng.below(64); break;
        default: at = rng.next(); break;
      }
      if (rng.chance(5)) size = 0;
      status = gmlake_n_malloc_at(0, reinterpret_cast<void*>(at), size, streams[rng.below(4)], id);
      CHECK(documented(status));
      bool closed = pool >= 0 && pools[static_cast<size_t>(pool)].uses == 0;
      if (pool == -2 || closed || size == 0 || model.count(at) != 0) {
        CHECK(status == GMLAKE_N_INVALID);
      } else {
        CHECK(status == GMLAKE_N_OK || status == GMLAKE_N_INVALID ||
              status == GMLAKE_N_OUT_OF_MEMORY);
      }
      if (status == GMLAKE_N_OK) add(reinterpret_cast<void*>(at), pool, size);
    } else if (kind < 81) {
      Snapshot snap = snapshot(0);
      for (const auto& s : snap.segments) {
        bool ours = same(s.info.pool, SHARED);
        for (const auto& p : pools) ours = ours || same(s.info.pool, p.id);
        CHECK(ours);
        uint64_t sum = 0;
        for (const auto& b : s.blocks) sum += b.size;
        CHECK(sum == s.info.total_size);
      }
    } else if (kind < 84) {
      glake_stats s;
      status = gmlake_n_stats(rng.chance(80) ? 0 : static_cast<int>(rng.below(1000)) - 500, &s);
      CHECK(documented(status));
    } else if (kind < 87) {
      status = gmlake_n_empty_cache(rng.chance(80) ? 0 : -1);
      CHECK(status == GMLAKE_N_OK);
    } else if (kind < 92) {  // memory fractions in and out of [0, 1]
      const double values[] = {1.0, 0.5, 0.9, 0.0, -0.5, 1.5, std::nan(""), 1e300, -0.0, 1.0};
      double f = values[rng.below(10)];
      status = gmlake_n_set_memory_fraction(0, f);
      if (f >= 0.0 && f <= 1.0) {
        CHECK(status == GMLAKE_N_OK);
      } else {
        CHECK(status == GMLAKE_N_INVALID);
      }
      double got = -1;
      CHECK(gmlake_n_memory_fraction(0, &got) == GMLAKE_N_OK);
      if (status == GMLAKE_N_OK) CHECK(got == f);
      if (rng.chance(50)) CHECK(gmlake_n_set_memory_fraction(0, 1.0) == GMLAKE_N_OK);
    } else if (kind < 96) {  // events with recording on and off
      gmlake_n_record_events(static_cast<int>(rng.below(2)));
      for (const auto& e : take()) {
        CHECK(e.kind == GMLAKE_N_SEGMENT_ALLOC || e.kind == GMLAKE_N_SEGMENT_FREE);
        CHECK(e.device == 0);
      }
    } else {  // base of live, interior and bad pointers
      void* base = nullptr;
      size_t size = 0;
      if (!model.empty()) {
        auto it = random_live();
        status = gmlake_n_base(reinterpret_cast<void*>(it->first + rng.below(it->second.size)),
                               &base, &size);
        CHECK(status == GMLAKE_N_OK);
        CHECK(addr(base) == it->first && size == it->second.size);
      }
      uint64_t at = rng.next() | 1;
      auto after = model.upper_bound(at);
      bool inside = after != model.begin() && at < std::prev(after)->first + std::prev(after)->second.size;
      if (!inside) CHECK(gmlake_n_base(reinterpret_cast<void*>(at), &base, &size) == GMLAKE_N_INVALID);
    }
    check_model(op);
    if (op % 50 == 0) check_pools();
    if (failures - before > 20) break;  // enough to go on
  }
  check_pools();

  // Everything back: allocations freed, pools closed, the cache emptied.
  gmlake_n_record_events(0);
  take();
  for (const auto& [at, l] : model) CHECK(gmlake_n_free(reinterpret_cast<void*>(at), -1, nullptr) == GMLAKE_N_OK);
  model.clear();
  for (auto& p : pools) {
    for (; p.routes > 0; --p.routes) CHECK(gmlake_n_pool_end(0, p.id) == GMLAKE_N_OK);
    for (; p.uses > 0; --p.uses) CHECK(gmlake_n_pool_release(0, p.id) == GMLAKE_N_OK);
  }
  CHECK(gmlake_n_set_memory_fraction(0, 1.0) == GMLAKE_N_OK);
  CHECK(gmlake_n_empty_cache(0) == GMLAKE_N_OK);
  glake_stats end = stats(0);
  CHECK(end.allocated_bytes.all.current == 0);
  CHECK(end.allocation.all.current == 0);
  CHECK(end.segment.all.current == 0);
  CHECK(end.reserved_bytes.all.current == 0);
  CHECK(snapshot(0).segments.empty());
}

// A pool lent on out-of-memory serves from its cached blocks alone and counts no
// out-of-memory when none fits; a caller served that way takes back the one its failed request
// counted.
static void lent_pools() {
  const gmlake_n_pool_id lender{11, 0};
  CHECK(gmlake_n_pool_retain(0, lender) == GMLAKE_N_OK);
  CHECK(gmlake_n_pool_begin(0, lender) == GMLAKE_N_OK);
  void* cached = nullptr;
  CHECK(gmlake_n_malloc(0, 8 * MiB, 8 * MiB, nullptr, lender, &cached, nullptr) == GMLAKE_N_OK);
  CHECK(gmlake_n_pool_end(0, lender) == GMLAKE_N_OK);
  release(cached);
  const glake_stats before = stats(0);
  void* p = reinterpret_cast<void*>(0x1);
  CHECK(gmlake_n_malloc_cached(0, 16 * MiB, 16 * MiB, nullptr, lender, &p) ==
        GMLAKE_N_OUT_OF_MEMORY);
  CHECK(p == reinterpret_cast<void*>(0x1));
  CHECK(gmlake_n_malloc_cached(0, 4 * MiB, 5 * MiB, nullptr, lender, &p) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_malloc_cached(0, 4 * MiB, 4 * MiB, nullptr, lender, nullptr) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_malloc_cached(0, 4 * MiB, 4 * MiB, nullptr, gmlake_n_pool_id{12, 0}, &p) ==
        GMLAKE_N_INVALID);  // not open
  glake_stats now = stats(0);
  CHECK(now.num_ooms == before.num_ooms);
  CHECK(now.reserved_bytes.all.current == before.reserved_bytes.all.current);
  CHECK(gmlake_n_malloc_cached(0, 6 * MiB, 5 * MiB, nullptr, lender, &p) == GMLAKE_N_OK);
  CHECK(p == cached);
  now = stats(0);
  CHECK(now.requested_bytes.all.current == before.requested_bytes.all.current + 5 * MiB);
  CHECK(now.reserved_bytes.all.current == before.reserved_bytes.all.current);  // nothing made
  release(p);

  CHECK(gmlake_n_set_memory_fraction(0, 1.0 / 64) == GMLAKE_N_OK);  // 16 MiB of 1 GiB
  void* q = nullptr;
  CHECK(gmlake_n_malloc(0, 32 * MiB, 32 * MiB, nullptr, SHARED, &q, nullptr) ==
        GMLAKE_N_OUT_OF_MEMORY);
  CHECK(stats(0).num_ooms == before.num_ooms + 1);
  CHECK(gmlake_n_uncount_oom(0) == GMLAKE_N_OK);
  CHECK(stats(0).num_ooms == before.num_ooms);
  CHECK(gmlake_n_uncount_oom(64) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_malloc_cached(64, 4 * MiB, 4 * MiB, nullptr, SHARED, &q) == GMLAKE_N_INVALID);
  CHECK(gmlake_n_set_memory_fraction(0, 1.0) == GMLAKE_N_OK);
  CHECK(gmlake_n_pool_release(0, lender) == GMLAKE_N_OK);  // the capture's use
  CHECK(gmlake_n_pool_release(0, lender) == GMLAKE_N_OK);  // the pool's own
  CHECK(gmlake_n_empty_cache(0) == GMLAKE_N_OK);
  CHECK(stats(0).reserved_bytes.all.current == 0);
}

static void soak() {
  long ops = 3000;
  if (const char* text = std::getenv("GLAKE_SOAK_OPS")) ops = std::atol(text);
  for (uint64_t seed = 1; seed <= 3; ++seed) soak_seed(seed, ops);
}

int main(int argc, char** argv) {
  const struct {
    const char* name;
    void (*run)();
  } scenarios[] = {
      {"round_trip", round_trip},
      {"out_of_memory", out_of_memory},
      {"outside_memory", outside_memory},
      {"invalid_pointers", invalid_pointers},
      {"private_pools", private_pools},
      {"segment_events", segment_events},
      {"stats_match_snapshot", stats_match_snapshot},
      {"stitched", stitched},
      {"malloc_at", malloc_at},
      {"lent_pools", lent_pools},
      {"soak", soak},
  };
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s SCENARIO\n", argv[0]);
    return 2;
  }
  for (const auto& scenario : scenarios) {
    if (std::strcmp(scenario.name, argv[1]) == 0) {
      scenario.run();
      if (failures == 0) std::printf("%s passed\n", scenario.name);
      return failures == 0 ? 0 : 1;
    }
  }
  std::fprintf(stderr, "unknown scenario %s\n", argv[1]);
  return 2;
}
