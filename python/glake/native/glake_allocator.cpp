// glake as PyTorch's CUDA allocator through PyTorch's own C++ interface
// (c10::cuda::CUDACachingAllocator::CUDAAllocator), so that every tool PyTorch builds on that
// interface works: typed out-of-memory errors, memory history and snapshots, memory pools,
// CUDA graph pools, observers, statistics. Compiled against the installed torch (the interface
// is not ABI-stable across versions) by glake/native/__init__.py, and linked to libgmlake.so,
// which holds the pools (gmlake_native.h). What PyTorch keeps per allocation for its tools
// (stacks, history, pool routing by stream filter) lives here; the memory lives in glake.
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <c10/util/env.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <limits>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "gmlake_native.h"
#include "own_allocator_pools.h"

namespace glake_native {
namespace {

using c10::CachingAllocator::format_size;
using c10::CachingDeviceAllocator::AnnotationEntry;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::TraceEntry;
using namespace c10::cuda::CUDACachingAllocator;
using c10::MempoolId_t;

constexpr MempoolId_t kNoPool{0, 0};

gmlake_n_pool_id to_c(MempoolId_t id) { return gmlake_n_pool_id{id.first, id.second}; }
MempoolId_t from_c(gmlake_n_pool_id id) { return {id.first, id.second}; }

std::string last_error() {
  const char* text = gmlake_last_error();
  return text != nullptr ? std::string(text) : std::string();
}

// Throws the failure of a libgmlake call as PyTorch's error.
void check(int status, const char* what) {
  TORCH_CHECK(status == GMLAKE_N_OK, "glake: ", what, " failed: ", last_error());
}

void copy_stat(c10::CachingAllocator::Stat& to, const glake_stat& from) {
  to.current = from.current;
  to.peak = from.peak;
  to.allocated = from.allocated;
  to.freed = from.freed;
}

void copy_array(c10::CachingAllocator::StatArray& to, const glake_stat_array& from) {
  using c10::CachingAllocator::StatType;
  copy_stat(to[static_cast<size_t>(StatType::AGGREGATE)], from.all);
  copy_stat(to[static_cast<size_t>(StatType::SMALL_POOL)], from.small_pool);
  copy_stat(to[static_cast<size_t>(StatType::LARGE_POOL)], from.large_pool);
}

glake_stats read_stats(c10::DeviceIndex device) {
  glake_stats stats{};
  check(gmlake_n_stats(device, &stats), "reading statistics");
  return stats;
}

// What PyTorch's tools keep of one live allocation while history is recorded.
struct LiveRecord {
  size_t size = 0;
  cudaStream_t stream = nullptr;
  MempoolId_t pool = kNoPool;
  std::shared_ptr<c10::GatheredContext> context;
};

// A segment and its blocks as glake reported them.
struct SegmentCopy {
  gmlake_n_segment segment;
  std::vector<gmlake_n_block> blocks;
};

// What a callback from libgmlake gathers. libgmlake is Rust: no exception may pass through it,
// so callbacks catch everything and the caller raises the failure once the call returned.
template <typename T>
struct Collect {
  std::vector<T> items;
  bool failed = false;
  void add(T item) noexcept {
    try {
      items.push_back(std::move(item));
    } catch (...) {
      failed = true;
    }
  }
};

// Reports a failure where nothing may be thrown (deleters, destructors).
void warn_quietly(const char* what, const char* detail) noexcept {
  try {
    TORCH_WARN("glake: ", what, ": ", detail);
  } catch (...) {
  }
}

// One routing of requests into a private pool (a graph capture or a MemPool context).
struct Route {
  MempoolId_t pool;
  std::function<bool(cudaStream_t)> filter;
};

// A graph pool's live allocations, kept by CUDA graph trees to restore a path later.
struct PoolState final : AllocatorState {
  struct Allocation {
    void* ptr;
    size_t size;
    cudaStream_t stream;
  };
  MempoolId_t pool;
  std::vector<Allocation> live;
};

// A bounded history of trace entries for one device (oldest dropped first).
class TraceRing {
 public:
  void insert(TraceEntry entry, size_t max_entries) {
    if (max_entries == 0) {
      return;
    }
    entries_.push_back(std::move(entry));
    while (entries_.size() > max_entries) {
      entries_.pop_front();
    }
  }
  void clear() { entries_.clear(); }
  std::vector<TraceEntry> copy() const { return {entries_.begin(), entries_.end()}; }

 private:
  std::deque<TraceEntry> entries_;
};

void raw_delete_fn(void* ptr);

class GlakeAllocator final : public CUDAAllocator {
 public:
  GlakeAllocator() {
    const auto no_caching = c10::utils::get_env("PYTORCH_NO_CUDA_MEMORY_CACHING");
    force_uncached_ = no_caching.has_value() && *no_caching != "0";
  }

