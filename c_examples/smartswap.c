/* A training loop that marks its ops with SmartSwap's hooks and runs under a memory target
 * 60% of what its steps need: the session warms up, profiles a step, plans, and from then on
 * swaps activations out after the op the plan names and back before their use, at the same
 * addresses. Each layer's activation is checked when its backward reads it. */
#include <string.h>

#include "example.h"

#define LAYERS 8
#define STEPS 5

int main(void) {
  const size_t act = 16 * MIB;
  glake_pool *pool = example_pool();
  glake_smartswap *session = NULL;
  glake_smartswap_settings settings;
  glake_smartswap_report report;
  glake_stats stats;
  unsigned char *data = malloc(act), *back = malloc(act);
  void *acts[LAYERS];
  int step, layer, failed = 0;

  if (data == NULL || back == NULL) return 1;
  memset(&settings, 0, sizeof settings);
  settings.target_bytes = LAYERS * act * 6 / 10;
  settings.warmup_iterations = 1;
  settings.config.d2h_bytes_per_s = 50000000000ull; /* what the link moves, about */
  settings.config.h2d_bytes_per_s = 50000000000ull;
  settings.config.prefetch = 1;
  settings.config.preference = GLAKE_SWAP_BETTER_PERFORMANCE;
  CHECK(glake_smartswap_create(pool, &settings, &session));
  for (step = 0; step < STEPS; step++) {
    CHECK(glake_reset_peak_stats(pool));
    CHECK(glake_smartswap_begin_iteration(session));
    CHECK(glake_smartswap_set_phase(session, GLAKE_PHASE_FORWARD));
    for (layer = 0; layer < LAYERS; layer++) {
      CHECK(glake_smartswap_begin_op(session, "layer_forward", NULL));
      CHECK(glake_malloc(pool, act, NULL, &acts[layer]));
      CHECK(glake_smartswap_tensor(session, acts[layer], act));
      memset(data, step * LAYERS + layer, act); /* the layer's "kernel" */
      CHECK(glake_copy_to_device(pool, acts[layer], data, act, NULL));
      CHECK(glake_smartswap_end_op(session));
    }
    CHECK(glake_smartswap_set_phase(session, GLAKE_PHASE_BACKWARD));
    for (layer = LAYERS - 1; layer >= 0; layer--) {
      CHECK(glake_smartswap_begin_op(session, "layer_backward", NULL));
      CHECK(glake_smartswap_tensor(session, acts[layer], act));
      CHECK(glake_copy_to_host(pool, back, acts[layer], act, NULL));
      CHECK(glake_stream_synchronize(pool, NULL));
      memset(data, step * LAYERS + layer, act);
      if (memcmp(back, data, act) != 0) failed = 1;
      CHECK(glake_free(pool, acts[layer]));
      CHECK(glake_smartswap_end_op(session));
    }
    CHECK(glake_smartswap_end_iteration(session));
    CHECK(glake_get_stats(pool, &stats));
    CHECK(glake_smartswap_get_report(session, &report));
    printf("step %d: peak reserved %lld MiB (target %llu MiB), swapped out %llu so far, then %s\n",
           step,
           (long long)(stats.reserved_bytes.all.peak >> 20),
           (unsigned long long)(settings.target_bytes >> 20),
           (unsigned long long)report.swapped_out,
           report.phase == GLAKE_SMARTSWAP_STABLE    ? "under the plan"
           : report.phase == GLAKE_SMARTSWAP_PROFILE ? "profiling"
                                                     : "warming up");
    if (step >= 2 && (uint64_t)stats.reserved_bytes.all.peak > settings.target_bytes) failed = 1;
  }
  printf("plan: %llu activations (%llu MiB) swapped per step, predicted peak %llu MiB\n",
         (unsigned long long)report.planned_swaps,
         (unsigned long long)(report.planned_swap_bytes >> 20),
         (unsigned long long)(report.predicted_peak_bytes >> 20));
  CHECK(glake_smartswap_destroy(session));
  CHECK(glake_pool_destroy(pool));
  free(data);
  free(back);
  if (failed || report.planned_swaps == 0) {
    fprintf(stderr, "the target was missed or an activation changed\n");
    return 1;
  }
  return 0;
}
