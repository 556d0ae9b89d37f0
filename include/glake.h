/* GLake C API: GPU memory pools with virtual-memory stitching.
 * Generated from the Rust sources by cbindgen; do not edit (see tests/header.rs). */

#ifndef GLAKE_H
#define GLAKE_H

#include <stddef.h>
#include <stdint.h>

// `glake_config.flags`: apply the environment variables (GLAKE_*, GMLake's names) on top of
// the struct's values.
#define GLAKE_CONFIG_READ_ENV 1

// `glake_config.flags`: wrap the device so that `glake_pool_inject_fault` can make chosen
// driver calls fail (for testing a program's error handling).
#define GLAKE_CONFIG_FAULT_INJECTION 2

// `glake_transfer_create` flags: apply the `GLAKE_COPY_*` environment variables.
#define GLAKE_TRANSFER_READ_ENV 1

// `glake_transfer_create` flags: use the target's own link only (no relays through peers).
#define GLAKE_TRANSFER_NO_PEERS 2

// `glake_memcpy_*` flags: order the copy on the stream and return as early as the host memory
// allows (see `glake_memcpy_htod`); without it the call returns when the data has arrived.
#define GLAKE_MEMCPY_ASYNC 1

// Result of every C API call.
enum glake_status
#if defined(__cplusplus) || __STDC_VERSION__ >= 202311L
  : uint32_t
#endif // defined(__cplusplus) || __STDC_VERSION__ >= 202311L
 {
  GLAKE_STATUS_SUCCESS = 0,
  // A value is out of range, or flag bits are unknown.
  GLAKE_STATUS_INVALID_ARGUMENT = 1,
  // A required pointer argument is NULL.
  GLAKE_STATUS_NULL_POINTER = 2,
  // The pointer was not allocated by this pool (or points inside an allocation).
  GLAKE_STATUS_INVALID_POINTER = 3,
  // The pointer was already freed.
  GLAKE_STATUS_DOUBLE_FREE = 4,
  // Not enough device memory within the pool's cap.
  GLAKE_STATUS_OUT_OF_MEMORY = 5,
  // A driver call failed.
  GLAKE_STATUS_DRIVER_ERROR = 6,
  // No usable device of the requested backend.
  GLAKE_STATUS_NO_DEVICE = 7,
  // Not supported by this backend or driver.
  GLAKE_STATUS_UNSUPPORTED = 8,
  // A platform limit was reached (for example the number of memory mappings).
  GLAKE_STATUS_RESOURCE_LIMIT = 9,
  // The call is not allowed in the current state.
  GLAKE_STATUS_INVALID_STATE = 10,
  // The pool handle is not (or no longer) valid.
  GLAKE_STATUS_INVALID_HANDLE = 11,
  // An internal panic was caught; the library stays usable but the call did nothing.
  GLAKE_STATUS_PANIC = 12,
  // An internal invariant failed.
  GLAKE_STATUS_INTERNAL = 13,
};
#ifndef __cplusplus
#if __STDC_VERSION__ >= 202311L
typedef enum glake_status glake_status;
#else
typedef uint32_t glake_status;
#endif // __STDC_VERSION__ >= 202311L
#endif // __cplusplus

// Which device backend a pool uses.
enum glake_backend
#if defined(__cplusplus) || __STDC_VERSION__ >= 202311L
  : uint32_t
#endif // defined(__cplusplus) || __STDC_VERSION__ >= 202311L
 {
  // CUDA when a usable GPU is present, else the host backend.
  GLAKE_BACKEND_AUTO = 0,
  // Host memory (memfd + mmap): runs anywhere, for tests and examples.
  GLAKE_BACKEND_HOST = 1,
  GLAKE_BACKEND_CUDA = 2,
};
#ifndef __cplusplus
#if __STDC_VERSION__ >= 202311L
typedef enum glake_backend glake_backend;
#else
typedef uint32_t glake_backend;
#endif // __STDC_VERSION__ >= 202311L
#endif // __cplusplus

// Driver calls that `glake_pool_inject_fault` can fail.
enum glake_driver_call
#if defined(__cplusplus) || __STDC_VERSION__ >= 202311L
  : uint32_t
#endif // defined(__cplusplus) || __STDC_VERSION__ >= 202311L
 {
  GLAKE_CALL_RESERVE = 0,
  GLAKE_CALL_UNRESERVE = 1,
  GLAKE_CALL_CREATE_PHYSICAL = 2,
  GLAKE_CALL_RELEASE_PHYSICAL = 3,
  GLAKE_CALL_MAP = 4,
  GLAKE_CALL_UNMAP = 5,
  GLAKE_CALL_SET_ACCESS = 6,
  GLAKE_CALL_CREATE_STREAM = 7,
  GLAKE_CALL_DESTROY_STREAM = 8,
  GLAKE_CALL_CREATE_EVENT = 9,
  GLAKE_CALL_DESTROY_EVENT = 10,
  GLAKE_CALL_RECORD_EVENT = 11,
  GLAKE_CALL_QUERY_EVENT = 12,
  GLAKE_CALL_SYNCHRONIZE_EVENT = 13,
  GLAKE_CALL_SYNCHRONIZE_STREAM = 14,
  GLAKE_CALL_SYNCHRONIZE_DEVICE = 15,
  GLAKE_CALL_STREAM_WAIT_EVENT = 16,
  GLAKE_CALL_COPY = 17,
  GLAKE_CALL_PINNED = 18,
  GLAKE_CALL_MEM_INFO = 19,
  GLAKE_CALL_HOST_REGISTER = 20,
  GLAKE_CALL_HOST_QUERY = 21,
  GLAKE_CALL_SHARE = 22,
};
#ifndef __cplusplus
#if __STDC_VERSION__ >= 202311L
typedef enum glake_driver_call glake_driver_call;
#else
typedef uint32_t glake_driver_call;
#endif // __STDC_VERSION__ >= 202311L
#endif // __cplusplus