  // ---- allocation --------------------------------------------------------------------------

  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    void* ptr = nullptr;
    if (size != 0) {
      ptr = malloc_on(device, size, c10::cuda::getCurrentCUDAStream(device).stream());
    }
    return {ptr, ptr, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete_fn; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  void* raw_alloc(size_t nbytes) override {
    if (nbytes == 0) {
      return nullptr;
    }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc_on(device, nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) {
      return nullptr;
    }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc_on(device, nbytes, stream);
  }

  void raw_delete(void* ptr) override { free_ptr(ptr); }

  // The memory of a request on `device` for `stream`: from the private pool a routing selects,
  // from a pool's own allocator, straight from the driver when caching is off, else glake's.
  void* malloc_on(c10::DeviceIndex device, size_t size, cudaStream_t stream) {
    MempoolId_t pool = kNoPool;
    if (routings_.load(std::memory_order_acquire) > 0) {
      pool = route_of(device, stream);
      if (auto other = pool_allocator(pool)) {
        bool full = false;
        void* ptr =
            own_pools_.malloc(device, pool, other, rounded_by_settings(size), stream, &full);
        if (full) {
          auto context = tracing_.load(std::memory_order_acquire)
                             ? gather(RecordContext::STATE)
                             : nullptr;
          out_of_memory(device, size, stream, pool, context);
        }
        return ptr;
      }
    }
    if (force_uncached_ || !enabled_.load(std::memory_order_relaxed)) {
      return malloc_uncached(device, size);
    }
    // PyTorch's own words for sizes no device has.
    TORCH_CHECK_WITH(OutOfMemoryError, size < (size_t{1} << 60),
                     "CUDA out of memory. Tried to allocate more than 1EB memory.");
    const size_t asked = size;
    size = rounded_by_settings(size);
    const bool tracing = tracing_.load(std::memory_order_acquire);
    std::shared_ptr<c10::GatheredContext> context;
    if (tracing) {
      context = gather(RecordContext::STATE);
    }
    void* ptr = nullptr;
    uint32_t stitched = 0;
    int status = gmlake_n_malloc(device, size, asked, stream, to_c(pool), &ptr,
                                 tracing ? &stitched : nullptr);
    // As in PyTorch, a request routed to a private pool (a graph being captured, a MemPool in
    // use) does not borrow from the pools marked for out-of-memory use: memory of another pool
    // would end up in that graph or pool without either knowing it.
    if (status == GMLAKE_N_OUT_OF_MEMORY && pool == kNoPool) {
      status = malloc_from_oom_pools(device, size, asked, stream, &ptr);
      if (status == GMLAKE_N_OK) {
        // Served after all: PyTorch counts no out-of-memory then.
        (void)gmlake_n_uncount_oom(device);
      }
    }
    if (status == GMLAKE_N_OUT_OF_MEMORY) {
      if (tracing) {
        take_segment_events(context);
      }
      out_of_memory(device, asked, stream, pool, context);
    }
    check(status, "allocation");
    if (tracing) {
      // The memory is the caller's now: a failure to record it is reported, not thrown.
      try {
        take_segment_events(context);
        after_malloc(device, ptr, size, stream, pool, stitched, std::move(context));
      } catch (const std::exception& e) {
        warn_quietly("recording memory history failed", e.what());
      }
    }
    if (c10::memoryProfilingEnabled()) {
      report_to_profiler(device, ptr, static_cast<int64_t>(block_size(ptr, size)));
    }
    return ptr;
  }

  void free_ptr(void* ptr) {
    if (ptr == nullptr) {
      return;
    }
    if (special_count_.load(std::memory_order_acquire) > 0 && free_special(ptr)) {
      return;
    }
    if (own_pools_.any() && own_pools_.free(ptr)) {
      return;
    }
    const bool tracing = tracing_.load(std::memory_order_acquire);
    const bool profiling = c10::memoryProfilingEnabled();
    // While history is recorded the allocation's record has its size; otherwise ask glake.
    // The profiler is told the bytes handed out, on both sides, as PyTorch tells it.
    LiveRecord rec;
    const bool known = tracing && take_live(ptr, &rec);
    const bool unrecorded = tracing && !known;
    const size_t size = profiling || unrecorded ? block_size(ptr, 0) : 0;
    if (unrecorded) {
      rec.size = size;
    }
    int device = -1;
    int status = gmlake_n_free(ptr, -1, &device);
    if (status != GMLAKE_N_OK) {
      // Deleters run in destructors: a stray pointer is reported, never thrown.
      TORCH_WARN("glake: free of ", ptr, " failed: ", last_error());
      return;
    }
    if (tracing) {
      try {
        record_free(device, ptr, std::move(rec));
      } catch (const std::exception& e) {
        warn_quietly("recording memory history failed", e.what());
      } catch (...) {
        warn_quietly("recording memory history failed", "unknown error");
      }
    }
    if (profiling) {
      report_to_profiler(static_cast<c10::DeviceIndex>(device), ptr, -static_cast<int64_t>(size));
    }
  }

  // The bytes glake handed out for the allocation at `ptr` (its size rounded to the pool's
  // unit), or `otherwise` when glake does not know it.
  static size_t block_size(void* ptr, size_t otherwise) {
    void* base = nullptr;
    size_t size = 0;
    return gmlake_n_base(ptr, &base, &size) == GMLAKE_N_OK ? size : otherwise;
  }

  // ---- setup and caching ------------------------------------------------------------------

  void init(int device_count) override {
    apply_pytorch_settings();
    std::lock_guard<std::mutex> lock(mutex_);
    device_count_ = device_count;
    traces_.resize(static_cast<size_t>(std::max(device_count, 1)));
    routes_.resize(static_cast<size_t>(std::max(device_count, 1)));
    initialized_ = true;
  }

  bool initialized() override { return initialized_; }

  void enable(bool value) override { enabled_.store(value); }
  bool isEnabled() const override { return enabled_.load(); }

  void emptyCache(MempoolId_t mempool_id) override {
    // A pool's own cache: glake hands a released pool's segments to the shared cache, where
    // the next empty_cache() returns them; until then nothing is pool-only. PyTorch calls this
    // from MemPool's destructor, so it does nothing and never throws.
    if (mempool_id != kNoPool) {
      own_pools_.release_idle_of(mempool_id);
      return;
    }
    own_pools_.release_idle_of_released();
    // Segments of pools still in use stay; every other unused segment goes to the driver.
    const bool tracing = tracing_.load(std::memory_order_acquire);
    auto context = tracing ? gather(RecordContext::ALL) : nullptr;
    check(gmlake_n_empty_cache(-1), "empty_cache");
    if (tracing) {
      try {
        take_segment_events(context);
      } catch (const std::exception& e) {
        warn_quietly("recording memory history failed", e.what());
      }
    }
  }

  // The largest block a caller (cuDNN sizing its workspace) may ask for without waiting: as in
  // PyTorch, the device's free memory when the caller has no estimate (within glake's cap),
  // and at least the largest cached free block.
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override {
    if (largest_block == nullptr) {
      return;
    }
    size_t largest = *largest_block;
    if (largest == 0) {
      size_t free = 0;
      size_t total = 0;
      c10::cuda::CUDAGuard guard(device);
      if (cudaMemGetInfo(&free, &total) == cudaSuccess) {
        largest = std::min(free, allowance(device, total));
      } else {
        (void)cudaGetLastError();
      }
    }
    for (const auto& c : snapshot_device(device)) {
      for (const auto& b : c.blocks) {
        if (b.state == GMLAKE_N_BLOCK_FREE) {
          largest = std::max<size_t>(largest, b.size);
        }
      }
    }
    *largest_block = largest;
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    void* base = nullptr;
    size_t bytes = 0;
    check(gmlake_n_base(ptr, &base, &bytes), "finding the allocation of a pointer");
    if (size != nullptr) {
      *size = bytes;
    }
    return base;
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // Memory that is not glake's (foreign deleters, empty tensors) needs nothing.
    if (ptr.get() == nullptr || ptr.get_deleter() != &raw_delete_fn) {
      return;
    }
    if (special_count_.load(std::memory_order_acquire) > 0 && is_special(ptr.get())) {
      return;
    }
    if (own_pools_.any() && own_pools_.record_stream(ptr.get(), stream.stream())) {
      return;
    }
    check(gmlake_n_record_stream(ptr.get(), stream.stream()), "record_stream");
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    double fraction = 1.0;
    check(gmlake_n_memory_fraction(device, &fraction), "reading the memory fraction");
    return fraction;
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "invalid fraction:", fraction,
                ". Please set within [0, 1].");
    check(gmlake_n_set_memory_fraction(device, fraction), "setting the memory fraction");
  }

