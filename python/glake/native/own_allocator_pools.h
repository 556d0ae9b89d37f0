// Memory pools that bring their own allocator (torch.cuda.MemPool(allocator)): their memory is
// made by that allocator, not by glake, and cached per pool as PyTorch caches it. A segment
// made for one request is split to serve smaller ones of the same pool and stream, freed
// pieces join their free neighbours, and a segment goes back to its allocator only whole,
// when the pool's cache is emptied or the pool goes away. Segments count against the
// process's memory fraction with glake's own memory (gmlake_n_count_outside).
//
// Included by glake_allocator.cpp only.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gmlake_native.h"

namespace glake_native {

class OwnAllocatorPools {
 public:
  using Allocator = c10::cuda::CUDACachingAllocator::CUDAAllocator;
  using PoolId = c10::MempoolId_t;

  // Requests are rounded to this, as in PyTorch; smaller leftovers of a split are not kept.
  static constexpr size_t kRound = 512;

  // Memory for `size` bytes on `stream` from pool `pool`, whose allocator is `allocator`: the
  // smallest free piece of the pool's segments made for `stream` that fits (split when larger),
  // else a new segment if the memory fraction allows it. nullptr with `*out_of_memory` set when
  // it does not (after the pool's wholly free segments went back to make room). With
  // `cached_only`, only a free piece serves (a pool lent on out-of-memory: PyTorch takes only
  // its cached blocks then, and its allocator is not asked for more). Throws what the pool's
  // allocator throws.
  void* malloc(c10::DeviceIndex device, PoolId pool, const std::shared_ptr<Allocator>& allocator,
               size_t size, cudaStream_t stream, bool* out_of_memory, bool cached_only = false) {
    *out_of_memory = false;
    const size_t rounded = (size + kRound - 1) / kRound * kRound;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      Pool& p = pools_[pool];
      p.device = device;
      p.allocator = allocator;
      p.released = false;
      settle(p);
      if (void* ptr = take_free(p, rounded, stream)) {
        return ptr;
      }
      if (cached_only) {
        *out_of_memory = true;
        return nullptr;
      }
    }
    if (gmlake_n_count_outside(device, rounded) != GMLAKE_N_OK) {
      // Room first from this pool's own wholly free segments (none of which fits), as PyTorch
      // releases the requesting pool's cache before it gives up.
      release_idle_of(pool);
      if (gmlake_n_count_outside(device, rounded) != GMLAKE_N_OK) {
        *out_of_memory = true;
        return nullptr;
      }
    }
    void* ptr = nullptr;
    try {
      ptr = allocator->raw_alloc_with_stream(rounded, stream);
    } catch (...) {
      (void)gmlake_n_uncount_outside(device, rounded);
      throw;
    }
    if (ptr == nullptr) {
      (void)gmlake_n_uncount_outside(device, rounded);
      *out_of_memory = true;
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    const auto at = key(ptr);
    segments_[at] = Segment{pool, device, rounded, stream, allocator};
    ranges_[at] = Range{at, rounded, false, {}};
    pools_[pool].segments += 1;
    count_.store(segments_.size(), std::memory_order_release);
    return ptr;
  }

  // Whether any segment exists: a free of glake's own memory need not look further when not.
  bool any() const { return count_.load(std::memory_order_acquire) > 0; }

  // Segments on `device` and their bytes: PyTorch counts them as reserved memory, so that
  // budgets computed from memory_reserved() hold them.
  std::pair<size_t, size_t> reserved_on(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t count = 0;
    size_t bytes = 0;
    for (const auto& [at, seg] : segments_) {
      if (seg.device == device) {
        count += 1;
        bytes += seg.size;
      }
    }
    return {count, bytes};
  }

  // Frees `ptr` if it is memory of such a pool: back to its pool's cache, joined with free
  // neighbours, or (the pool being gone) its segment back to its allocator once wholly free.
  // Streams recorded on it delay its reuse until their work queued by now ends. false when
  // `ptr` is not the start of memory handed out here.
  bool free(void* ptr) {
    std::vector<std::pair<uintptr_t, Segment>> gone;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = ranges_.find(key(ptr));
      if (it == ranges_.end()) {
        return false;
      }
      if (it->second.free) {
        TORCH_WARN("glake: memory pool memory at ", ptr, " freed twice");
        return true;
      }
      Segment& seg = segments_.at(it->second.segment);
      Pool& p = pools_.at(seg.pool);
      if (!it->second.streams.empty() && !p.released) {
        park(p, it);
        return true;
      }
      if (p.released) {
        // The pool is gone: wait for the streams that used it, then give it back when whole.
        for (cudaStream_t s : it->second.streams) {
          if (cudaStreamSynchronize(s) != cudaSuccess) {
            (void)cudaGetLastError();
          }
        }
        it->second.streams.clear();
      }
      mark_free(p, it);
      if (p.released) {
        take_whole_free(seg.pool, p, &gone);
      }
    }
    hand_back(gone);
    return true;
  }

