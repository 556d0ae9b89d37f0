// GLake C++ API: header-only C++17 RAII wrappers over the C API in glake.h.
// They do nothing the C API cannot do; every failure throws glake::Error, which carries the
// status code and the library's message.
#ifndef GLAKE_HPP
#define GLAKE_HPP

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "glake.h"

namespace glake {

/// A failed call: the status code and the message of glake_last_error_message().
class Error : public std::runtime_error {
 public:
  Error(glake_status status, const std::string& message)
      : std::runtime_error(std::string(glake_status_name(status)) + ": " + message),
        status_(status),
        message_(message) {}
  glake_status status() const noexcept { return status_; }
  const std::string& message() const noexcept { return message_; }

 private:
  glake_status status_;
  std::string message_;
};

/// Throws glake::Error unless `status` is success.
inline void check(glake_status status) {
  if (status != GLAKE_STATUS_SUCCESS) throw Error(status, glake_last_error_message());
}

/// Pool settings, starting from the library's defaults.
struct Config : glake_config {
  Config() : glake_config() { check(glake_config_default(this)); }
  /// Applies the GLAKE_* and GMLake environment variables on top of the fields.
  Config& read_env() {
    flags |= GLAKE_CONFIG_READ_ENV;
    return *this;
  }
  Config& host() {
    backend = GLAKE_BACKEND_HOST;
    return *this;
  }
  Config& cuda(int ordinal = 0) {
    backend = GLAKE_BACKEND_CUDA;
    device = ordinal;
    return *this;
  }
  Config& stitching(bool on) {
    stitch = on ? 1u : 0u;
    return *this;
  }
};

class Pool;

/// Owns one allocation; frees it when destroyed (errors on that path are swallowed, as a
/// destructor cannot throw: call free() to see them).
class Allocation {
 public:
  Allocation() noexcept = default;
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;
  Allocation(Allocation&& other) noexcept { swap(other); }
  Allocation& operator=(Allocation&& other) noexcept {
    if (this != &other) {
      reset();
      swap(other);
    }
    return *this;
  }
  ~Allocation() { reset(); }

  void* get() const noexcept { return ptr_; }
  template <typename T>
  T* as() const noexcept {
    return static_cast<T*>(ptr_);
  }
  std::size_t size() const noexcept { return size_; }
  glake_stream stream() const noexcept { return stream_; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

  /// Also used on `stream`: reuse waits for that stream's work queued before the free.
  void record_stream(glake_stream stream) const { check(glake_record_stream(pool_, ptr_, stream)); }

  /// Frees now, reporting errors.
  void free() {
    if (ptr_ != nullptr) {
      void* ptr = std::exchange(ptr_, nullptr);
      check(glake_free(pool_, ptr));
    }
  }

  /// Gives up ownership without freeing.
  void* release() noexcept { return std::exchange(ptr_, nullptr); }

 private:
  friend class Pool;
  Allocation(glake_pool* pool, void* ptr, std::size_t size, glake_stream stream) noexcept
      : pool_(pool), ptr_(ptr), size_(size), stream_(stream) {}
  void reset() noexcept {
    if (ptr_ != nullptr) (void)glake_free(pool_, std::exchange(ptr_, nullptr));
  }
  void swap(Allocation& other) noexcept {
    std::swap(pool_, other.pool_);
    std::swap(ptr_, other.ptr_);
    std::swap(size_, other.size_);
    std::swap(stream_, other.stream_);
  }

  glake_pool* pool_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t size_ = 0;
  glake_stream stream_ = nullptr;
};

/// Owns a pool; destroying it releases all of its memory.
class Pool {
 public:
  explicit Pool(const Config& config = Config()) { check(glake_pool_create(&config, &pool_)); }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  Pool(Pool&& other) noexcept : pool_(std::exchange(other.pool_, nullptr)) {}
  Pool& operator=(Pool&& other) noexcept {
    if (this != &other) {
      destroy();
      pool_ = std::exchange(other.pool_, nullptr);
    }
    return *this;
  }
  ~Pool() { destroy(); }

  glake_pool* handle() const noexcept { return pool_; }

  glake_backend backend() const {
    uint32_t out = 0;
    check(glake_pool_backend(pool_, &out));
    return static_cast<glake_backend>(out);
  }