  std::vector<StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};  // glake has no expandable segments: stitching takes their place.
  }

  // ---- statistics ---------------------------------------------------------------------------

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    const glake_stats s = read_stats(device);
    DeviceStats out;
    copy_array(out.allocation, s.allocation);
    copy_array(out.segment, s.segment);
    copy_array(out.active, s.active);
    copy_array(out.inactive_split, s.inactive_split);
    copy_array(out.allocated_bytes, s.allocated_bytes);
    copy_array(out.reserved_bytes, s.reserved_bytes);
    copy_array(out.active_bytes, s.active_bytes);
    copy_array(out.inactive_split_bytes, s.inactive_split_bytes);
    copy_array(out.requested_bytes, s.requested_bytes);
    out.num_alloc_retries = s.num_alloc_retries;
    out.num_ooms = s.num_ooms;
    out.num_sync_all_streams = s.num_sync_all_streams;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    // Memory pools' own allocators' segments are reserved memory too, as PyTorch counts them.
    if (own_pools_.any()) {
      using c10::CachingAllocator::StatType;
      const auto [count, bytes] = own_pools_.reserved_on(device);
      for (auto type : {StatType::AGGREGATE, StatType::LARGE_POOL}) {
        auto& reserved = out.reserved_bytes[static_cast<size_t>(type)];
        reserved.current += static_cast<int64_t>(bytes);
        reserved.peak = std::max(reserved.peak, reserved.current);
        auto& segments = out.segment[static_cast<size_t>(type)];
        segments.current += static_cast<int64_t>(count);
        segments.peak = std::max(segments.peak, segments.current);
      }
    }
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    gmlake_reset_accumulated_stats(device);
  }

  void resetPeakStats(c10::DeviceIndex device) override { gmlake_reset_peak_stats(device); }

  // ---- snapshots and history ---------------------------------------------------------------

  SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    SnapshotInfo result;
    const int devices = device_count();
    std::vector<std::pair<int, SegmentCopy>> copies;
    for (int d = 0; d < devices; ++d) {
      for (auto& c : snapshot_device(static_cast<c10::DeviceIndex>(d))) {
        if (mempool_id == kNoPool || from_c(c.segment.pool) == mempool_id) {
          copies.emplace_back(d, std::move(c));
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& [device, copy] : copies) {
        result.segments.push_back(segment_info(device, copy));
      }
      if (include_traces) {
        auto to_unix = clock_.makeConverter();
        result.device_traces.reserve(traces_.size());
        for (const auto& ring : traces_) {
          auto entries = ring.copy();
          for (auto& e : entries) {
            e.time_.t_ = to_unix(e.time_.approx_t_) / 1000;
          }
          result.device_traces.push_back(std::move(entries));
        }
        result.external_annotations.assign(annotations_.begin(), annotations_.end());
        for (auto& a : result.external_annotations) {
          a.time_.t_ = to_unix(a.time_.approx_t_) / 1000;
        }
      }
    }
    // The one trace list per device PyTorch's converters expect, even for unused devices.
    if (result.device_traces.size() < static_cast<size_t>(devices)) {
      result.device_traces.resize(static_cast<size_t>(devices));
    }
    auto& config = result.config_metadata;
    config.garbage_collection_threshold = 0.0;
    config.max_split_size = SIZE_MAX;
    config.pinned_num_register_threads = CUDAAllocatorConfig::pinned_num_register_threads();
    config.expandable_segments = false;
    config.release_lock_on_malloc = false;
    config.pinned_use_host_register = CUDAAllocatorConfig::pinned_use_cuda_host_register();
    config.graph_capture_record_stream_reuse = false;
    config.last_allocator_settings = c10::CachingAllocator::AcceleratorAllocatorConfig::last_allocator_settings();
    return result;
  }

  bool isHistoryEnabled() override { return record_history_.load(); }

  void recordHistory(bool enabled, CreateContextFn context_recorder, size_t max_entries,
                     RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override {
    TORCH_CHECK(when == RecordContext::NEVER || context_recorder != nullptr,
                "glake: recording stacks needs a context recorder");
    std::unordered_set<TraceEntry::Action> skip;  // parsed first: a bad name changes nothing
    for (const auto& name : skip_actions) {
      skip.insert(c10::CachingDeviceAllocator::parseTraceEntryAction(name));
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      record_history_.store(enabled);
      recorder_ = enabled ? context_recorder : nullptr;
      record_when_ = enabled ? when : RecordContext::NEVER;
      max_entries_ = max_entries;
      skip_ = std::move(skip);
      if (!enabled || clear_history) {
        for (auto& ring : traces_) {
          ring.clear();
        }
        annotations_.clear();
      }
      if (!enabled) {
        live_.clear();
      }
    }
    update_tracing();
  }

  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (!record_history_.load()) {
      return;
    }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    AnnotationEntry entry(device, c10::getApproximateTime());
    for (const auto& [name, value] : md) {
      entry.recordUserMetadata(name, value);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    annotations_.push_back(std::move(entry));
    while (annotations_.size() > max_entries_) {  // bounded like the history
      annotations_.pop_front();
    }
  }

  void pushCompileContext(std::string& md) override {
    std::lock_guard<std::mutex> lock(mutex_);
    compile_contexts_.push_back(md);
  }

  void popCompileContext() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!compile_contexts_.empty()) {
      compile_contexts_.pop_back();
    }
  }

  void setUserMetadata(const std::string& metadata) override {
    std::lock_guard<std::mutex> lock(mutex_);
    user_metadata_ = metadata;
  }

  std::string getUserMetadata() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return user_metadata_;
  }

  void attachOutOfMemoryObserver(OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(mutex_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(AllocatorTraceTracker tracker) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      trackers_.push_back(std::move(tracker));
    }
    update_tracing();
  }

  // ---- private pools (MemPool, CUDA graphs) --------------------------------------------------

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    check(gmlake_n_pool_begin(device, to_c(mempool_id)), "routing to a memory pool");
    std::lock_guard<std::mutex> lock(mutex_);
    routes_of(device).push_back(Route{mempool_id, std::move(filter)});
    routings_.fetch_add(1, std::memory_order_acq_rel);
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& routes = routes_of(device);
      auto it = std::find_if(routes.rbegin(), routes.rend(),
                             [&](const Route& r) { return r.pool == mempool_id; });
      TORCH_CHECK(it != routes.rend(), "glake: not allocating to pool (", mempool_id.first, ", ",
                  mempool_id.second, ")");
      routes.erase(std::next(it).base());
      routings_.fetch_sub(1, std::memory_order_acq_rel);
    }
    check(gmlake_n_pool_end(device, to_c(mempool_id)), "ending a routing to a memory pool");
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    // Called from destructors: failures are reported, not thrown.
    if (gmlake_n_pool_release(device, to_c(mempool_id)) != GMLAKE_N_OK) {
      TORCH_WARN("glake: releasing memory pool (", mempool_id.first, ", ", mempool_id.second,
                 ") failed: ", last_error());
    }
    int uses = 0;
    if (gmlake_n_pool_use_count(device, to_c(mempool_id), &uses) == GMLAKE_N_OK && uses == 0) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        pool_allocators_.erase(mempool_id);
        oom_pools_.erase(mempool_id);
      }
      own_pools_.forget(mempool_id);
    }
  }

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<CUDAAllocator> allocator) override {
    check(gmlake_n_pool_retain(device, to_c(mempool_id)), "creating a memory pool");
    if (allocator && allocator.get() != this) {
      std::lock_guard<std::mutex> lock(mutex_);
      pool_allocators_[mempool_id] = std::move(allocator);
    }
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    int uses = 0;
    check(gmlake_n_pool_use_count(device, to_c(mempool_id), &uses), "reading a pool's uses");
    return uses;
  }

  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (use_on_oom) {
      oom_pools_[mempool_id] = device;
    } else {
      oom_pools_.erase(mempool_id);
    }
  }

  void setNoSplit(c10::DeviceIndex, MempoolId_t) override {
    // glake hands out large blocks whole and stitches instead of splitting them further; a
    // pool that asks not to split needs nothing more.
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected) override {
    std::vector<void*> found;
    if (!pool_live(device, mempool_id, &found)) {
      return expected.empty();
    }
    return std::unordered_set<void*>(found.begin(), found.end()) == expected;
  }

  std::shared_ptr<AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                     MempoolId_t id) override {
    auto state = std::make_shared<PoolState>();
    state->pool = id;
    for (const auto& copy : snapshot_device(device)) {
      if (from_c(copy.segment.pool) != id) {
        continue;
      }
      for (const auto& b : copy.blocks) {
        if (b.state == GMLAKE_N_BLOCK_ALLOCATED) {
          state->live.push_back({reinterpret_cast<void*>(b.address), b.size,
                                 reinterpret_cast<cudaStream_t>(b.stream)});
        }
      }
    }
    return state;
  }

  // Brings graph pool `pps->pool` back to the checkpoint: allocations made since are freed,
  // allocations freed since come back at their own addresses (PyTorch hands them to the
  // tensors of the graph tree's path).
  CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                         std::shared_ptr<AllocatorState> pps) override {
    auto* state = dynamic_cast<PoolState*>(pps.get());
    TORCH_CHECK(state != nullptr, "glake: not a glake graph pool checkpoint");
    std::vector<void*> live;
    TORCH_CHECK(pool_live(device, state->pool, &live), "glake: reading a graph pool failed: ",
                last_error());
    std::unordered_set<void*> wanted;
    for (const auto& a : state->live) {
      wanted.insert(a.ptr);
    }
    CheckpointDelta delta;
    for (void* ptr : live) {
      if (wanted.count(ptr) == 0) {
        free_ptr(ptr);
        delta.ptrs_freed.push_back(ptr);
      }
    }
    const std::unordered_set<void*> still(live.begin(), live.end());
    for (const auto& a : state->live) {
      if (still.count(a.ptr) != 0) {
        continue;
      }
      check(gmlake_n_malloc_at(device, a.ptr, a.size, a.stream, to_c(state->pool)),
            "restoring a CUDA graph pool checkpoint");
      delta.dataptrs_allocd.emplace_back(a.ptr, a.ptr, &raw_delete_fn,
                                         c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // ---- the rest of the interface ----------------------------------------------------------

  ShareableHandle shareIpcHandle(void*) override {
    TORCH_CHECK(false,
                "glake: sharing CUDA tensors between processes (IPC) is not supported by glake's "
                "allocator yet");
  }

  std::shared_ptr<void> getIpcDevPtr(std::string) override {
    TORCH_CHECK(false,
                "glake: opening CUDA tensors of another process (IPC) is not supported by "
                "glake's allocator yet");
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    // glake maps each device's memory for every peer that can reach it when its pool is made;
    // runtime peer access still matters for memory from elsewhere.
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return;
    }
    C10_CUDA_CHECK(err);
  }

  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }

  std::string name() override { return "glake"; }

 private:
  // PyTorch's roundup_power2_divisions (PYTORCH_CUDA_ALLOC_CONF or _set_allocator_settings,
  // read at each request since it may change at run time): the size of a request in an
  // interval with N > 1 divisions goes up to the next of N equal steps between the powers of
  // two around it, as PyTorch's own allocator hands it out. glake needs no such rounding
  // against fragmentation; a user who sets it gets the sizes PyTorch documents. The statistics
  // book the bytes asked for as requested.
  static size_t rounded_by_settings(size_t size) {
    constexpr size_t kMinBlock = 512;
    const size_t divisions =
        c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions(size);
    if (divisions <= 1 || size <= kMinBlock * divisions) {
      return size;
    }
    return next_power2_division(size, divisions);
  }

  // The smallest of `divisions` (rounded down to a power of two) equal steps between the
  // powers of two around `size` that holds `size`.
  static size_t next_power2_division(size_t size, size_t divisions) {
    if ((size & (size - 1)) == 0) {
      return size;
    }
    const size_t below = size_t{1} << (63 - __builtin_clzll(size));
    const size_t parts = size_t{1} << (63 - __builtin_clzll(divisions));
    const size_t step = below / parts;
    if (step == 0) {
      return below << 1;
    }
    const size_t down = size & ~(step - 1);
    return down == size ? size : down + step;
  }

  // PYTORCH_CUDA_ALLOC_CONF: the memory fraction becomes glake's (pools are made after
  // init, from the environment); settings that tune PyTorch's own block splitting and segment
  // growth have no counterpart in glake and are named once as ignored.
  static void apply_pytorch_settings() {
    using Config = c10::CachingAllocator::AcceleratorAllocatorConfig;
    const double fraction = CUDAAllocatorConfig::per_process_memory_fraction();
    if (fraction < 1.0 && !c10::utils::get_env("GLAKE_MEMORY_FRACTION").has_value()) {
      c10::utils::set_env("GLAKE_MEMORY_FRACTION", std::to_string(fraction).c_str());
    }
    std::vector<std::string> ignored;
    if (Config::max_split_size() != std::numeric_limits<size_t>::max()) {
      ignored.emplace_back("max_split_size_mb");
    }
    if (Config::garbage_collection_threshold() > 0.0) {
      ignored.emplace_back("garbage_collection_threshold");
    }
    if (Config::use_expandable_segments()) {
      ignored.emplace_back("expandable_segments (glake stitches instead)");
    }
    if (!ignored.empty()) {
      std::string names;
      for (const auto& name : ignored) {
        names += (names.empty() ? "" : ", ") + name;
      }
      TORCH_WARN_ONCE("glake: PYTORCH_CUDA_ALLOC_CONF settings of PyTorch's own allocator are "
                      "ignored: ",
                      names);
    }
  }

  int device_count() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (device_count_ > 0) {
      return device_count_;
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return count;
  }

  // The live allocations of private pool `id`; false when the pool is not open.
  bool pool_live(c10::DeviceIndex device, MempoolId_t id, std::vector<void*>* out) {
    Collect<void*> found;
    const int status = gmlake_n_pool_live(device, to_c(id), &found, [](void* ctx, uint64_t a) {
      static_cast<Collect<void*>*>(ctx)->add(reinterpret_cast<void*>(a));
    });
    TORCH_CHECK(!found.failed, "glake: out of host memory listing a pool's allocations");
    *out = std::move(found.items);
    return status == GMLAKE_N_OK;
  }

  // Bytes `device`'s pool may still create under its memory fraction (of `total`).
  size_t allowance(c10::DeviceIndex device, size_t total) {
    double fraction = 1.0;
    glake_stats stats{};
    if (gmlake_n_device_used(device) != 1 ||
        gmlake_n_memory_fraction(device, &fraction) != GMLAKE_N_OK ||
        gmlake_n_stats(device, &stats) != GMLAKE_N_OK) {
      return total;
    }
    const auto cap = static_cast<size_t>(fraction * static_cast<double>(total));
    const auto reserved = static_cast<size_t>(std::max<int64_t>(stats.reserved_bytes.all.current, 0));
    return cap > reserved ? cap - reserved : 0;
  }

  std::vector<Route>& routes_of(c10::DeviceIndex device) {
    TORCH_CHECK(device >= 0, "glake: invalid device index ", static_cast<int>(device));
    auto index = static_cast<size_t>(device);
    if (routes_.size() <= index) {
      routes_.resize(index + 1);
    }
    return routes_[index];
  }

  MempoolId_t route_of(c10::DeviceIndex device, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& routes = routes_of(device);
    for (auto it = routes.rbegin(); it != routes.rend(); ++it) {
      if (it->filter(stream)) {
        return it->pool;
      }
    }
    return kNoPool;
  }

  std::shared_ptr<CUDAAllocator> pool_allocator(MempoolId_t pool) {
    if (pool == kNoPool) {
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pool_allocators_.find(pool);
    return it == pool_allocators_.end() ? nullptr : it->second;
  }

  // Pointers not from glake's pools: a MemPool's own allocator, or the driver with caching off.
  void remember_foreign(void* ptr, std::shared_ptr<CUDAAllocator> owner) {
    if (ptr == nullptr) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    special_[ptr] = std::move(owner);
    special_count_.store(special_.size(), std::memory_order_release);
  }

  void* malloc_uncached(c10::DeviceIndex device, size_t size) {
    c10::cuda::CUDAGuard guard(device);
    void* ptr = nullptr;
    cudaError_t err = cudaMalloc(&ptr, size);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
                       format_size(size), " (caching disabled). GPU ",
                       static_cast<int>(device));
    }
    C10_CUDA_CHECK(err);
    remember_foreign(ptr, nullptr);
    return ptr;
  }

  bool is_special(void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    return special_.count(ptr) != 0;
  }

  bool free_special(void* ptr) {
    std::shared_ptr<CUDAAllocator> owner;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = special_.find(ptr);
      if (it == special_.end()) {
        return false;
      }
      owner = std::move(it->second);
      special_.erase(it);
      special_count_.store(special_.size(), std::memory_order_release);
    }
    if (owner) {
      owner->raw_delete(ptr);
    } else {
      cudaError_t err = cudaFree(ptr);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        TORCH_WARN("glake: cudaFree of ", ptr, " failed: ", cudaGetErrorString(err));
      }
    }
    return true;
  }

  // Memory pools marked use_on_oom serve a request the shared pool could not, from their cached
  // blocks only, as PyTorch's do.
  int malloc_from_oom_pools(c10::DeviceIndex device, size_t size, size_t asked,
                            cudaStream_t stream, void** ptr) {
    std::vector<MempoolId_t> pools;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& [id, d] : oom_pools_) {
        if (d == device) {
          pools.push_back(id);
        }
      }
    }
    for (const auto& id : pools) {
      if (auto other = pool_allocator(id)) {
        bool full = false;
        *ptr = own_pools_.malloc(device, id, other, size, stream, &full, /*cached_only=*/true);
        if (!full) {
          return GMLAKE_N_OK;
        }
      } else if (gmlake_n_malloc_cached(device, size, asked, stream, to_c(id), ptr) ==
                 GMLAKE_N_OK) {
        return GMLAKE_N_OK;
      }
    }
    return GMLAKE_N_OUT_OF_MEMORY;
  }

  // Throws PyTorch's out-of-memory error, after the observers and the history have seen it.
  [[noreturn]] void out_of_memory(c10::DeviceIndex device, size_t size, cudaStream_t stream,
                                  MempoolId_t pool,
                                  const std::shared_ptr<c10::GatheredContext>& context) {
    const std::string reason = last_error();
    size_t device_free = 0;
    size_t device_total = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) {
        (void)cudaGetLastError();
      }
    }
    glake_stats stats{};
    (void)gmlake_n_stats(device, &stats);
    const auto allocated = static_cast<size_t>(stats.allocated_bytes.all.current);
    const auto reserved = static_cast<size_t>(stats.reserved_bytes.all.current);
    double fraction = 1.0;
    (void)gmlake_n_memory_fraction(device, &fraction);
    const auto allowed = fraction < 1.0
                             ? static_cast<size_t>(fraction * static_cast<double>(device_total))
                             : device_total;
    record(TraceEntry::OOM, device, device_free, size, stream, pool, context);
    c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(size), allocated, reserved,
                                     c10::Device(c10::DeviceType::CUDA, device));
    // As PyTorch's allocator: the request, the memory this process may use, what is free.
    std::vector<OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      observers = oom_observers_;
    }
    for (const auto& observer : observers) {
      observer(device, size, allowed, device_free);
    }
    std::ostringstream limit;
    if (fraction < 1.0) {
      limit << " This process may use " << format_size(allowed)
            << " (set_per_process_memory_fraction or glake's memory limit).";
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
                     format_size(size), ". GPU ", static_cast<int>(device),
                     " has a total capacity of ", format_size(device_total), " of which ",
                     format_size(device_free), " is free.", limit.str(),
                     " Of the allocated memory ", format_size(allocated),
                     " is allocated by PyTorch, and ", format_size(reserved - std::min(reserved, allocated)),
                     " is reserved by PyTorch but unallocated (glake stitches free pieces of it "
                     "into requests when it can). glake: ", reason);
  }

  void report_to_profiler(c10::DeviceIndex device, void* ptr, int64_t delta) {
    glake_stats stats{};
    if (gmlake_n_stats(device, &stats) != GMLAKE_N_OK) {
      return;
    }
    c10::reportMemoryUsageToProfiler(ptr, delta,
                                     static_cast<size_t>(stats.allocated_bytes.all.current),
                                     static_cast<size_t>(stats.reserved_bytes.all.current),
                                     c10::Device(c10::DeviceType::CUDA, device));
  }

  // ---- history -------------------------------------------------------------------------------

  // Tracing (history or trackers) is on: contexts are gathered, segment events collected.
  void update_tracing() {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool on = record_history_.load() || !trackers_.empty();
    tracing_.store(on, std::memory_order_release);
    gmlake_n_record_events(on ? 1 : 0);
  }

  std::shared_ptr<c10::GatheredContext> gather(RecordContext level) {
    if (record_when_.load(std::memory_order_acquire) < level) {
      return nullptr;
    }
    CreateContextFn recorder = recorder_.load(std::memory_order_acquire);
    return recorder != nullptr ? recorder() : nullptr;
  }

  void after_malloc(c10::DeviceIndex device, void* ptr, size_t size, cudaStream_t stream,
                    MempoolId_t pool, uint32_t stitched,
                    std::shared_ptr<c10::GatheredContext> context) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (record_history_.load()) {
        live_[ptr] = LiveRecord{size, stream, pool, context};
      }
    }
    std::string note;
    if (stitched > 0) {
      note = "glake: stitched from " + std::to_string(stitched) + " pieces";
    }
    record(TraceEntry::ALLOC, device, reinterpret_cast<size_t>(ptr), size, stream, pool, context,
           note);
  }

  // Takes the record of live allocation `ptr` kept while history is recorded.
  bool take_live(void* ptr, LiveRecord* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(ptr);
    if (it == live_.end()) {
      return false;
    }
    *out = std::move(it->second);
    live_.erase(it);
    return true;
  }

  void record_free(int device, void* ptr, LiveRecord rec) {
    auto context = gather(RecordContext::ALL);
    if (!context) {
      context = rec.context;
    }
    const auto d = static_cast<c10::DeviceIndex>(std::max(device, 0));
    record(TraceEntry::FREE_REQUESTED, d, reinterpret_cast<size_t>(ptr), rec.size, rec.stream,
           rec.pool, context);
    record(TraceEntry::FREE_COMPLETED, d, reinterpret_cast<size_t>(ptr), rec.size, rec.stream,
           rec.pool, context);
    take_segment_events(context);
  }

  // Turns the segments this thread's last call created or released into trace entries.
  void take_segment_events(const std::shared_ptr<c10::GatheredContext>& context) {
    Collect<gmlake_n_event> events;
    gmlake_n_take_events(&events, [](void* ctx, const gmlake_n_event* e) {
      static_cast<Collect<gmlake_n_event>*>(ctx)->add(*e);
    });
    TORCH_CHECK(!events.failed, "glake: out of host memory recording segment events");
    for (const auto& e : events.items) {
      auto action =
          e.kind == GMLAKE_N_SEGMENT_ALLOC ? TraceEntry::SEGMENT_ALLOC : TraceEntry::SEGMENT_FREE;
      record(action, static_cast<c10::DeviceIndex>(e.device), e.address, e.size, nullptr,
             from_c(e.pool), context);
    }
  }

  void record(TraceEntry::Action action, c10::DeviceIndex device, size_t addr, size_t size,
              cudaStream_t stream, MempoolId_t pool,
              const std::shared_ptr<c10::GatheredContext>& context, const std::string& note = {}) {
    std::vector<AllocatorTraceTracker> trackers;
    std::unique_ptr<TraceEntry> entry;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if ((!record_history_.load() && trackers_.empty()) || skip_.count(action) != 0) {
        return;
      }
      std::string metadata = user_metadata_;
      if (!note.empty()) {
        metadata = metadata.empty() ? note : metadata + "; " + note;
      }
      entry = std::make_unique<TraceEntry>(
          action, device, addr, size, stream, pool, c10::getApproximateTime(),
          record_when_.load() >= RecordContext::ALLOC ? context : nullptr,
          compile_contexts_.empty() ? std::string("N/A") : compile_contexts_.back(), metadata);
      if (record_history_.load()) {
        auto index = static_cast<size_t>(device);
        if (traces_.size() <= index) {
          traces_.resize(index + 1);
        }
        if (trackers_.empty()) {
          traces_[index].insert(std::move(*entry), max_entries_);
          return;
        }
        traces_[index].insert(*entry, max_entries_);
      }
      trackers = trackers_;
    }
    // Trackers may be Python callbacks that allocate: they run outside the lock.
    for (const auto& tracker : trackers) {
      tracker(*entry);
    }
  }

  // ---- snapshots -----------------------------------------------------------------------------

  // One device's segments and blocks, copied out of glake (its callbacks run under the pool's
  // lock, so nothing else happens inside them).
  std::vector<SegmentCopy> snapshot_device(c10::DeviceIndex device) {
    Collect<SegmentCopy> copies;
    if (gmlake_n_device_used(device) != 1) {
      return {};
    }
    check(gmlake_n_snapshot(
              device, &copies,
              [](void* ctx, const gmlake_n_segment* s, const gmlake_n_block* b, size_t n) {
                auto* out = static_cast<Collect<SegmentCopy>*>(ctx);
                try {
                  out->add(SegmentCopy{*s, std::vector<gmlake_n_block>(b, b + n)});
                } catch (...) {
                  out->failed = true;
                }
              },
              [](void*, const gmlake_n_stitched*) {}),
          "taking a snapshot");
    TORCH_CHECK(!copies.failed, "glake: out of host memory taking a snapshot");
    return std::move(copies.items);
  }

  // PyTorch's view of a segment; blocks get the stacks recorded when they were allocated.
  // Called with mutex_ held.
  c10::CachingDeviceAllocator::SegmentInfo segment_info(int device, const SegmentCopy& copy) {
    const auto& seg = copy.segment;
    c10::CachingDeviceAllocator::SegmentInfo info;
    info.device = static_cast<c10::DeviceIndex>(device);
    info.address = seg.address;
    info.total_size = seg.total_size;
    info.requested_size = seg.requested_size;
    info.stream = reinterpret_cast<void*>(seg.stream);
    info.is_large = seg.is_large != 0;
    info.is_expandable = false;
    info.owner_private_pool_id = from_c(seg.pool);
    info.blocks.reserve(copy.blocks.size());
    for (const auto& b : copy.blocks) {
      c10::CachingDeviceAllocator::BlockInfo block;
      block.size = b.size;
      block.requested_size = b.requested_size;
      block.allocated = b.state == GMLAKE_N_BLOCK_ALLOCATED || b.state == GMLAKE_N_BLOCK_STITCHED;
      block.active = b.state != GMLAKE_N_BLOCK_FREE;
      if (block.allocated) {
        info.allocated_size += b.size;
        auto it = live_.find(reinterpret_cast<void*>(b.address));
        if (it != live_.end()) {
          block.context_when_allocated = it->second.context;
        }
      }
      if (block.active) {
        info.active_size += b.size;
      }
      info.blocks.push_back(std::move(block));
    }
    if (!info.blocks.empty()) {
      info.context_when_allocated = info.blocks.front().context_when_allocated;
    }
    return info;
  }

  std::mutex mutex_;
  int device_count_ = 0;
  std::atomic<bool> initialized_{false};
  bool force_uncached_ = false;
  std::atomic<bool> enabled_{true};
  std::atomic<int> routings_{0};
  std::vector<std::vector<Route>> routes_;
  std::unordered_map<MempoolId_t, std::shared_ptr<CUDAAllocator>, c10::MempoolIdHash>
      pool_allocators_;
  std::unordered_map<MempoolId_t, c10::DeviceIndex, c10::MempoolIdHash> oom_pools_;
  std::unordered_map<void*, std::shared_ptr<CUDAAllocator>> special_;
  std::atomic<size_t> special_count_{0};
  OwnAllocatorPools own_pools_;

  std::atomic<bool> tracing_{false};
  std::atomic<bool> record_history_{false};
  std::atomic<CreateContextFn> recorder_{nullptr};
  std::atomic<RecordContext> record_when_{RecordContext::NEVER};
  size_t max_entries_ = 0;
  std::unordered_set<TraceEntry::Action> skip_;
  std::vector<TraceRing> traces_;
  std::deque<AnnotationEntry> annotations_;
  std::unordered_map<void*, LiveRecord> live_;
  std::vector<std::string> compile_contexts_;
  std::string user_metadata_;
  std::vector<OutOfMemoryObserver> oom_observers_;
  std::vector<AllocatorTraceTracker> trackers_;
  c10::ApproximateClockToUnixTimeConverter clock_;
};

