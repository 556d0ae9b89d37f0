//! Telling an observer about allocations as they are made and freed: SmartSwap's profiler
//! learns each tensor's life from them. One optional observer per pool, called under the
//! pool's lock (so it sees every allocation in order): it must be quick and must not call
//! back into the pool. Likewise one optional placement, asked before each shared-pool
//! allocation whether it should be swappable (SmartSwap's executor asks for the allocations
//! its plan moves).

use std::sync::Arc;

use super::{Inner, Pool};
use crate::device::DevicePtr;
use crate::sync::lock;

/// What a pool tells its observer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocationEvent {
    /// `bytes` (as handed out, rounded) were allocated at `ptr`.
    Allocated { ptr: DevicePtr, bytes: usize },
    /// The allocation at `ptr` was freed (its memory may be reused later, after its streams).
    Freed { ptr: DevicePtr },
}

/// A pool's observer.
pub type AllocationObserver = Arc<dyn Fn(AllocationEvent) + Send + Sync>;

/// Asked with the requested bytes before an allocation from the shared pool: true makes it a
/// swappable allocation (as [`Pool::malloc_swappable`]).
pub type SwapPlacement = Arc<dyn Fn(usize) -> bool + Send + Sync>;

impl Pool {
    /// Sets (or, with None, removes) the observer told of every allocation and free from now.
    pub fn set_observer(&self, observer: Option<AllocationObserver>) {
        lock(&self.inner).observer = observer;
    }

    /// Sets (or, with None, removes) the placement asked before each shared-pool allocation.
    pub fn set_swap_placement(&self, placement: Option<SwapPlacement>) {
        lock(&self.inner).placement = placement;
    }
}

impl Inner {
    /// Tells the observer, if any, of `event`.
    pub(super) fn observe(&self, event: AllocationEvent) {
        if let Some(observer) = &self.observer {
            observer(event);
        }
    }

    /// Whether the placement, if any, wants an allocation of `size` bytes swappable.
    pub(super) fn wants_swappable(&self, size: usize) -> bool {
        self.placement
            .as_ref()
            .is_some_and(|placement| placement(size))
    }
}
