//! Pool handles for C. A handle is a number that is never reused, looked up in a registry on
//! every call, so a handle used after `glake_pool_destroy` (or a made-up one) is an error
//! instead of undefined behaviour, and a call racing a destroy keeps its pool alive until done.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::{glake_status, Failure};
use crate::device::fault::FaultDevice;
use crate::pool::Pool;

/// A registered pool, with its fault injector when it was created with one.
#[derive(Clone)]
pub(crate) struct Entry {
    pub pool: Arc<Pool>,
    pub fault: Option<Arc<FaultDevice>>,
}

type Registry = HashMap<usize, Entry>;

fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(HashMap::new()))
}

fn locked() -> std::sync::MutexGuard<'static, Registry> {
    match registry().lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// Registers a pool and returns its handle value (never 0, never reused).
pub(crate) fn insert(pool: Pool, fault: Option<Arc<FaultDevice>>) -> usize {
    // Start high and step by 16 so that handles look like aligned pointers and never collide
    // with small integers a caller might pass by mistake.
    static NEXT: AtomicUsize = AtomicUsize::new(0x6c_0000);
    let id = NEXT.fetch_add(16, Ordering::Relaxed);
    locked().insert(
        id,
        Entry {
            pool: Arc::new(pool),
            fault,
        },
    );
    id
}

fn invalid(id: usize) -> Failure {
    if id == 0 {
        Failure::null("pool")
    } else {
        Failure::new(
            glake_status::GLAKE_STATUS_INVALID_HANDLE,
            format!("pool handle {id:#x} is not a live pool (destroyed, or never created)"),
        )
    }
}

/// The pool behind a handle.
pub(crate) fn get(id: usize) -> Result<Arc<Pool>, Failure> {
    entry(id).map(|e| e.pool)
}

pub(crate) fn entry(id: usize) -> Result<Entry, Failure> {
    locked().get(&id).cloned().ok_or_else(|| invalid(id))
}

/// Removes a handle; the pool is dropped once no call still uses it.
pub(crate) fn remove(id: usize) -> Result<Arc<Pool>, Failure> {
    locked()
        .remove(&id)
        .map(|e| e.pool)
        .ok_or_else(|| invalid(id))
}