std::shared_ptr<GlakeAllocator>& instance() {
  static auto* allocator = new std::shared_ptr<GlakeAllocator>();  // lives for the process
  return *allocator;
}

void raw_delete_fn(void* ptr) {
  if (auto& allocator = instance()) {
    allocator->free_ptr(ptr);
  }
}

}  // namespace
}  // namespace glake_native

extern "C" {

// Makes glake PyTorch's CUDA allocator. 0 on success; otherwise the reason goes to `error`
// (truncated to `length` bytes) and PyTorch's allocator stays.
__attribute__((visibility("default"))) int glake_native_install(char* error, size_t length) {
  try {
    auto& allocator = glake_native::instance();
    if (!allocator) {
      allocator = std::make_shared<glake_native::GlakeAllocator>();
    }
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
    // Device-generic callers (torch.accelerator's memory API) find the CUDA allocator in c10's
    // registry, which the swap above leaves alone.
    c10::SetAllocator(c10::DeviceType::CUDA, allocator.get(), std::numeric_limits<uint8_t>::max());
    return 0;
  } catch (const std::exception& e) {
    if (error != nullptr && length > 0) {
      std::snprintf(error, length, "%s", e.what());
    }
    return 1;
  }
}

// 1 when glake's native allocator is PyTorch's current CUDA allocator.
__attribute__((visibility("default"))) int glake_native_active(void) {
  auto& allocator = glake_native::instance();
  return allocator && c10::cuda::CUDACachingAllocator::get() == allocator.get() ? 1 : 0;
}
}
