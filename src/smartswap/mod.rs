//! SmartSwap at run time, over the device seam: what the device-free core in [`crate::swap`]
//! needs from a running program.
//!
//! - [`profiler`]: op hooks and the pool's allocations recorded into an iteration profile,
//!   with each op's device time from timed events.
//! - [`session`]: warm-up, a profiled iteration, the planner, and an executor swapping the
//!   planned allocations at the hooks, for native training loops.

pub mod profiler;
pub mod session;

pub use profiler::{attach, Profiler};
pub use session::{Report, Session, SessionPhase, Settings};
