//! A wrapper around any backend that fails chosen calls, and counts every call, for tests:
//! "fail the 3rd map from now" exercises each clean-up path of the allocator in turn.

use std::collections::HashMap;
use std::sync::Mutex;

use super::interpose::{Interposed, Interposer};
use super::{CallKind, SharedDevice};
use crate::error::{Error, ErrorKind, Result};

/// What an injected failure does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Injected {
    Fail(ErrorKind),
    /// Panics inside the call: checks that panics never cross the C boundary.
    Panic,
}

#[derive(Debug, Default)]
struct Plan {
    calls: HashMap<CallKind, u64>,
    /// kind -> (call number that fails, what it does)
    failures: HashMap<CallKind, (u64, Injected)>,
    injected: u64,
}

/// The failure plan of a [`FaultDevice`], run around each of its driver calls.
#[derive(Debug, Default)]
pub struct FaultPlan {
    plan: Mutex<Plan>,
}

impl FaultPlan {
    fn plan(&self) -> std::sync::MutexGuard<'_, Plan> {
        crate::sync::lock(&self.plan)
    }
}

impl Interposer for FaultPlan {
    /// Counts the call and fails (or panics) where the plan says so.
    fn around<T>(&self, kind: CallKind, call: impl FnOnce() -> Result<T>) -> Result<T> {
        let mut plan = self.plan();
        let count = plan.calls.entry(kind).or_insert(0);
        *count += 1;
        let count = *count;
        if let Some(&(at, what)) = plan.failures.get(&kind) {
            if at == count {
                plan.failures.remove(&kind);
                plan.injected += 1;
                let message = format!("injected failure of {kind:?} call {count}");
                drop(plan);
                match what {
                    Injected::Fail(error) => return Err(Error::new(error, message)),
                    Injected::Panic => panic!("{message}"),
                }
            }
        }
        drop(plan);
        call()
    }
}

/// Wraps a device; see the module docs.
pub type FaultDevice = Interposed<FaultPlan>;

impl FaultDevice {
    pub fn new(inner: SharedDevice) -> Self {
        Interposed::with(inner, FaultPlan::default())
    }

    /// Makes the `nth` call of `kind` from now (1 = the next one) fail with a driver error.
    pub fn fail_nth(&self, kind: CallKind, nth: u64) {
        self.fail_nth_with(kind, nth, ErrorKind::Driver);
    }

    /// Like [`FaultDevice::fail_nth`], returning an error of `error` kind.
    pub fn fail_nth_with(&self, kind: CallKind, nth: u64, error: ErrorKind) {
        self.plan_nth(kind, nth, Injected::Fail(error));
    }

    /// Makes the `nth` call of `kind` from now panic.
    pub fn panic_nth(&self, kind: CallKind, nth: u64) {
        self.plan_nth(kind, nth, Injected::Panic);
    }

    fn plan_nth(&self, kind: CallKind, nth: u64, what: Injected) {
        let mut plan = self.hook().plan();
        let done = plan.calls.get(&kind).copied().unwrap_or(0);
        plan.failures.insert(kind, (done + nth.max(1), what));
    }

    /// Forgets all planned failures.
    pub fn clear(&self) {
        self.hook().plan().failures.clear();
    }

    /// Calls of `kind` so far.
    pub fn calls(&self, kind: CallKind) -> u64 {
        self.hook().plan().calls.get(&kind).copied().unwrap_or(0)
    }

    /// Failures injected so far.
    pub fn injected(&self) -> u64 {
        self.hook().plan().injected
    }
}