// The stage an op belongs to (`glake_profiler_set_phase`).
enum glake_phase
#if defined(__cplusplus) || __STDC_VERSION__ >= 202311L
  : uint32_t
#endif // defined(__cplusplus) || __STDC_VERSION__ >= 202311L
 {
  GLAKE_PHASE_FORWARD = 0,
  GLAKE_PHASE_BACKWARD = 1,
  GLAKE_PHASE_OPTIMIZER = 2,
  GLAKE_PHASE_OTHER = 3,
};
#ifndef __cplusplus
#if __STDC_VERSION__ >= 202311L
typedef enum glake_phase glake_phase;
#else
typedef uint32_t glake_phase;
#endif // __STDC_VERSION__ >= 202311L
#endif // __cplusplus

// What a planned tensor is; the preference says which kinds the planner may move.
enum glake_tensor_kind
#if defined(__cplusplus) || __STDC_VERSION__ >= 202311L
  : uint32_t
#endif // defined(__cplusplus) || __STDC_VERSION__ >= 202311L
 {
  GLAKE_TENSOR_ACTIVATION = 0,
  GLAKE_TENSOR_OPTIMIZER_STATE = 1,
  GLAKE_TENSOR_GRADIENT = 2,
  GLAKE_TENSOR_OTHER = 3,
  // An optimizer state whose block's step runs in the backward: kept throughout, or swapped
  // across the iteration's end (`out_after` its last use, `in_before` its first).
  GLAKE_TENSOR_CARRIED_STATE = 4,
};
#ifndef __cplusplus
#if __STDC_VERSION__ >= 202311L
typedef enum glake_tensor_kind glake_tensor_kind;
#else
typedef uint32_t glake_tensor_kind;
#endif // __STDC_VERSION__ >= 202311L
#endif // __cplusplus

// Which tensors the planner may move: activations only, or optimizer states and gradients too.
enum glake_swap_preference
#if defined(__cplusplus) || __STDC_VERSION__ >= 202311L
  : uint32_t
#endif // defined(__cplusplus) || __STDC_VERSION__ >= 202311L
 {
  GLAKE_SWAP_BETTER_PERFORMANCE = 0,
  GLAKE_SWAP_BETTER_MEMORY_SAVING = 1,
};
#ifndef __cplusplus
#if __STDC_VERSION__ >= 202311L
typedef enum glake_swap_preference glake_swap_preference;
#else
typedef uint32_t glake_swap_preference;
#endif // __STDC_VERSION__ >= 202311L
#endif // __cplusplus

// What to do with one tensor.
enum glake_swap_action
#if defined(__cplusplus) || __STDC_VERSION__ >= 202311L
  : uint32_t
#endif // defined(__cplusplus) || __STDC_VERSION__ >= 202311L
 {
  GLAKE_SWAP_KEEP = 0,
  // Copy out after op `out_after`, back in before op `in_before`.
  GLAKE_SWAP_SWAP = 1,
  // Free after the last forward use, rebuild before the first backward use.
  GLAKE_SWAP_RECOMPUTE = 2,
};
#ifndef __cplusplus
#if __STDC_VERSION__ >= 202311L
typedef enum glake_swap_action glake_swap_action;
#else
typedef uint32_t glake_swap_action;
#endif // __STDC_VERSION__ >= 202311L
#endif // __cplusplus

// Where a session stands.
enum glake_smartswap_phase
#if defined(__cplusplus) || __STDC_VERSION__ >= 202311L
  : uint32_t
#endif // defined(__cplusplus) || __STDC_VERSION__ >= 202311L
 {
  GLAKE_SMARTSWAP_WARMUP = 0,
  GLAKE_SMARTSWAP_PROFILE = 1,
  GLAKE_SMARTSWAP_STABLE = 2,
};
#ifndef __cplusplus
#if __STDC_VERSION__ >= 202311L
typedef enum glake_smartswap_phase glake_smartswap_phase;
#else
typedef uint32_t glake_smartswap_phase;
#endif // __STDC_VERSION__ >= 202311L
#endif // __cplusplus

// What a sleeping region keeps of its bytes (passed to `glake_sleep` as a `uint32_t`, so a
// value outside the enum is refused rather than undefined).
enum glake_sleep_mode
#if defined(__cplusplus) || __STDC_VERSION__ >= 202311L
  : uint32_t
#endif // defined(__cplusplus) || __STDC_VERSION__ >= 202311L
 {
  // A host copy (pinned, kept for the next sleep), restored by `glake_wake`.
  GLAKE_SLEEP_KEEP = 0,
  // Nothing: after `glake_wake` the memory holds undefined bytes (KV caches, scratch).
  GLAKE_SLEEP_DROP = 1,
};
#ifndef __cplusplus
#if __STDC_VERSION__ >= 202311L
typedef enum glake_sleep_mode glake_sleep_mode;
#else
typedef uint32_t glake_sleep_mode;
#endif // __STDC_VERSION__ >= 202311L
#endif // __cplusplus

// Opaque pool handle.
typedef struct glake_pool glake_pool;

