//! GLake: a caching GPU allocator on CUDA virtual memory management that stitches free
//! fragments into contiguous virtual ranges instead of reserving more memory.
//!
//! Layers, top to bottom: [`ffi`] (C API) -> [`pool`], [`stitch`], [`transfer`], [`stats`],
//! [`config`] -> [`device`] (the only seam that touches a driver).
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod config;
pub mod dedup;
pub mod device;
pub mod error;
pub mod ffi;
pub mod pool;
pub mod smartswap;
pub mod stats;
pub mod stitch;
pub mod swap;
mod sync;
pub mod transfer;

pub use config::{Config, TransferConfig};
pub use device::{BackendChoice, Stream};
pub use error::{Error, ErrorKind, Result};
pub use pool::Pool;

/// Installs the `env_logger` logger reading `GLAKE_LOG` (for example `GLAKE_LOG=debug` shows
/// stitch events). Does nothing if the program already installed a logger.
pub fn init_logging() {
    let env = env_logger::Env::new().filter_or("GLAKE_LOG", "warn");
    let _ = env_logger::Builder::from_env(env).try_init();
}
