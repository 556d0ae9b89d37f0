/* The C ABI between glake's native PyTorch allocator (glake_allocator.cpp, compiled against the
 * installed torch) and libgmlake.so (the pools, one per device). Nothing here throws: every
 * call returns a status, and the failure's text is in gmlake_last_error() on the same thread.
 * Private pools (PyTorch's MempoolId_t) are named by two 64-bit ids; {0, 0} is no pool. */
#ifndef GMLAKE_NATIVE_H
#define GMLAKE_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#include "glake.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Statuses. */
#define GMLAKE_N_OK 0
#define GMLAKE_N_OUT_OF_MEMORY 1
#define GMLAKE_N_INVALID 2 /* bad argument, unknown pointer or pool */
#define GMLAKE_N_FAILED 3  /* any other failure (a driver call, a panic caught) */

/* Block states in a snapshot. */
#define GMLAKE_N_BLOCK_ALLOCATED 0 /* allocated on its own */
#define GMLAKE_N_BLOCK_STITCHED 1  /* a piece of a live stitched allocation */
#define GMLAKE_N_BLOCK_PENDING 2   /* freed, waiting for other streams */
#define GMLAKE_N_BLOCK_FREE 3

/* Segment events. */
#define GMLAKE_N_SEGMENT_ALLOC 0 /* physical memory created and mapped */
#define GMLAKE_N_SEGMENT_FREE 1  /* released to the driver */

typedef struct gmlake_n_pool_id {
  uint64_t first;
  uint64_t second;
} gmlake_n_pool_id;

typedef struct gmlake_n_block {
  uint64_t address;
  uint64_t size;
  uint64_t requested_size; /* 0 when free or a stitched piece */
  int32_t state;           /* GMLAKE_N_BLOCK_* */
  uint64_t stream;         /* the stream that owns it, 0 when none */
} gmlake_n_block;

typedef struct gmlake_n_segment {
  uint64_t address;
  uint64_t total_size;
  uint64_t allocated_size; /* blocks not free */
  uint64_t requested_size; /* sum of the blocks' requested sizes */
  uint64_t stream;         /* the stream of its first owned block, 0 when none */
  int32_t is_large;        /* 1 for the large pool, 0 for the small */
  gmlake_n_pool_id pool;   /* the private pool it belongs to, {0, 0} for the shared pool */
} gmlake_n_segment;

typedef struct gmlake_n_stitched {
  uint64_t address;
  uint64_t size;
  int32_t in_use;
  uint32_t pieces;
} gmlake_n_stitched;

typedef struct gmlake_n_event {
  int32_t kind; /* GMLAKE_N_SEGMENT_* */
  int32_t device;
  uint64_t address;
  uint64_t size;
  gmlake_n_pool_id pool;
} gmlake_n_event;

/* The text of the calling thread's last failure ("" if none). */
const char *gmlake_last_error(void);

/* Allocates `size` (> 0) bytes on `device` for `stream`, from private pool `pool` when it is
 * not {0, 0} (the pool must be open). `requested` (at most `size`) is what the caller asked for
 * before rounding it up itself (PyTorch's roundup_power2_divisions): the statistics book it as
 * requested; more than `size` is GMLAKE_N_INVALID. `*out_stitched` (may be NULL) gets the
 * number of pieces when the memory is a stitched range, else 0. */
int gmlake_n_malloc(int device, size_t size, size_t requested, void *stream,
                    gmlake_n_pool_id pool, void **out, uint32_t *out_stitched);
/* Allocates `size` bytes (`requested` asked for) on `device` for `stream` from the cached free
 * blocks of `pool` ({0, 0}: the shared pool) alone: GMLAKE_N_OUT_OF_MEMORY, with no
 * out-of-memory counted, when none fits; nothing is created or waited for (a pool lent on
 * out-of-memory serves a request that failed elsewhere this way, as in PyTorch). */
int gmlake_n_malloc_cached(int device, size_t size, size_t requested, void *stream,
                           gmlake_n_pool_id pool, void **out);