// A range of device memory.
typedef struct glake_range {
  void *ptr;
  size_t bytes;
} glake_range;

// What `glake_share_read_only` did with a range.
typedef struct glake_share_report {
  // Bytes now mapped from another process's memory; their own memory went back to the
  // device.
  uint64_t shared_bytes;
  // Bytes moved into shareable memory of this process and offered to other processes.
  uint64_t offered_bytes;
  // Bytes left as they were: parts of physical handles the range does not cover whole,
  // bytes shared already, or bytes the cap left no room to move.
  uint64_t kept_bytes;
} glake_share_report;

// Pool settings. Fill with `glake_config_default`, then change fields.
typedef struct glake_config {
  // `sizeof(glake_config)`, set by `glake_config_default`; guards against header mismatch.
  uint32_t struct_size;
  // `GLAKE_CONFIG_*` bits.
  uint32_t flags;
  // Device ordinal.
  int32_t device;
  // A `glake_backend` value.
  uint32_t backend;
  // 1: stitch free blocks (GMLake vmmDefragment=1); 0: plain caching.
  uint32_t stitch;
  // 0: stitch before creating memory; 1: only when the device is full (GMLake defragLevel).
  uint32_t defrag_level;
  // Free blocks smaller than this are not stitched (bytes; GMLake fragLimit).
  uint64_t frag_limit;
  // A cached stitched block serves requests down to 1/reuse_limit of its size (reuseLimit).
  double reuse_limit;
  // Cached stitched address space collected past this many bytes (GMLake autoGC, in bytes).
  uint64_t auto_gc_bytes;
  // Cap on physical memory as a fraction of the device, in (0, 1].
  double memory_fraction;
  // Largest request of the small pool, in bytes.
  uint64_t small_limit;
  // Most pieces one stitched block maps.
  uint32_t max_stitch_pieces;
  // Must be 0.
  uint32_t reserved;
} glake_config;

// A stream: a `cudaStream_t`/`CUstream` on the CUDA backend (NULL is the default stream), a
// value from `glake_stream_create` on the host backend.
typedef void *glake_stream;

// One statistic: current value, peak since the last reset, and running totals of increases and
// decreases since the last accumulated reset.
typedef struct glake_stat {
  int64_t current;
  int64_t peak;
  int64_t allocated;
  int64_t freed;
} glake_stat;

// A statistic split as PyTorch splits it: all, small pool, large pool.
typedef struct glake_stat_array {
  struct glake_stat all;
  struct glake_stat small_pool;
  struct glake_stat large_pool;
} glake_stat_array;

// Everything `memory_stats()` reports, plus the stitch counters.
typedef struct glake_stats {
  // Live allocations (count).
  struct glake_stat_array allocation;
  // Physical segments (count).
  struct glake_stat_array segment;
  // Allocated or waiting for other streams (count).
  struct glake_stat_array active;
  // Free blocks inside split segments (count).
  struct glake_stat_array inactive_split;
  struct glake_stat_array allocated_bytes;
  struct glake_stat_array reserved_bytes;
  struct glake_stat_array active_bytes;
  struct glake_stat_array inactive_split_bytes;
  struct glake_stat_array requested_bytes;
  // Times an allocation had to free cached memory and try again.
  int64_t num_alloc_retries;
  // Allocations that failed for lack of memory.
  int64_t num_ooms;
  // Times the allocator waited for all streams.
  int64_t num_sync_all_streams;
  // Physical memory creations and releases.
  int64_t num_device_alloc;
  int64_t num_device_free;
  // Allocations served by a stitched block (new or reused).
  int64_t stitched_allocations;
  // Stitched blocks built (each maps pieces into a new range).
  int64_t stitches;
  // Bytes of all stitched blocks built.
  int64_t stitched_bytes;
  // Pieces mapped by all stitches.
  int64_t stitched_pieces;
  // Allocations served by reusing a cached stitched block.
  int64_t stitch_reuse_hits;
  // Stitched blocks unmapped by collection or `empty_cache`.
  int64_t stitch_collections;
  // Stitched blocks mapped now (in use or cached), and their bytes.
  struct glake_stat stitched_blocks;
  struct glake_stat stitched_mapped_bytes;
  // Bytes of swappable allocations swapped out to host memory now.
  struct glake_stat swapped_bytes;
  // Bytes mapped from memory other processes made (read-only memory deduplicated): memory
  // this process would hold otherwise. Counted in `reserved_bytes`, not against the cap.
  int64_t shared_bytes;
  // Bytes of this process's memory offered read-only to other processes.
  int64_t offered_bytes;
  // The whole device, all processes of this user sharing on it (from the dedup index, at
  // most a second old; 0 until this pool shares): bytes of memory mapped by two or more
  // processes, each counted once.
  int64_t device_shared_bytes;
  // The same: bytes the device would hold more without sharing (each shared range times
  // the number of processes mapping it, less one).
  int64_t device_saved_bytes;
  // Idle segments of small handles a stitch released to make their bytes again in large
  // handles, and the handles they had.
  int64_t gathered_segments;
  int64_t gathered_handles;
} glake_stats;

// One op of the profiled iteration, in execution order.
typedef struct glake_swap_op {
  // Device time of the op (from events).
  uint64_t gpu_ns;
  // A `glake_phase` value.
  uint32_t phase;
} glake_swap_op;