  // Records that `stream` uses the memory at `ptr`; false when it is not such memory.
  bool record_stream(void* ptr, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = ranges_.find(key(ptr));
    if (it == ranges_.end() || it->second.free) {
      return false;
    }
    if (stream != segments_.at(it->second.segment).stream) {
      it->second.streams.push_back(stream);
    }
    return true;
  }

  // Hands the wholly free segments of `pool` back to its allocator, after the streams of
  // pieces waiting on them are done.
  void release_idle_of(PoolId pool) {
    std::vector<std::pair<uintptr_t, Segment>> gone;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pools_.find(pool);
      if (it == pools_.end()) {
        return;
      }
      drain_waiting(it->second);
      take_whole_free(pool, it->second, &gone);
    }
    hand_back(gone);
  }

  // Hands back the wholly free segments of every pool that is gone (empty_cache()).
  void release_idle_of_released() {
    std::vector<PoolId> released;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& [id, p] : pools_) {
        if (p.released) {
          released.push_back(id);
        }
      }
    }
    for (const auto& id : released) {
      release_idle_of(id);
    }
  }

  // Pool `pool` is gone: its free segments go back now, the others once wholly freed.
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
  }

 private:
  // Memory one call of a pool's allocator made.
  struct Segment {
    PoolId pool{0, 0};
    c10::DeviceIndex device = 0;
    size_t size = 0;
    cudaStream_t stream = nullptr;
    std::shared_ptr<Allocator> allocator;
  };
  // A piece of a segment, handed out or free.
  struct Range {
    uintptr_t segment = 0;
    size_t size = 0;
    bool free = false;
    std::vector<cudaStream_t> streams;  // recorded streams besides the segment's
  };
  // A freed piece whose recorded streams may still use it: free once its events complete.
  struct Waiting {
    uintptr_t at;
    std::vector<cudaEvent_t> events;
  };
  struct Pool {
    c10::DeviceIndex device = 0;
    std::shared_ptr<Allocator> allocator;
    bool released = false;
    size_t segments = 0;
    std::set<std::pair<size_t, uintptr_t>> free;  // free pieces by size, then address
    std::vector<Waiting> waiting;
  };

  static uintptr_t key(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); }

  // Under the lock: the smallest free piece of `p` of at least `size` bytes made for
  // `stream`, split so that the rest stays free; nullptr when there is none.
  void* take_free(Pool& p, size_t size, cudaStream_t stream) {
    for (auto f = p.free.lower_bound({size, 0}); f != p.free.end(); ++f) {
      auto it = ranges_.find(f->second);
      if (it == ranges_.end() || segments_.at(it->second.segment).stream != stream) {
        continue;
      }
      p.free.erase(f);
      Range& r = it->second;
      if (r.size - size >= kRound) {
        const uintptr_t rest = it->first + size;
        ranges_[rest] = Range{r.segment, r.size - size, true, {}};
        p.free.emplace(r.size - size, rest);
        r.size = size;
      }
      r.free = false;
      return reinterpret_cast<void*>(it->first);
    }
    return nullptr;
  }

  // Under the lock: piece `it` is free; it joins free neighbours of its segment.
  void mark_free(Pool& p, std::map<uintptr_t, Range>::iterator it) {
    it->second.free = true;
    auto next = std::next(it);
    if (next != ranges_.end() && next->second.free &&
        next->second.segment == it->second.segment) {
      p.free.erase({next->second.size, next->first});
      it->second.size += next->second.size;
      ranges_.erase(next);
    }
    if (it != ranges_.begin()) {
      auto prev = std::prev(it);
      if (prev->second.free && prev->second.segment == it->second.segment) {
        p.free.erase({prev->second.size, prev->first});
        prev->second.size += it->second.size;
        ranges_.erase(it);
        it = prev;
      }
    }
    p.free.emplace(it->second.size, it->first);
  }

  // Under the lock: a freed piece with recorded streams waits behind events on them.
  void park(Pool& p, std::map<uintptr_t, Range>::iterator it) {
    Waiting w{it->first, {}};
    for (cudaStream_t s : it->second.streams) {
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      cudaEvent_t event = nullptr;
      if (cudaStreamIsCapturing(s, &capturing) != cudaSuccess ||
          capturing != cudaStreamCaptureStatusNone ||
          cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess ||
          cudaEventRecord(event, s) != cudaSuccess) {
        // Unknown when that stream is done with it: the piece stays out of use until the pool
        // goes (its segment is then never handed back).
        (void)cudaGetLastError();
        if (event != nullptr) {
          (void)cudaEventDestroy(event);
        }
        for (cudaEvent_t e : w.events) {
          (void)cudaEventDestroy(e);
        }
        TORCH_WARN_ONCE("glake: memory of a memory pool's own allocator, freed while a stream "
                        "it was recorded on could not be tracked, is kept out of use");
        it->second.streams.clear();
        return;
      }
      w.events.push_back(event);
    }
    it->second.streams.clear();
    p.waiting.push_back(std::move(w));
  }

  // Under the lock: waiting pieces whose streams are done become free.
  void settle(Pool& p) {
    for (auto w = p.waiting.begin(); w != p.waiting.end();) {
      bool done = true;
      for (cudaEvent_t e : w->events) {
        if (cudaEventQuery(e) == cudaErrorNotReady) {
          (void)cudaGetLastError();
          done = false;
          break;
        }
      }
      if (!done) {
        ++w;
        continue;
      }
      finish_waiting(p, *w);
      w = p.waiting.erase(w);
    }
  }

  // Under the lock: waits for every waiting piece of `p`, which become free.
  void drain_waiting(Pool& p) {
    for (auto& w : p.waiting) {
      for (cudaEvent_t e : w.events) {
        (void)cudaEventSynchronize(e);
      }
      finish_waiting(p, w);
    }
    p.waiting.clear();
  }

  void finish_waiting(Pool& p, Waiting& w) {
    for (cudaEvent_t e : w.events) {
      (void)cudaEventDestroy(e);
    }
    w.events.clear();
    auto it = ranges_.find(w.at);
    if (it != ranges_.end()) {
      mark_free(p, it);
    }
  }

  // Under the lock: takes the wholly free segments of pool `id` off the books into `out`, and
  // the pool itself once it is gone and holds none.
  void take_whole_free(PoolId id, Pool& p, std::vector<std::pair<uintptr_t, Segment>>* out) {
    for (auto s = segments_.begin(); s != segments_.end();) {
      auto r = ranges_.find(s->first);
      if (s->second.pool == id && r != ranges_.end() && r->second.free &&
          r->second.size == s->second.size) {
        p.free.erase({r->second.size, r->first});
        ranges_.erase(r);
        out->emplace_back(s->first, std::move(s->second));
        s = segments_.erase(s);
        p.segments -= 1;
      } else {
        ++s;
      }
    }
    count_.store(segments_.size(), std::memory_order_release);
    if (p.released && p.segments == 0 && p.waiting.empty()) {
      pools_.erase(id);
    }
  }

  // Returns segments to the allocators that made them and takes them off the memory
  // fraction's books. Called from destructors: failures are reported, not thrown.
  static void hand_back(const std::vector<std::pair<uintptr_t, Segment>>& segments) {
    for (const auto& [at, seg] : segments) {
      try {
        if (seg.allocator) {
          seg.allocator->raw_delete(reinterpret_cast<void*>(at));
        }
      } catch (const std::exception& e) {
        TORCH_WARN("glake: a memory pool's own allocator failed to free ",
                   reinterpret_cast<void*>(at), ": ", e.what());
      }
      (void)gmlake_n_uncount_outside(seg.device, seg.size);
    }
  }

  std::mutex mutex_;
  std::unordered_map<PoolId, Pool, c10::MempoolIdHash> pools_;
  std::unordered_map<uintptr_t, Segment> segments_;
  std::map<uintptr_t, Range> ranges_;  // every piece of every segment, by address
  std::atomic<size_t> count_{0};
};

}  // namespace glake_native