/* Takes one out-of-memory off `device`'s statistics (the failed request was served another
 * way, and PyTorch counts none then). */
int gmlake_n_uncount_oom(int device);
/* Allocates exactly `[address, address+size)` again on `device` for `stream`, from `pool`
 * ({0, 0}: the shared pool), counted as any malloc: restoring a graph pool's checkpoint brings
 * allocations freed since back at the addresses its graphs use. `size` is the size the
 * allocation had (not rounded again). GMLAKE_N_INVALID when the range is not inside one free
 * block of that pool usable on `stream`, or the device has no pool yet; nothing changes then. */
int gmlake_n_malloc_at(int device, void *address, size_t size, void *stream,
                       gmlake_n_pool_id pool);
/* Frees `ptr`; `device` is a hint (-1: any). `*out_device` (may be NULL) gets the device. */
int gmlake_n_free(void *ptr, int device, int *out_device);
int gmlake_n_record_stream(void *ptr, void *stream);
/* Returns the unused cached memory of `device` (-1: every device) to the driver. */
int gmlake_n_empty_cache(int device);
int gmlake_n_set_memory_fraction(int device, double fraction);
/* Counts `bytes` a memory pool's own allocator is about to make on `device` against the
 * device's cap, as PyTorch does (cached memory goes back to the driver first when they do not
 * fit); GMLAKE_N_OUT_OF_MEMORY, with nothing counted, when they still do not. Uncounted when
 * that memory goes back to its allocator. */
int gmlake_n_count_outside(int device, size_t bytes);
int gmlake_n_uncount_outside(int device, size_t bytes);
int gmlake_n_memory_fraction(int device, double *out);
/* Statistics of `device`; all zero for a device not used yet. */
int gmlake_n_stats(int device, glake_stats *out);
/* torch.cuda.reset_peak_memory_stats / reset_accumulated_memory_stats of `device`. */
void gmlake_reset_peak_stats(int device);
void gmlake_reset_accumulated_stats(int device);
/* The allocation containing `ptr`: its start and size. */
int gmlake_n_base(void *ptr, void **out_base, size_t *out_size);
/* Whether `device`'s pool exists yet (0 or 1). */
int gmlake_n_device_used(int device);

/* Private pools. retain: create or take one more use; begin: retain and route requests to it
 * (a capture or pool context may be underway: driver calls run in relaxed capture mode and
 * frees needing events are held back until the last routing ends); end: stop one routing;
 * release: drop one use, at the last its memory joins the shared pool. */
int gmlake_n_pool_retain(int device, gmlake_n_pool_id pool);
int gmlake_n_pool_begin(int device, gmlake_n_pool_id pool);
int gmlake_n_pool_end(int device, gmlake_n_pool_id pool);
int gmlake_n_pool_release(int device, gmlake_n_pool_id pool);
/* Uses of `pool` (0 when it is not open). */
int gmlake_n_pool_use_count(int device, gmlake_n_pool_id pool, int *out);
/* Calls `cb` with each live allocation of `pool`; GMLAKE_N_INVALID when it is not open. */
int gmlake_n_pool_live(int device, gmlake_n_pool_id pool, void *ctx,
                       void (*cb)(void *ctx, uint64_t address));

/* Calls `segment` once per segment of `device` in address order with its blocks, then
 * `stitched` (may be NULL) once per stitched range. Nothing when the device is not used yet.
 * The callbacks must not call back into libgmlake. */
int gmlake_n_snapshot(int device, void *ctx,
                      void (*segment)(void *ctx, const gmlake_n_segment *segment,
                                      const gmlake_n_block *blocks, size_t count),
                      void (*stitched)(void *ctx, const gmlake_n_stitched *range));

/* Segment events: while recording is on, the segments created and released by a thread's
 * calls are kept for that thread, in order, until it takes them. */
void gmlake_n_record_events(int on);
/* Hands the calling thread's events to `cb` in order and forgets them; returns how many. */
size_t gmlake_n_take_events(void *ctx, void (*cb)(void *ctx, const gmlake_n_event *event));

#ifdef __cplusplus
}
#endif

#endif