  /// An owned allocation of `size` bytes for use on `stream`.
  Allocation allocate(std::size_t size, glake_stream stream = nullptr) {
    return Allocation(pool_, malloc(size, stream), size, stream);
  }
  /// A raw allocation; pair with free().
  void* malloc(std::size_t size, glake_stream stream = nullptr) {
    void* ptr = nullptr;
    check(glake_malloc(pool_, size, stream, &ptr));
    return ptr;
  }
  void free(void* ptr) { check(glake_free(pool_, ptr)); }
  void record_stream(void* ptr, glake_stream stream) { check(glake_record_stream(pool_, ptr, stream)); }

  /// A swappable allocation (memory of its own; pair with free()).
  void* malloc_swappable(std::size_t size, glake_stream stream = nullptr) {
    void* ptr = nullptr;
    check(glake_malloc_swappable(pool_, size, stream, &ptr));
    return ptr;
  }
  /// Waiting swaps: the bytes to host memory and the device memory back, and the reverse.
  void swap_out(void* ptr) { check(glake_swap_out(pool_, ptr)); }
  void swap_in(void* ptr) { check(glake_swap_in(pool_, ptr)); }
  /// Stream-ordered swaps on `copy`; swap_finish() gives back the memory of finished ones.
  void swap_out_async(void* ptr, glake_stream copy) { check(glake_swap_out_async(pool_, ptr, copy)); }
  std::uint64_t swap_finish(bool wait) {
    std::uint64_t completed = 0;
    check(glake_swap_finish(pool_, wait ? 1u : 0u, &completed));
    return completed;
  }
  void swap_in_async(void* ptr, glake_stream copy) { check(glake_swap_in_async(pool_, ptr, copy)); }
  void empty_cache() { check(glake_empty_cache(pool_)); }

  /// Sleep regions: this thread's allocations go to region `name` between begin_region and
  /// end_region (or for the life of a glake::Region); sleep() gives the region's physical
  /// memory back with every address kept, wake() brings it back with the same bytes.
  void begin_region(const std::string& name) { check(glake_region_begin(pool_, name.c_str())); }
  void end_region() { check(glake_region_end(pool_)); }
  void sleep(const std::string& name, glake_sleep_mode mode = GLAKE_SLEEP_KEEP) {
    check(glake_sleep(pool_, name.c_str(), static_cast<std::uint32_t>(mode)));
  }
  void wake(const std::string& name) { check(glake_wake(pool_, name.c_str())); }
  /// Makes the host buffers a first sleep of `name` would make; returns their bytes.
  std::size_t prepare_sleep(const std::string& name) {
    std::size_t bytes = 0;
    check(glake_sleep_prepare(pool_, name.c_str(), &bytes));
    return bytes;
  }
  glake_region_info region_info(const std::string& name) const {
    glake_region_info out{};
    check(glake_get_region_info(pool_, name.c_str(), &out));
    return out;
  }
  void set_memory_fraction(double fraction) { check(glake_set_memory_fraction(pool_, fraction)); }
  void set_memory_limit(std::uint64_t bytes) { check(glake_set_memory_limit(pool_, bytes)); }
  std::uint64_t memory_limit() const {
    std::uint64_t bytes = 0;
    check(glake_get_memory_limit(pool_, &bytes, nullptr));
    return bytes;
  }

  glake_stats stats() const {
    glake_stats out{};
    check(glake_get_stats(pool_, &out));
    return out;
  }
  void reset_peak_stats() { check(glake_reset_peak_stats(pool_)); }
  void reset_accumulated_stats() { check(glake_reset_accumulated_stats(pool_)); }
  std::string snapshot_json() const { return take_string(glake_snapshot_json); }
  std::string stats_json() const { return take_string(glake_stats_json); }

  void copy_to_device(void* dst, const void* src, std::size_t size, glake_stream stream = nullptr) {
    check(glake_copy_to_device(pool_, dst, src, size, stream));
  }
  void copy_to_host(void* dst, const void* src, std::size_t size, glake_stream stream = nullptr) {
    check(glake_copy_to_host(pool_, dst, src, size, stream));
  }
  void synchronize(glake_stream stream = nullptr) { check(glake_stream_synchronize(pool_, stream)); }

 private:
  void destroy() noexcept {
    if (pool_ != nullptr) (void)glake_pool_destroy(std::exchange(pool_, nullptr));
  }
  std::string take_string(glake_status (*fn)(glake_pool*, char**)) const {
    char* text = nullptr;
    check(fn(pool_, &text));
    std::string out(text);
    glake_string_free(text);
    return out;
  }

  glake_pool* pool_ = nullptr;
};

/// Allocations of this thread from `pool` go to region `name` while this object lives.
class Region {
 public:
  Region(Pool& pool, const std::string& name) : pool_(pool) { pool_.begin_region(name); }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  ~Region() { (void)glake_region_end(pool_.handle()); }

