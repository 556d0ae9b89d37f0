//! The pools of the process, one per device, created on first use with the configuration of
//! the environment, and the routing of requests to private pools (CUDA graph captures).

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use glake::device::{self, BackendChoice};
use glake::pool::PrivatePoolId;
use glake::{Config, Error, Pool, Result};

/// Most device ordinals served (a fixed table keeps lookups free of locks).
pub const MAX_DEVICES: usize = 64;

static POOLS: [OnceLock<Arc<Pool>>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];
static CREATING: Mutex<()> = Mutex::new(());

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The table index of `device`; an error when the ordinal is out of range.
pub fn index(device: i32) -> Result<usize> {
    usize::try_from(device)
        .ok()
        .filter(|&i| i < MAX_DEVICES)
        .ok_or_else(|| Error::invalid_argument(format!("device ordinal {device} is out of range")))
}

/// The backend of the pools: CUDA unless `GLAKE_BACKEND` says `host` (tests without a GPU) or
/// `auto`.
fn backend() -> BackendChoice {
    match std::env::var("GLAKE_BACKEND").as_deref() {
        Ok("host") => BackendChoice::Host,
        Ok("auto") => BackendChoice::Auto,
        _ => BackendChoice::Cuda,
    }
}

/// The pool of `device`, if it exists.
pub fn existing(device: i32) -> Option<&'static Arc<Pool>> {
    // No error is built for a device out of range: frees ask with -1 (any device).
    let i = usize::try_from(device).ok()?;
    POOLS.get(i).and_then(|p| p.get())
}

/// Every pool that exists, with its device ordinal.
pub fn all() -> impl Iterator<Item = (i32, &'static Arc<Pool>)> {
    POOLS
        .iter()
        .enumerate()
        .filter_map(|(i, p)| p.get().map(|p| (i as i32, p)))
}

/// The pool of `device`, created on first use. When a process uses several devices, each
/// pool's memory is made accessible to every peer that can reach it (PyTorch copies between
/// devices directly, and virtual memory gets no access from cudaDeviceEnablePeerAccess).
pub fn pool(device: i32) -> Result<&'static Arc<Pool>> {
    let slot = &POOLS[index(device)?];
    if let Some(pool) = slot.get() {
        return Ok(pool);
    }
    let _creating = locked(&CREATING);
    // The native allocator path never calls gmlake_init: GLAKE_LOG works from here too.
    glake::init_logging();
    if let Some(pool) = slot.get() {
        return Ok(pool);
    }
    let pool = Arc::new(Pool::new(
        device::open(backend(), device, glake::config::host_options_from_env())?,
        Config::from_env(),
    )?);
    for (other, existing) in all() {
        grant(&pool, other);
        grant(existing, device);
    }
    Ok(slot.get_or_init(|| pool))
}

fn grant(pool: &Pool, peer: i32) {
    match pool.device().can_access_peer(peer) {
        Ok(true) => {
            if let Err(err) = pool.enable_peer_access(peer) {
                log::warn!(
                    "glake: device {peer} gets no access to device {}'s memory: {err}",
                    pool.device().ordinal()
                );
            }
        }
        Ok(false) => {}
        Err(err) => log::warn!("glake: peer access query failed: {err}"),
    }
}

extern "C" {
    fn gmlake_cxx_filter_call(filter: *mut c_void, stream: *mut c_void) -> i32;
    fn gmlake_cxx_filter_drop(filter: *mut c_void);
}

/// A `std::function<bool(cudaStream_t)>` owned by the C++ half.
struct Filter(*mut c_void);

// SAFETY: the filter is only called and dropped under the routing lock, one thread at a time;
// PyTorch's filters (stream capture queries) may run on any thread.
unsafe impl Send for Filter {}

impl Drop for Filter {
    fn drop(&mut self) {
        // SAFETY: the pointer came from gmlake_cxx_filter_take and is dropped once.
        unsafe { gmlake_cxx_filter_drop(self.0) }
    }
}

struct Route {
    pool: PrivatePoolId,
    filter: Filter,
}

static ROUTES: [Mutex<Vec<Route>>; MAX_DEVICES] = [const { Mutex::new(Vec::new()) }; MAX_DEVICES];
static ACTIVE: [AtomicUsize; MAX_DEVICES] = [const { AtomicUsize::new(0) }; MAX_DEVICES];

/// Starts routing the requests of `device` whose stream `filter` selects to private pool `id`.
/// `filter` is an owned C++ filter (from `gmlake_cxx_filter_take`).
pub fn begin_route(device: i32, id: PrivatePoolId, filter: *mut c_void) -> Result<()> {
    let filter = Filter(filter);
    let i = index(device)?;
    pool(device)?.begin_private(id);
    locked(&ROUTES[i]).push(Route { pool: id, filter });
    ACTIVE[i].fetch_add(1, Ordering::AcqRel);
    Ok(())
}

/// Ends the latest routing of `device` to `id`.
pub fn end_route(device: i32, id: PrivatePoolId) -> Result<()> {
    let i = index(device)?;
    let removed = {
        let mut routes = locked(&ROUTES[i]);
        routes
            .iter()
            .rposition(|r| r.pool == id)
            .map(|at| routes.remove(at))
    };
    if removed.is_none() {
        return Err(Error::new(
            glake::ErrorKind::InvalidState,
            format!("no routing of device {device} to pool {id:?} to end"),
        ));
    }
    ACTIVE[i].fetch_sub(1, Ordering::AcqRel);
    pool(device)?.end_private(id)
}

/// The private pool a request of `device` on `stream` goes to, if any.
pub fn route_of(device: i32, stream: *mut c_void) -> Option<PrivatePoolId> {
    let i = index(device).ok()?;
    if ACTIVE[i].load(Ordering::Acquire) == 0 {
        return None;
    }
    let routes = locked(&ROUTES[i]);
    routes.iter().rev().find_map(|r| {
        // SAFETY: the filter is live while its route is listed; the lock serialises calls.
        let selected = unsafe { gmlake_cxx_filter_call(r.filter.0, stream) };
        if selected < 0 {
            log::warn!("glake: a capture stream filter failed; the request uses the shared pool");
        }
        (selected == 1).then_some(r.pool)
    })
}
