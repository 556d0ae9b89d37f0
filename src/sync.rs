//! Locking that survives a panic elsewhere.

use std::sync::{Mutex, MutexGuard};

/// Locks `mutex`, recovering the data if another thread panicked while holding it: every state
/// guarded this way is updated in steps that leave it usable, and an allocator or copy engine
/// must go on serving the threads that did not panic.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}