 private:
  Pool& pool_;
};

/// A stream created on a pool's device, destroyed with this object.
class Stream {
 public:
  explicit Stream(Pool& pool) : pool_(pool.handle()) { check(glake_stream_create(pool_, &stream_)); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
    if (stream_ != nullptr) (void)glake_stream_destroy(pool_, stream_);
  }
  glake_stream get() const noexcept { return stream_; }
  operator glake_stream() const noexcept { return stream_; }
  void synchronize() const { check(glake_stream_synchronize(pool_, stream_)); }

 private:
  glake_pool* pool_;
  glake_stream stream_ = nullptr;
};

/// A copy engine of one device (glake_transfer_*): host<->device copies over several lanes and
/// paths, from and to any host memory. Create one per device and keep it.
class Transfer {
 public:
  explicit Transfer(int32_t device = 0, glake_backend backend = GLAKE_BACKEND_AUTO,
                    uint32_t flags = GLAKE_TRANSFER_READ_ENV) {
    check(glake_transfer_create(static_cast<uint32_t>(backend), device, flags, &transfer_));
  }
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;
  Transfer(Transfer&& other) noexcept : transfer_(std::exchange(other.transfer_, nullptr)) {}
  Transfer& operator=(Transfer&& other) noexcept {
    if (this != &other) {
      destroy();
      transfer_ = std::exchange(other.transfer_, nullptr);
    }
    return *this;
  }
  ~Transfer() { destroy(); }

  glake_transfer* handle() const noexcept { return transfer_; }

  /// Host to device; returns when the data has arrived, or with `async`, as
  /// glake_memcpy_htod says (ordered on `stream`).
  void to_device(void* dst, const void* src, std::size_t bytes, glake_stream stream = nullptr,
                 bool async = false) {
    check(glake_memcpy_htod(transfer_, dst, src, bytes, stream, async ? GLAKE_MEMCPY_ASYNC : 0));
  }
  /// Device to host; as to_device().
  void to_host(void* dst, const void* src, std::size_t bytes, glake_stream stream = nullptr,
               bool async = false) {
    check(glake_memcpy_dtoh(transfer_, dst, src, bytes, stream, async ? GLAKE_MEMCPY_ASYNC : 0));
  }

  glake_transfer_stats stats() const {
    glake_transfer_stats out{};
    check(glake_transfer_get_stats(transfer_, &out));
    return out;
  }

 private:
  void destroy() noexcept {
    if (transfer_ != nullptr) (void)glake_transfer_destroy(std::exchange(transfer_, nullptr));
  }

  glake_transfer* transfer_ = nullptr;
};

/// SmartSwap's profiler over one pool's device (glake_profiler_*): owns the handle.
class Profiler {
 public:
  explicit Profiler(Pool& pool) { check(glake_profiler_create(pool.handle(), &profiler_)); }
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;
  ~Profiler() {
    if (profiler_ != nullptr) (void)glake_profiler_destroy(profiler_);
  }

  void begin_iteration() { check(glake_profiler_begin_iteration(profiler_)); }
  void set_phase(glake_phase phase) {
    check(glake_profiler_set_phase(profiler_, static_cast<uint32_t>(phase)));
  }
  void begin_op(const char* name, glake_stream stream = nullptr) {
    check(glake_profiler_begin_op(profiler_, name, stream));
  }
  void tensor(void* ptr, std::size_t bytes) { check(glake_profiler_tensor(profiler_, ptr, bytes)); }
  void end_op() { check(glake_profiler_end_op(profiler_)); }
  glake_profile_summary end_iteration() {
    glake_profile_summary out{};
    check(glake_profiler_end_iteration(profiler_, &out));
    return out;
  }

 private:
  glake_profiler* profiler_ = nullptr;
};

/// A SmartSwap session on a pool (`glake_smartswap_*`): warm-up, one profiled iteration, a
/// plan for the target, then the planned allocations swapped out and back in at the hooks, at
/// the same addresses.
class SmartSwap {
 public:
  SmartSwap(Pool& pool, const glake_smartswap_settings& settings) {
    check(glake_smartswap_create(pool.handle(), &settings, &session_));
  }
  SmartSwap(const SmartSwap&) = delete;
  SmartSwap& operator=(const SmartSwap&) = delete;
  ~SmartSwap() {
    if (session_ != nullptr) (void)glake_smartswap_destroy(session_);
  }

