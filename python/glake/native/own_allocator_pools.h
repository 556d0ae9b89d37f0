// Memory pools that bring their own allocator (torch.cuda.MemPool(allocator)): their memory is
// made by that allocator, not by glake, but it is cached per pool as PyTorch caches it (a
// freed block serves the pool's next request on the same stream, and only the pool's own),
// counted against the process's memory fraction with glake's own memory, and handed back to
// its allocator when the pool's cache is emptied or the pool goes away.
//
// Included by glake_allocator.cpp only.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gmlake_native.h"

namespace glake_native {

class OwnAllocatorPools {
 public:
  using Allocator = c10::cuda::CUDACachingAllocator::CUDAAllocator;
  using PoolId = c10::MempoolId_t;

  // A block for `size` bytes on `stream` from pool `pool`, whose allocator is `allocator`:
  // the smallest cached free block of the pool that fits and was made for `stream`, else a new
  // one if the memory fraction allows it. nullptr with `*out_of_memory` set when it does not
  // (after the pool's other cached blocks went back to make room). Throws what the pool's
  // allocator throws.
  void* malloc(c10::DeviceIndex device, PoolId pool, const std::shared_ptr<Allocator>& allocator,
               size_t size, cudaStream_t stream, bool* out_of_memory) {
    *out_of_memory = false;
    std::vector<Block> idle;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& p = pools_[pool];
      p.device = device;
      p.allocator = allocator;
      p.released = false;
      if (void* ptr = reuse(p, size, stream)) {
        return ptr;
      }
    }
    if (gmlake_n_count_outside(device, size) != GMLAKE_N_OK) {
      // Room first from this pool's own cached blocks (none of which fits), as PyTorch
      // releases the requesting pool's cache before it gives up.
      release_idle_of(pool);
      if (gmlake_n_count_outside(device, size) != GMLAKE_N_OK) {
        *out_of_memory = true;
        return nullptr;
      }
    }
    void* ptr = nullptr;
    try {
      ptr = allocator->raw_alloc_with_stream(size, stream);
    } catch (...) {
      (void)gmlake_n_uncount_outside(device, size);
      throw;
    }
    if (ptr == nullptr) {
      (void)gmlake_n_uncount_outside(device, size);
      *out_of_memory = true;
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_[ptr] = Block{pool, device, size, stream, {}, allocator};
    count_.store(blocks_.size(), std::memory_order_release);
    return ptr;
  }

  // Whether `ptr` is a block of a pool with its own allocator (live or cached).
  bool owns(void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    return blocks_.count(ptr) != 0;
  }

  // Frees `ptr` if it is such a block: back to its pool's cache, or to its allocator when the
  // pool is gone. Streams recorded on it delay its reuse until their work queued by now ends.
  // false when `ptr` is not such a block.
  bool free(void* ptr) {
    Block gone;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = blocks_.find(ptr);
      if (it == blocks_.end()) {
        return false;
      }
      auto pool = pools_.find(it->second.pool);
      if (pool != pools_.end() && !pool->second.released) {
        park(pool->second, ptr, it->second);
        return true;
      }
      gone = std::move(it->second);
      blocks_.erase(it);
      count_.store(blocks_.size(), std::memory_order_release);
    }
    // The pool is gone: the block goes back to its allocator once its streams are done.
    for (cudaStream_t s : gone.streams) {
      if (cudaStreamSynchronize(s) != cudaSuccess) {
        (void)cudaGetLastError();
      }
    }
    hand_back(ptr, gone);
    return true;
  }

  // Whether any block exists: a free of glake's own memory need not look further when not.
  bool any() const { return count_.load(std::memory_order_acquire) > 0; }

  // Records that `stream` uses block `ptr`; false when `ptr` is not such a block.
  bool record_stream(void* ptr, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(ptr);
    if (it == blocks_.end()) {
      return false;
    }
    if (stream != it->second.stream) {
      it->second.streams.push_back(stream);
    }
    return true;
  }

