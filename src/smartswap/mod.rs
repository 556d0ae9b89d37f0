//! SmartSwap at run time, over the device seam: what the device-free core in [`crate::swap`]
//! needs from a running program.
//!
//! - [`profiler`]: op hooks and the pool's allocations recorded into an iteration profile,
//!   with each op's device time from timed events.

pub mod profiler;

pub use profiler::{attach, Profiler};