// One tensor the planner may act on, resident from the start of op `produced_at` to the end
// of op `freed_after`.
typedef struct glake_swap_tensor {
  size_t bytes;
  size_t produced_at;
  size_t freed_after;
  // Sorted op indexes reading the tensor (may be NULL when `n_uses` is 0).
  const size_t *uses;
  size_t n_uses;
  // Nonzero when the tensor can be rebuilt by rerunning its producer, at `recompute_ns`.
  uint32_t can_recompute;
  uint64_t recompute_ns;
  // A `glake_tensor_kind` value.
  uint32_t kind;
} glake_swap_tensor;

// Copy bandwidths of the swap paths, how far ahead swap-ins start, and what may move.
typedef struct glake_swap_config {
  uint64_t d2h_bytes_per_s;
  uint64_t h2d_bytes_per_s;
  // A swap-in starts when op `in_before - prefetch` ends (at least one op ahead).
  size_t prefetch;
  // A `glake_swap_preference` value.
  uint32_t preference;
} glake_swap_config;

// One tensor's choice: a `glake_swap_action` and, for a swap, its window.
typedef struct glake_swap_choice {
  uint32_t action;
  size_t out_after;
  size_t in_before;
} glake_swap_choice;

// The predicted iteration under a plan.
typedef struct glake_swap_prediction {
  // When the last op ends: compute, recompute and waits for swap-ins.
  uint64_t step_ns;
  // Sum of op times (the step with nothing moved).
  uint64_t compute_ns;
  // Compute stalled on swap-ins.
  uint64_t exposed_wait_ns;
  // Compute spent rebuilding recomputed tensors.
  uint64_t recompute_ns;
  // Most device bytes in use, base bytes included; when a target is unreachable, the lowest
  // peak the planner reached.
  size_t peak_bytes;
  // The peak with every tensor kept.
  size_t baseline_peak_bytes;
  // The op during which the peak is reached.
  size_t peak_op;
} glake_swap_prediction;

// A profiler recording the iterations of one pool's device: opaque handle.
typedef struct glake_profiler {
  uint8_t _private[0];
} glake_profiler;

// What one recorded iteration came to (`glake_profiler_end_iteration`).
typedef struct glake_profile_summary {
  // Ops recorded.
  uint64_t ops;
  // Allocations made and tracked during the iteration.
  uint64_t tensors;
  // Device time of all ops, from their events (ops whose timing failed count 0).
  uint64_t compute_ns;
  // Bytes the ops touched that were allocated before the iteration (weights, states).
  uint64_t base_bytes;
  // Most bytes live while an op ran, base bytes included, with no plan.
  uint64_t peak_bytes;
} glake_profile_summary;

// What a session aims for.
typedef struct glake_smartswap_settings {
  // Peak bytes of an iteration (the pool's memory) the plan must stay within; the pool's
  // soft limit while the plan runs.
  uint64_t target_bytes;
  // Iterations run as written before the profiled one.
  uint64_t warmup_iterations;
  // The planner's bandwidths, prefetch distance (ops) and preference.
  struct glake_swap_config config;
} glake_smartswap_settings;

// A SmartSwap session on one pool: opaque handle.
typedef struct glake_smartswap {
  uint8_t _private[0];
} glake_smartswap;

// What a session has done (`glake_smartswap_get_report`).
typedef struct glake_smartswap_report {
  // A `glake_smartswap_phase` value.
  uint32_t phase;
  uint32_t _reserved;
  uint64_t iterations;
  // Allocations the plan swaps each iteration, and their bytes.
  uint64_t planned_swaps;
  uint64_t planned_swap_bytes;
  // The plan's predicted peak and step (0 before a plan).
  uint64_t predicted_peak_bytes;
  uint64_t predicted_step_ns;
  // Swaps done, out and in.
  uint64_t swapped_out;
  uint64_t swapped_in;
  // Returns to warm-up after an iteration left the profile.
  uint64_t restarts;
  // Swap-ins the plan did not schedule (an op touched a tensor while it was out).
  uint64_t off_plan;
} glake_smartswap_report;

// What `glake_get_region_info` reports.
typedef struct glake_region_info {
  // 1 from `glake_sleep` until a `glake_wake` completes, else 0.
  uint32_t asleep;
  // Segments of the region, awake or asleep.
  uint64_t segments;
  // Bytes of the region's segments that hold physical memory now.
  uint64_t resident_bytes;
  // Bytes of the region's segments whose physical memory is given back.
  uint64_t asleep_bytes;
  // Bytes of live allocations in the region.
  uint64_t allocated_bytes;
  // Bytes of host copies held for the sleeping segments.
  uint64_t host_bytes;
} glake_region_info;

// An opaque copy engine of one target device.
typedef struct glake_transfer {
  uint8_t _private[0];
} glake_transfer;

// One piece of a `glake_memcpy_batch`: host memory, device memory and bytes.
typedef struct glake_copy_piece {
  void *host;
  void *device;
  size_t bytes;
} glake_copy_piece;

// Counters of a copy engine.
typedef struct glake_transfer_stats {
  uint64_t copies;
  uint64_t bytes;
  // Copies handed straight to the driver (small, or pinned with no relay worth it).
  uint64_t driver_copies;
  // Bytes moved by the engine's lanes.
  uint64_t engine_bytes;
  // Paths of the engine: the target's own link plus relays.
  uint32_t paths;
  uint32_t reserved;
} glake_transfer_stats;





#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// The message of the last failed call on this thread ("" after a success). The pointer stays
// valid until the next glake call on the same thread.
const char *glake_last_error_message(void);

// A constant name for a status code ("GLAKE_STATUS_OUT_OF_MEMORY"), or "GLAKE_STATUS_UNKNOWN".
const char *glake_status_name(uint32_t status);

