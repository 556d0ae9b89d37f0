//! A wrapper around any backend that fails chosen calls, and counts every call, for tests:
//! "fail the 3rd map from now" exercises each clean-up path of the allocator in turn. It also
//! records where in the source each call came from, so that a sweep can tell which call sites
//! it failed.

use std::collections::{HashMap, HashSet};
use std::panic::Location;
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
    /// Makes the call, then reports a failure: a wait that fails after it has waited, so that
    /// no work is left running where a test reads or frees memory.
    FailAfter(ErrorKind),
}

/// A place in the source that makes driver calls: the line and column of the method name of
/// the call, as `#[track_caller]` reports it (the file is relative to its package's root).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallSite {
    pub kind: CallKind,
    pub file: &'static str,
    pub line: u32,
    pub column: u32,
}

impl CallSite {
    fn at(kind: CallKind, location: &Location<'static>) -> CallSite {
        CallSite {
            kind,
            file: location.file(),
            line: location.line(),
            column: location.column(),
        }
    }
}

impl std::fmt::Display for CallSite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} at {}:{}:{}",
            self.kind, self.file, self.line, self.column
        )
    }
}

#[derive(Debug, Default)]
struct Plan {
    calls: HashMap<CallKind, u64>,
    /// kind -> (call number that fails, what it does)
    failures: HashMap<CallKind, (u64, Injected)>,
    /// site -> (call number at that site that fails, what it does)
    site_failures: HashMap<CallSite, (u64, Injected)>,
    injected: u64,
    /// Calls per site.
    sites: HashMap<CallSite, u64>,
    /// The sites at which an injected failure fired.
    failed: HashSet<CallSite>,
    /// A failure of the `n`-th call after the next injected failure, armed when `injected` was
    /// the given count: (n, what it does, injected when armed).
    then: Option<(u64, Injected, u64)>,
    /// Calls since the latest injected failure.
    since_failure: u64,
    /// The kinds of the first calls after the latest injected failure, until `clear`.
    followers: Vec<CallKind>,
    following: bool,
}

/// How many calls after a failure [`FaultDevice::calls_after_failure`] keeps.
const FOLLOWERS: usize = 16;

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
    fn around<T>(
        &self,
        kind: CallKind,
        site: &'static Location<'static>,
        call: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let site = CallSite::at(kind, site);
        let mut plan = self.plan();
        let at_site = plan.sites.entry(site).or_insert(0);
        *at_site += 1;
        let at_site = *at_site;
        let count = plan.calls.entry(kind).or_insert(0);
        *count += 1;
        let count = *count;
        let mut fire = None;
        if plan.injected > 0 {
            plan.since_failure += 1;
            if plan.following && plan.followers.len() < FOLLOWERS {
                plan.followers.push(kind);
            }
            if let Some((at, what, armed)) = plan.then {
                if plan.injected > armed && at == plan.since_failure {
                    plan.then = None;
                    fire = Some(what);
                }
            }
        }
        if let Some(&(at, what)) = plan.failures.get(&kind) {
            if fire.is_none() && at == count {
                plan.failures.remove(&kind);
                fire = Some(what);
            }
        }
        if let Some(&(at, what)) = plan.site_failures.get(&site) {
            if fire.is_none() && at == at_site {
                plan.site_failures.remove(&site);
                fire = Some(what);
            }
        }
        if let Some(what) = fire {
            plan.injected += 1;
            plan.failed.insert(site);
            plan.since_failure = 0;
            plan.followers.clear();
            plan.following = true;
            let message = format!(
                "injected failure of {kind:?} call {count} at {}:{}:{}",
                site.file, site.line, site.column
            );
            drop(plan);
            match what {
                Injected::Fail(error) => return Err(Error::new(error, message)),
                Injected::Panic => panic!("{message}"),
                Injected::FailAfter(error) => {
                    let _ = call();
                    return Err(Error::new(error, format!("{message}, after making it")));
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

    /// Makes the `nth` call from now made at `site` (as [`FaultDevice::sites_called`] names
    /// it; 1 = the next one) fail with a driver error: a sweep that fails each call site once.
    pub fn fail_at(&self, site: CallSite, nth: u64) {
        let mut plan = self.hook().plan();
        let done = plan.sites.get(&site).copied().unwrap_or(0);
        plan.site_failures
            .insert(site, (done + nth.max(1), Injected::Fail(ErrorKind::Driver)));
    }

    /// Makes the `nth` call of `kind` from now go to the device and then fail with a driver
    /// error: for waits that must have waited (the host backend cannot stand for a lost
    /// device, whose queued work would never run).
    pub fn fail_nth_after_call(&self, kind: CallKind, nth: u64) {
        self.plan_nth(kind, nth, Injected::FailAfter(ErrorKind::Driver));
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

    /// Once the next planned failure has fired, makes the `nth` driver call after it (1 = the
    /// very next, whatever its kind) fail with a driver error too: the clean-up of a failure
    /// failing in turn.
    pub fn fail_after_failure(&self, nth: u64) {
        let mut plan = self.hook().plan();
        let armed = plan.injected;
        plan.then = Some((nth.max(1), Injected::Fail(ErrorKind::Driver), armed));
    }

    /// Forgets all planned failures, and ends the list of calls after the latest failure.
    pub fn clear(&self) {
        let mut plan = self.hook().plan();
        plan.failures.clear();
        plan.site_failures.clear();
        plan.then = None;
        plan.following = false;
    }

    /// The kinds of the first calls (up to 16) made after the latest injected failure and
    /// before [`FaultDevice::clear`], in order: what [`FaultDevice::fail_after_failure`] would
    /// fail.
    pub fn calls_after_failure(&self) -> Vec<CallKind> {
        self.hook().plan().followers.clone()
    }

    /// Calls of `kind` so far.
    pub fn calls(&self, kind: CallKind) -> u64 {
        self.hook().plan().calls.get(&kind).copied().unwrap_or(0)
    }

    /// Failures injected so far.
    pub fn injected(&self) -> u64 {
        self.hook().plan().injected
    }

    /// Every site that made calls so far, with its number of calls, in order of site.
    pub fn sites_called(&self) -> Vec<(CallSite, u64)> {
        let mut sites: Vec<(CallSite, u64)> = self
            .hook()
            .plan()
            .sites
            .iter()
            .map(|(&site, &n)| (site, n))
            .collect();
        sites.sort_unstable();
        sites
    }

    /// The sites at which an injected failure (or panic) fired so far, in order of site.
    pub fn sites_failed(&self) -> Vec<CallSite> {
        let mut sites: Vec<CallSite> = self.hook().plan().failed.iter().copied().collect();
        sites.sort_unstable();
        sites
    }
}
