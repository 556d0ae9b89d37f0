//! GLake: a caching GPU allocator on CUDA virtual memory management that stitches free
//! fragments into contiguous virtual ranges instead of reserving more memory.
//!
//! Layers, top to bottom: [`ffi`] (C API) -> [`pool`], [`stitch`], [`stats`], [`config`]
//! -> [`device`] (the only seam that touches a driver).
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod config;
pub mod device;
pub mod error;
pub mod pool;
pub mod stats;
pub mod stitch;

pub use config::Config;
pub use device::{BackendChoice, Stream};
pub use error::{Error, ErrorKind, Result};
pub use pool::Pool;