// Declares each of `ranges` (`count` of them, each inside one live allocation of `pool`)
// read-only from now on and shares it with the processes of this user that hold the same
// bytes on the same device (replicas of a model's weights hold them once). Each run of whole
// physical handles in a range is hashed and looked up in the device's index
// (`GLAKE_DEDUP_DIR`); another process's equal memory, checked byte by byte, is mapped at the
// same addresses and this process's own memory released; without one, the run moves into
// shareable memory offered to later processes. Addresses do not change. Afterwards a write to
// those handles faults (the device's access is read-only). Waits for all work on the device;
// no work may use the ranges during the call. Ranges of stitched, swappable, guarded or
// private-pool allocations are kept as they are. `out` (may be NULL) receives what was done.
// GLAKE_STATUS_INVALID_POINTER or GLAKE_STATUS_INVALID_ARGUMENT for a range outside a live
// allocation (nothing changes); GLAKE_STATUS_INVALID_STATE when the index is unreadable or a
// graph capture may be underway. On an error every range keeps its bytes; runs done before
// it stay shared.
//
// # Safety
// `ranges` must be valid for `count` reads (NULL only when `count` is 0); `out` must be NULL
// or valid for writing a `glake_share_report`.
glake_status glake_share_read_only(struct glake_pool *pool,
                                   const struct glake_range *ranges,
                                   size_t count,
                                   struct glake_share_report *out);

// Initialises logging (`GLAKE_LOG`, e.g. `GLAKE_LOG=debug`); safe to call many times, and a
// logger installed by the program is kept.
glake_status glake_init(void);

// The library version as "MAJOR.MINOR.PATCH".
const char *glake_version(void);

// Fills `out` with the default settings (stitching on, GMLake's defaults).
//
// # Safety
// `out` must be NULL or valid for writing a `glake_config`.
glake_status glake_config_default(struct glake_config *out);

// Creates a pool on the configured device and backend.
//
// # Safety
// `config` must be NULL or point to a `glake_config`; `out` NULL or valid for a write.
glake_status glake_pool_create(const struct glake_config *config, struct glake_pool **out);

// Destroys a pool: waits for the device, then releases all its memory (live allocations too,
// with a warning). The handle is invalid afterwards.
glake_status glake_pool_destroy(struct glake_pool *pool);

// The backend a pool runs on (`glake_backend`).
//
// # Safety
// `out` must be NULL or valid for a write.
glake_status glake_pool_backend(struct glake_pool *pool, uint32_t *out);

// Allocates `size` bytes for use on `stream`; at least 512-byte aligned.
//
// # Safety
// `out` must be NULL or valid for a write.
glake_status glake_malloc(struct glake_pool *pool, size_t size, glake_stream stream, void **out);

// Frees an allocation; its memory is reused on its stream at once, elsewhere once safe.
glake_status glake_free(struct glake_pool *pool, void *ptr);

// Allocates `size` bytes (rounded up to 512 bytes) for use on `stream`, in
// memory of their own that `glake_swap_out` can give back to the device and `glake_swap_in`
// bring back at the same address. Free it with `glake_free`, swapped out or not.
//
// # Safety
// `out` must be NULL or valid for a write.
glake_status glake_malloc_swappable(struct glake_pool *pool,
                                    size_t size,
                                    glake_stream stream,
                                    void **out);

// Swaps the swappable allocation at `ptr` out: waits for the work queued on its streams,
// copies its bytes into host memory the pool keeps, and gives its device memory back; the
// address stays reserved. GLAKE_STATUS_INVALID_STATE when it is already swapped out.
glake_status glake_swap_out(struct glake_pool *pool, void *ptr);

// Swaps the allocation at `ptr` back in at the same address. GLAKE_STATUS_OUT_OF_MEMORY when
// the cap or the device is full (it stays swapped out, its bytes kept),
// GLAKE_STATUS_INVALID_STATE when it is not swapped out.
glake_status glake_swap_in(struct glake_pool *pool, void *ptr);

// Queues the swap-out of the swappable allocation at `ptr` on `copy` (a stream of the pool's
// device) and returns without waiting: the copy to a pinned buffer the pool keeps runs after
// the work queued on the allocation's streams; its device memory goes back once
// `glake_swap_finish` sees the copy done (until then it counts as resident).
// GLAKE_STATUS_INVALID_STATE when it is swapped out or already on its way out.
glake_status glake_swap_out_async(struct glake_pool *pool, void *ptr, glake_stream copy);

// Completes the queued swap-outs whose copies are done (with `wait` nonzero, all of them,
// waiting for their copies): their device memory goes back. Writes how many completed to
// `completed` (may be NULL).
//
// # Safety
// `completed` must be NULL or valid for a write.
glake_status glake_swap_finish(struct glake_pool *pool, uint32_t wait, uint64_t *completed);

// Brings the swappable allocation at `ptr` back without waiting: on its way out, the
// swap-out is cancelled (its memory never left); swapped out, new memory is mapped at the
// same address and filled by a copy on `copy` that the allocation's streams wait for. Errors
// as `glake_swap_in`.
glake_status glake_swap_in_async(struct glake_pool *pool, void *ptr, glake_stream copy);

// Marks the allocation at `ptr` as used on `stream` as well (like `Tensor.record_stream`).
glake_status glake_record_stream(struct glake_pool *pool, void *ptr, glake_stream stream);

