//! Builds tests/native.cpp against `python/glake/native/gmlake_native.h` and this crate's
//! libgmlake.so, and runs each of its scenarios in a process of its own on the host backend:
//! the `gmlake_n_*` functions called through the header's C signatures and struct layouts.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn binary() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        common::build(
            "native.cpp",
            "gmlake_native",
            &["include", "python/glake/native"],
        )
    })
}

fn scenario(name: &str) {
    common::run(binary(), &[name], &format!("{name} passed"));
}

#[test]
fn malloc_and_free_round_trip() {
    scenario("round_trip");
}

#[test]
fn out_of_memory_is_its_own_status_with_a_message() {
    scenario("out_of_memory");
}

#[test]
fn outside_memory_shares_the_cap() {
    scenario("outside_memory");
}

#[test]
fn invalid_pointers_are_refused_and_nothing_is_lost() {
    scenario("invalid_pointers");
}

#[test]
fn private_pools_count_uses_and_hold_their_segments() {
    scenario("private_pools");
}

#[test]
fn segment_events_are_kept_per_thread_while_recording() {
    scenario("segment_events");
}

#[test]
fn stats_match_the_snapshot() {
    scenario("stats_match_snapshot");
}

#[test]
fn stitched_allocations_report_their_pieces() {
    scenario("stitched");
}

#[test]
fn malloc_at_restores_freed_allocations_of_a_graph_pool() {
    scenario("malloc_at");
}

#[test]
fn pools_lent_on_out_of_memory_serve_from_their_cache_and_count_nothing() {
    scenario("lent_pools");
}

/// A seeded random soak of the whole ABI, valid and hostile calls mixed (3 seeds x 3000 calls;
/// GLAKE_SOAK_OPS=N sets the calls per seed for a long run).
#[test]
fn random_calls_keep_the_model_and_never_crash() {
    scenario("soak");
}
