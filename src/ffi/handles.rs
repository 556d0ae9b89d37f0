//! Handles for C. A handle is a number that is never reused, looked up in a registry on every
//! call, so a handle used after its destroy call (or a made-up one) is an error instead of
//! undefined behaviour, and a call racing a destroy keeps its object alive until done. Pools and
//! copy engines and profilers have a registry each; their numbers come from one counter, so a handle of one
//! kind is never a live handle of another.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::{glake_status, Failure};
use crate::device::fault::FaultDevice;
use crate::pool::Pool;
use crate::sync::lock;
use crate::transfer::Engine;

/// A registered pool, with its fault injector when it was created with one.
#[derive(Clone)]
pub(crate) struct Entry {
    pub pool: Arc<Pool>,
    pub fault: Option<Arc<FaultDevice>>,
}

/// Live objects of one kind by handle value.
pub(crate) struct Registry<T> {
    what: &'static str,
    live: Mutex<HashMap<usize, T>>,
}

impl<T: Clone> Registry<T> {
    fn new(what: &'static str) -> Self {
        Registry {
            what,
            live: Mutex::new(HashMap::new()),
        }
    }

    fn locked(&self) -> MutexGuard<'_, HashMap<usize, T>> {
        lock(&self.live)
    }

    /// Registers `value` and returns its handle value (never 0, never reused).
    pub(crate) fn insert(&self, value: T) -> usize {
        // Start high and step by 16 so that handles look like aligned pointers and never
        // collide with small integers a caller might pass by mistake.
        static NEXT: AtomicUsize = AtomicUsize::new(0x6c_0000);
        let id = NEXT.fetch_add(16, Ordering::Relaxed);
        self.locked().insert(id, value);
        id
    }

    fn invalid(&self, id: usize) -> Failure {
        if id == 0 {
            Failure::null(self.what)
        } else {
            Failure::new(
                glake_status::GLAKE_STATUS_INVALID_HANDLE,
                format!(
                    "{what} handle {id:#x} is not a live {what} (destroyed, or never created)",
                    what = self.what
                ),
            )
        }
    }

    /// The object behind a handle.
    pub(crate) fn get(&self, id: usize) -> Result<T, Failure> {
        self.locked()
            .get(&id)
            .cloned()
            .ok_or_else(|| self.invalid(id))
    }

    /// Removes a handle; the object is dropped once no call still uses it.
    pub(crate) fn remove(&self, id: usize) -> Result<T, Failure> {
        self.locked().remove(&id).ok_or_else(|| self.invalid(id))
    }
}

/// The pools made through the C API.
pub(crate) fn pools() -> &'static Registry<Entry> {
    static POOLS: OnceLock<Registry<Entry>> = OnceLock::new();
    POOLS.get_or_init(|| Registry::new("pool"))
}

/// The copy engines made through the C API.
pub(crate) fn transfers() -> &'static Registry<Arc<Engine>> {
    static TRANSFERS: OnceLock<Registry<Arc<Engine>>> = OnceLock::new();
    TRANSFERS.get_or_init(|| Registry::new("transfer"))
}

/// The SmartSwap profilers made through the C API.
pub(crate) fn profilers() -> &'static Registry<Arc<Mutex<crate::smartswap::Profiler>>> {
    static PROFILERS: OnceLock<Registry<Arc<Mutex<crate::smartswap::Profiler>>>> = OnceLock::new();
    PROFILERS.get_or_init(|| Registry::new("profiler"))
}

/// The SmartSwap sessions made through the C API.
pub(crate) fn sessions() -> &'static Registry<Arc<Mutex<crate::smartswap::Session>>> {
    static SESSIONS: OnceLock<Registry<Arc<Mutex<crate::smartswap::Session>>>> = OnceLock::new();
    SESSIONS.get_or_init(|| Registry::new("smartswap session"))
}

/// Registers a pool and returns its handle value.
pub(crate) fn insert(pool: Pool, fault: Option<Arc<FaultDevice>>) -> usize {
    pools().insert(Entry {
        pool: Arc::new(pool),
        fault,
    })
}

/// The pool behind a handle.
pub(crate) fn get(id: usize) -> Result<Arc<Pool>, Failure> {
    entry(id).map(|e| e.pool)
}

pub(crate) fn entry(id: usize) -> Result<Entry, Failure> {
    pools().get(id)
}

/// Removes a pool handle; the pool is dropped once no call still uses it.
pub(crate) fn remove(id: usize) -> Result<Arc<Pool>, Failure> {
    pools().remove(id).map(|e| e.pool)
}