// Checks the pool's own bookkeeping (blocks, segments, statistics, swapped allocations):
// GLAKE_STATUS_INTERNAL with the first inconsistency found as the message. For tests and
// fuzzing; it takes the pool's lock for a walk over all its blocks.
glake_status glake_pool_check(struct glake_pool *pool);

// Returns cached, unused memory to the driver (after waiting for the device).
glake_status glake_empty_cache(struct glake_pool *pool);

// Caps the pool's physical memory at `fraction` of the device's memory, in [0, 1], kept as
// the nearest byte (a fraction computed as budget / total gives the budget back exactly).
// Replaces any earlier cap.
glake_status glake_set_memory_fraction(struct glake_pool *pool, double fraction);

// Caps the pool's physical memory at `bytes` (more than the device has means the device's
// total; 0 is an error). Memory is created in whole granules, so the usable part of the cap
// is `bytes` rounded down to the granularity. Replaces any earlier cap.
glake_status glake_set_memory_limit(struct glake_pool *pool, uint64_t bytes);

// Writes the pool's cap on physical memory in bytes to `out_bytes`, and, when `out_fraction`
// is not NULL, the fraction last set (or the byte cap's share of the device) to it.
//
// # Safety
// `out_bytes` must be valid for a write (NULL is an error); `out_fraction` NULL or valid for a
// write.
glake_status glake_get_memory_limit(struct glake_pool *pool,
                                    uint64_t *out_bytes,
                                    double *out_fraction);

// Grants device `peer` access to all memory of the pool, now and for memory created later
// (a VMM range is invisible to a peer GPU until access is granted).
glake_status glake_pool_enable_peer_access(struct glake_pool *pool, int32_t peer);

// Copies the pool's statistics (PyTorch's memory_stats fields plus stitch counters).
//
// # Safety
// `out` must be NULL or valid for writing a `glake_stats`.
glake_status glake_get_stats(struct glake_pool *pool, struct glake_stats *out);

// Sets every peak statistic to its current value.
glake_status glake_reset_peak_stats(struct glake_pool *pool);

// Zeroes the running totals (allocated/freed) and event counters.
glake_status glake_reset_accumulated_stats(struct glake_pool *pool);

// A JSON snapshot of segments, blocks, stitched ranges and statistics. Free the string with
// `glake_string_free`.
//
// # Safety
// `out` must be NULL or valid for a write.
glake_status glake_snapshot_json(struct glake_pool *pool, char **out);

// The statistics as a JSON object with PyTorch's `memory_stats()` key names. Free the string
// with `glake_string_free`.
//
// # Safety
// `out` must be NULL or valid for a write.
glake_status glake_stats_json(struct glake_pool *pool, char **out);

// Frees a string returned by this library; NULL is ignored.
//
// # Safety
// `text` must be NULL or a string from this library, not freed before.
void glake_string_free(char *text);

// Creates a stream on the pool's device.
//
// # Safety
// `out` must be NULL or valid for a write.
glake_status glake_stream_create(struct glake_pool *pool, glake_stream *out);

// Destroys a stream made by `glake_stream_create`; queued work still completes.
glake_status glake_stream_destroy(struct glake_pool *pool, glake_stream stream);

// Waits for all work queued on `stream`.
glake_status glake_stream_synchronize(struct glake_pool *pool, glake_stream stream);

// Queues a copy of `size` bytes from host memory to device memory of the pool on `stream`.
//
// # Safety
// `src` must stay valid for `size` bytes until the stream has run the copy.
glake_status glake_copy_to_device(struct glake_pool *pool,
                                  void *dst,
                                  const void *src,
                                  size_t size,
                                  glake_stream stream);

// Queues a copy of `size` bytes from device memory to host memory on `stream`.
//
// # Safety
// `dst` must stay valid for `size` bytes until the stream has run the copy.
glake_status glake_copy_to_host(struct glake_pool *pool,
                                void *dst,
                                const void *src,
                                size_t size,
                                glake_stream stream);

// Makes the `nth` next call of kind `call` made by the pool fail with `status` (or panic
// inside the library, for `GLAKE_STATUS_PANIC`). The pool must have been created with
// `GLAKE_CONFIG_FAULT_INJECTION`. For testing how a program handles failures.
glake_status glake_pool_inject_fault(struct glake_pool *pool,
                                     uint32_t call,
                                     uint64_t nth,
                                     uint32_t status);

// Plans the profiled iteration (`n_ops` ops, `n_tensors` tensors, `base_bytes` never moved)
// for a peak of at most `target_bytes`: writes one choice per tensor to `choices_out` and the
// predicted iteration to `prediction_out` (may be NULL). When no plan reaches the target,
// returns `GLAKE_STATUS_OUT_OF_MEMORY`, writes nothing to `choices_out`, and writes the lowest
// peak reached to `prediction_out->peak_bytes`.
//
// # Safety
// `ops` and `tensors` point to arrays of the stated lengths (each tensor's `uses` to
// `n_uses` values), `config` to one config, `choices_out` to `n_tensors` writable choices.
glake_status glake_swap_plan(const struct glake_swap_op *ops,
                             size_t n_ops,
                             const struct glake_swap_tensor *tensors,
                             size_t n_tensors,
                             size_t base_bytes,
                             size_t target_bytes,
                             const struct glake_swap_config *config,
                             struct glake_swap_choice *choices_out,
                             struct glake_swap_prediction *prediction_out);