  // Hands the cached blocks of `pool` back to its allocator.
  void release_idle_of(PoolId pool) {
    std::vector<std::pair<void*, Block>> out;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pools_.find(pool);
      if (it == pools_.end()) {
        return;
      }
      take_idle(it->second, &out);
    }
    for (auto& [ptr, block] : out) {
      hand_back(ptr, block);
    }
  }

  // Hands back the cached blocks of every pool that is gone (empty_cache() of the process).
  void release_idle_of_released() {
    std::vector<std::pair<void*, Block>> out;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [id, p] : pools_) {
        if (p.released) {
          take_idle(p, &out);
        }
      }
    }
    for (auto& [ptr, block] : out) {
      hand_back(ptr, block);
    }
  }

  // Pool `pool` is gone: its cached blocks go back now, its live ones when they are freed.
  void forget(PoolId pool) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pools_.find(pool);
      if (it == pools_.end()) {
        return;
      }
      it->second.released = true;
    }
    release_idle_of(pool);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pools_.find(pool);
    if (it != pools_.end() && it->second.released && it->second.idle.empty() &&
        it->second.waiting.empty()) {
      pools_.erase(it);
    }
  }

 private:
  struct Block {
    PoolId pool{0, 0};
    c10::DeviceIndex device = 0;
    size_t size = 0;
    cudaStream_t stream = nullptr;
    std::vector<cudaStream_t> streams;  // recorded streams besides `stream`
    std::shared_ptr<Allocator> allocator;
  };
  // A freed block whose recorded streams may still use it: reusable once its events complete.
  struct Waiting {
    void* ptr;
    std::vector<cudaEvent_t> events;
  };
  struct Pool {
    c10::DeviceIndex device = 0;
    std::shared_ptr<Allocator> allocator;
    bool released = false;
    std::multimap<size_t, void*> idle;  // cached free blocks by size
    std::vector<Waiting> waiting;
  };

  // Under the lock: the smallest idle block of `p` for `size` on `stream`, marked in use.
  void* reuse(Pool& p, size_t size, cudaStream_t stream) {
    settle(p);
    for (auto it = p.idle.lower_bound(size); it != p.idle.end(); ++it) {
      if (blocks_[it->second].stream == stream) {
        void* ptr = it->second;
        p.idle.erase(it);
        return ptr;
      }
    }
    return nullptr;
  }

  // Under the lock: caches freed block `ptr` in `p`, behind events on its recorded streams.
  void park(Pool& p, void* ptr, Block& block) {
    if (block.streams.empty()) {
      p.idle.emplace(block.size, ptr);
      return;
    }
    Waiting w{ptr, {}};
    for (cudaStream_t s : block.streams) {
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      cudaEvent_t event = nullptr;
      if (cudaStreamIsCapturing(s, &capturing) != cudaSuccess ||
          capturing != cudaStreamCaptureStatusNone ||
          cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess ||
          cudaEventRecord(event, s) != cudaSuccess) {
        // Unknown when that stream is done with it: the block stays out of use for good.
        (void)cudaGetLastError();
        if (event != nullptr) {
          (void)cudaEventDestroy(event);
        }
        for (cudaEvent_t e : w.events) {
          (void)cudaEventDestroy(e);
        }
        TORCH_WARN_ONCE("glake: a block of a memory pool's own allocator, freed while a stream "
                        "it was recorded on could not be tracked, is kept out of use");
        block.streams.clear();
        return;
      }
      w.events.push_back(event);
    }
    block.streams.clear();
    p.waiting.push_back(std::move(w));
  }

  // Under the lock: moves waiting blocks whose streams are done to the idle cache.
  void settle(Pool& p) {
    for (auto it = p.waiting.begin(); it != p.waiting.end();) {
      bool done = true;
      for (cudaEvent_t e : it->events) {
        const cudaError_t status = cudaEventQuery(e);
        if (status == cudaErrorNotReady) {
          (void)cudaGetLastError();
          done = false;
          break;
        }
      }
      if (!done) {
        ++it;
        continue;
      }
      for (cudaEvent_t e : it->events) {
        (void)cudaEventDestroy(e);
      }
      p.idle.emplace(blocks_[it->ptr].size, it->ptr);
      it = p.waiting.erase(it);
    }
  }

  // Under the lock: takes `p`'s idle blocks (and waiting ones, after their streams) out.
  void take_idle(Pool& p, std::vector<std::pair<void*, Block>>* out) {
    for (auto& w : p.waiting) {
      for (cudaEvent_t e : w.events) {
        (void)cudaEventSynchronize(e);
        (void)cudaEventDestroy(e);
      }
      p.idle.emplace(blocks_[w.ptr].size, w.ptr);
    }
    p.waiting.clear();
    for (const auto& [size, ptr] : p.idle) {
      auto it = blocks_.find(ptr);
      if (it != blocks_.end()) {
        out->emplace_back(ptr, std::move(it->second));
        blocks_.erase(it);
      }
    }
    p.idle.clear();
    count_.store(blocks_.size(), std::memory_order_release);
  }

  // Returns a block to the allocator that made it and takes it off the memory fraction's books.
  // Called from destructors: failures are reported, not thrown.
  static void hand_back(void* ptr, const Block& block) {
    try {
      if (block.allocator) {
        block.allocator->raw_delete(ptr);
      }
    } catch (const std::exception& e) {
      TORCH_WARN("glake: a memory pool's own allocator failed to free ", ptr, ": ", e.what());
    }
    (void)gmlake_n_uncount_outside(block.device, block.size);
  }

  std::mutex mutex_;
  std::unordered_map<PoolId, Pool, c10::MempoolIdHash> pools_;
  std::unordered_map<void*, Block> blocks_;
  std::atomic<size_t> count_{0};
};

}  // namespace glake_native