  void begin_iteration() { check(glake_smartswap_begin_iteration(session_)); }
  void set_phase(glake_phase phase) {
    check(glake_smartswap_set_phase(session_, static_cast<uint32_t>(phase)));
  }
  void begin_op(const char* name, glake_stream stream = nullptr) {
    check(glake_smartswap_begin_op(session_, name, stream));
  }
  void tensor(void* ptr, std::size_t bytes) { check(glake_smartswap_tensor(session_, ptr, bytes)); }
  void end_op() { check(glake_smartswap_end_op(session_)); }
  void end_iteration() { check(glake_smartswap_end_iteration(session_)); }
  glake_smartswap_report report() {
    glake_smartswap_report out{};
    check(glake_smartswap_get_report(session_, &out));
    return out;
  }

 private:
  glake_smartswap* session_ = nullptr;
};

namespace swap {

/// The process's operator hooks, in the shape of MindSpeed SmartSwap's manager: a custom
/// operator calls begin_hook("gmm_forward") before queuing its work, tensor_hook(ptr, bytes)
/// for each tensor it reads or writes, and post_hook() after; the training loop calls
/// end_hook() once per step. Until attach() (profile only) or enable() (profile, plan and
/// swap) names the pool, every hook does nothing, so operators can carry the hooks whether or
/// not swapping is on. Thread-safe.
class SwapManager {
 public:
  static SwapManager& instance() {
    static SwapManager manager;
    return manager;
  }

  /// Starts profiling `pool`'s device; the pool reports its allocations from now on.
  void attach(Pool& pool) {
    std::lock_guard<std::mutex> lock(mutex_);
    session_.reset();
    profiler_.reset(new Profiler(pool));
    open_ = false;
  }
  /// Swaps to meet `settings.target_bytes` on `pool`: the hooks drive a SmartSwap session.
  void enable(Pool& pool, const glake_smartswap_settings& settings) {
    std::lock_guard<std::mutex> lock(mutex_);
    profiler_.reset();
    session_.reset();
    session_.reset(new SmartSwap(pool, settings));
    open_ = false;
  }
  /// Stops profiling or swapping (what is out comes back); the hooks do nothing again.
  void detach() {
    std::lock_guard<std::mutex> lock(mutex_);
    profiler_.reset();
    session_.reset();
    open_ = false;
  }
  bool attached() {
    std::lock_guard<std::mutex> lock(mutex_);
    return profiler_ != nullptr || session_ != nullptr;
  }
  /// What the session enable() started has done (all zero without one).
  glake_smartswap_report report() {
    std::lock_guard<std::mutex> lock(mutex_);
    return session_ ? session_->report() : glake_smartswap_report{};
  }

  /// An op begins (the first hook of a step also begins the step).
  void begin_hook(const char* name, glake_stream stream = nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (session_) {
      if (!open_) {
        session_->begin_iteration();
        open_ = true;
      }
      session_->begin_op(name, stream);
      return;
    }
    if (!profiler_) return;
    if (!open_) {
      profiler_->begin_iteration();
      open_ = true;
    }
    profiler_->begin_op(name, stream);
  }
  /// The running op touches `bytes` at `ptr` (under a plan, one that is out comes back).
  void tensor_hook(void* ptr, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (session_) session_->tensor(ptr, bytes);
    if (profiler_) profiler_->tensor(ptr, bytes);
  }
  /// The running op has queued its work.
  void post_hook() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (session_) session_->end_op();
    if (profiler_) profiler_->end_op();
  }
  /// A stage marker: the phase of the ops that begin from now on.
  void stage_hook(glake_phase phase) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (session_) session_->set_phase(phase);
    if (profiler_) profiler_->set_phase(phase);
  }
  /// The step has ended: its profile's summary (all zero when nothing was recorded, and
  /// under enable(), where report() says what the session did).
  glake_profile_summary end_hook() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (session_) {
      if (open_) session_->end_iteration();
      open_ = false;
      return glake_profile_summary{};
    }
    if (!profiler_ || !open_) return glake_profile_summary{};
    open_ = false;
    last_ = profiler_->end_iteration();
    return last_;
  }
  /// The summary of the last step that ended.
  glake_profile_summary last_step() {
    std::lock_guard<std::mutex> lock(mutex_);
    return last_;
  }

 private:
  SwapManager() = default;
  std::mutex mutex_;
  std::unique_ptr<Profiler> profiler_;
  std::unique_ptr<SmartSwap> session_;
  bool open_ = false;
  glake_profile_summary last_{};
};

}  // namespace swap

}  // namespace glake

#endif  // GLAKE_HPP