// Predicts the profiled iteration under the given `choices` (one per tensor), as
// [`glake_swap_plan`] predicts its own plans.
//
// # Safety
// As for [`glake_swap_plan`]; `choices` points to `n_tensors` readable choices and
// `prediction_out` to one writable prediction.
glake_status glake_swap_simulate(const struct glake_swap_op *ops,
                                 size_t n_ops,
                                 const struct glake_swap_tensor *tensors,
                                 size_t n_tensors,
                                 size_t base_bytes,
                                 const struct glake_swap_choice *choices,
                                 const struct glake_swap_config *config,
                                 struct glake_swap_prediction *prediction_out);

// Creates a profiler for the device of `pool`, which from now on reports its allocations and
// frees to it (replacing a profiler created on that pool before).
//
// # Safety
// `out` must be NULL or valid for a write.
glake_status glake_profiler_create(struct glake_pool *pool, struct glake_profiler **out);

// Destroys a profiler (its pool's reports then go nowhere). The handle is invalid afterwards.
glake_status glake_profiler_destroy(struct glake_profiler *profiler);

// Starts recording an iteration; anything recorded before is dropped.
glake_status glake_profiler_begin_iteration(struct glake_profiler *profiler);

// The stage (`glake_phase`) of the ops that begin from now on.
glake_status glake_profiler_set_phase(struct glake_profiler *profiler, uint32_t phase);

// An op named `name` (UTF-8, NUL-terminated) begins, its work queued on `stream`.
//
// # Safety
// `name` must be NULL or a NUL-terminated string.
glake_status glake_profiler_begin_op(struct glake_profiler *profiler,
                                     const char *name,
                                     glake_stream stream);

// The running op touches `bytes` at `ptr` (an input or an output).
glake_status glake_profiler_tensor(struct glake_profiler *profiler, void *ptr, size_t bytes);

// The running op has ended (all its work is queued on its stream).
glake_status glake_profiler_end_op(struct glake_profiler *profiler);

// Ends the iteration: waits for its last op's work, reads every op's time, and writes a
// summary to `out` (may be NULL).
//
// # Safety
// `out` must be NULL or valid for a write.
glake_status glake_profiler_end_iteration(struct glake_profiler *profiler,
                                          struct glake_profile_summary *out);

// Writes the default settings for `pool`'s device to `out`, with the environment's
// overrides (`GLAKE_SWAP_TARGET`: a fraction of the device when at most 1, else bytes;
// `GLAKE_SWAP_PREFETCH`, `GLAKE_SWAP_PREFERENCE`, `GLAKE_SWAP_WARMUP`,
// `GLAKE_SWAP_BANDWIDTH`). Without a target the whole device is the target.
//
// # Safety
// `out` must be NULL or valid for a write.
glake_status glake_smartswap_settings_default(struct glake_pool *pool,
                                              struct glake_smartswap_settings *out);

// Creates a session on `pool` with `settings`; the pool reports its allocations to it and
// makes the planned ones swappable (replacing a profiler or session made on it before). While
// the plan runs, the pool's soft limit is the target: it gives cached memory back before it
// grows past it, and never fails a request because of it.
// `GLAKE_STATUS_INVALID_ARGUMENT` for a zero target or bandwidth or an unknown preference.
//
// # Safety
// `settings` must be NULL or readable; `out` NULL or valid for a write.
glake_status glake_smartswap_create(struct glake_pool *pool,
                                    const struct glake_smartswap_settings *settings,
                                    struct glake_smartswap **out);

// Destroys a session: everything it has out comes back, the pool's cap and observer are
// restored. The handle is invalid afterwards.
glake_status glake_smartswap_destroy(struct glake_smartswap *session);

// An iteration (a training step) begins.
glake_status glake_smartswap_begin_iteration(struct glake_smartswap *session);

// The stage (`glake_phase`) of the ops that begin from now on.
glake_status glake_smartswap_set_phase(struct glake_smartswap *session, uint32_t phase);

// An op named `name` (UTF-8, NUL-terminated) begins on `stream`; under the plan, what it and
// the ops within the prefetch distance need is brought back first.
//
// # Safety
// `name` must be NULL or a NUL-terminated string.
glake_status glake_smartswap_begin_op(struct glake_smartswap *session,
                                      const char *name,
                                      glake_stream stream);

// The running op touches `bytes` at `ptr`; a planned allocation that is out comes back first.
glake_status glake_smartswap_tensor(struct glake_smartswap *session, void *ptr, size_t bytes);

// The running op has queued its work; what the plan moves out after it goes.
glake_status glake_smartswap_end_op(struct glake_smartswap *session);

// The iteration has ended: the profiled one is planned (`GLAKE_STATUS_OUT_OF_MEMORY` when no
// plan meets the target: the session warms up again), and anything still out comes back.
glake_status glake_smartswap_end_iteration(struct glake_smartswap *session);

// Writes what the session has done so far to `out`.
//
// # Safety
// `out` must be NULL or valid for a write.
glake_status glake_smartswap_get_report(struct glake_smartswap *session,
                                        struct glake_smartswap_report *out);

// Makes the calling thread's allocations from `pool` go to region `name` (1 to 255 bytes of
// UTF-8; made on first use) until the matching `glake_region_end`. Regions nest; other
// threads are not affected.
//
// # Safety
// `name` must be NULL or NUL-terminated.
glake_status glake_region_begin(struct glake_pool *pool, const char *name);

// Ends the calling thread's innermost region of `pool`. GLAKE_STATUS_INVALID_STATE when this
// thread has none open.
glake_status glake_region_end(struct glake_pool *pool);

// Gives the physical memory of region `name` back to the device, every address staying
// reserved: cached free memory of the region goes back whole, allocated bytes are copied to
// host memory (GLAKE_SLEEP_KEEP) or dropped. Waits for all work queued on the device first,
// and returns once the copies are done; with pinned host buffers (the default) each range's
// memory goes back as soon as its bytes are copied, while later ranges still copy. Until
// `glake_wake`, allocations in the region fail
// with GLAKE_STATUS_INVALID_STATE. GLAKE_STATUS_INVALID_ARGUMENT for an unknown region,
// GLAKE_STATUS_INVALID_STATE when it is already asleep. On another error no byte is lost:
// call again to finish, or wake.
//
// # Safety
// `name` must be NULL or NUL-terminated.
glake_status glake_sleep(struct glake_pool *pool, const char *name, uint32_t mode);

// Makes ahead of time the host buffers (and the copy engine) a first `glake_sleep` of region
// `name` in GLAKE_SLEEP_KEEP mode would make, so that it runs at the link's speed instead of
// the few GB/s of pinning memory. Call it once the region is filled (weights loaded), from
// any thread: the buffers are made without holding up other calls on the pool. They cover
// the region as it is now, and are kept until the pool is destroyed. `out_bytes` (may be
// NULL) receives the bytes made. On an error those made are kept; call again to finish.
//
// # Safety
// `name` must be NULL or NUL-terminated; `out_bytes` NULL or valid for a write.
glake_status glake_sleep_prepare(struct glake_pool *pool, const char *name, size_t *out_bytes);

// Maps region `name`'s memory back at the same addresses and restores the bytes it kept;
// returns once the copies are done, so work queued afterwards on any stream sees them.
// GLAKE_STATUS_INVALID_STATE when it is awake; GLAKE_STATUS_OUT_OF_MEMORY when the device or
// the cap has no room (the rest stays asleep with its bytes: free memory and call again).
//
// # Safety
// `name` must be NULL or NUL-terminated.
glake_status glake_wake(struct glake_pool *pool, const char *name);

// What region `name` holds now.
//
// # Safety
// `name` must be NULL or NUL-terminated; `out` NULL or valid for a write.
glake_status glake_get_region_info(struct glake_pool *pool,
                                   const char *name,
                                   struct glake_region_info *out);

// Creates a copy engine for device `device` of `backend` (a `glake_backend` value), relaying
// through every other device of that backend that can reach it unless
// `GLAKE_TRANSFER_NO_PEERS` is given. Starts its threads and pins its staging buffers now
// (tens of milliseconds): create one per device and keep it.
//
// # Safety
// `out` must be NULL or valid for a write.
glake_status glake_transfer_create(uint32_t backend,
                                   int32_t device,
                                   uint32_t flags,
                                   struct glake_transfer **out);

// Stops a copy engine and frees its staging memory (after waiting for its work). The handle
// is invalid afterwards.
glake_status glake_transfer_destroy(struct glake_transfer *transfer);

// Copies `bytes` from host memory at `src` (pageable, pinned or registered: any) to device
// memory at `dst` on the engine's device (from glake's pools or from anywhere else).
//
// Ordering is that of `cuMemcpyHtoDAsync` on `stream` (NULL: the default stream): the copy
// starts after the work queued on `stream` before the call, and work queued on `stream`
// afterwards sees the data. Without `GLAKE_MEMCPY_ASYNC` the call returns when the data has
// arrived. With it, a pageable `src` may be reused when the call returns (it has been read;
// a copy larger than the staging buffers therefore waits for the stream's earlier work, as
// the driver's own pageable copies do), while a page-locked `src` must stay unchanged until
// the stream reaches the copy.
//
// # Safety
// `src` must be valid for `bytes` bytes of reads (as long as said above); `dst` must be device
// memory of the engine's device.
glake_status glake_memcpy_htod(struct glake_transfer *transfer,
                               void *dst,
                               const void *src,
                               size_t bytes,
                               glake_stream stream,
                               uint32_t flags);

// Copies `bytes` from device memory at `src` on the engine's device to host memory at `dst`.
// Ordering as for `glake_memcpy_htod`. With `GLAKE_MEMCPY_ASYNC` a pageable `dst` holds the
// data when the call returns; a page-locked one once the stream has reached the copy.
//
// # Safety
// `dst` must be valid for `bytes` bytes of writes (as long as said above); `src` must be device
// memory of the engine's device.
glake_status glake_memcpy_dtoh(struct glake_transfer *transfer,
                               void *dst,
                               const void *src,
                               size_t bytes,
                               glake_stream stream,
                               uint32_t flags);

// Copies `count` pieces in `direction` (a `glake_copy_direction` value) as one copy: their
// chunks share the engine's lanes, so many tensors (a state dict) move at the speed of one
// large copy. Ordering, flags and host memory rules as for `glake_memcpy_htod` and
// `glake_memcpy_dtoh`, for every piece.
//
// # Safety
// `pieces` must point to `count` pieces (or be NULL with `count` 0), each valid as the
// single-copy calls require.
glake_status glake_memcpy_batch(struct glake_transfer *transfer,
                                uint32_t direction,
                                const struct glake_copy_piece *pieces,
                                size_t count,
                                glake_stream stream,
                                uint32_t flags);

// Copies the engine's counters to `out`.
//
// # Safety
// `out` must be NULL or valid for a write.
glake_status glake_transfer_get_stats(struct glake_transfer *transfer,
                                      struct glake_transfer_stats *out);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* GLAKE_H */
