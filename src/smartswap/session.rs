//! A SmartSwap session for native code: the op hooks drive warm-up, one profiled iteration, the
//! planner, and then an executor that swaps the planned allocations out after the op the plan
//! names and back ahead of the op that needs them, at the same addresses.
//!
//! How a planned tensor is found again: iterations of a training loop allocate in the same
//! order, so the profile's tensor that was the iteration's n-th allocation is the n-th
//! allocation of every later iteration. The pool is asked to make exactly those allocations
//! swappable (a segment of their own, see [`Pool::malloc_swappable`]), so swapping one out
//! gives its physical memory back to the device and swapping it in maps new memory at the same
//! virtual address. An iteration that departs from the profile (more ops, or an allocation of
//! another size where a planned one was expected) stops being executed: everything out comes
//! back, and the session starts over with warm-up, with a log line saying why.
//!
//! Swaps are stream-ordered ([`Pool::swap_out_async`], [`Pool::swap_in_async`]) on two copy
//! streams of the session's: a copy out waits for the work queued on the allocation's streams
//! (and on the op's, which the session records), its physical memory goes back once the
//! session sees it done (at the next hook), and the consumer's streams wait for a copy in. A
//! tensor the running op touches while out is brought back before the op's work is queued.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::Profiler;
use crate::device::{DevicePtr, Stream};
use crate::error::{Error, Result};
use crate::pool::{AllocationEvent, Pool};
use crate::swap::{plan, Choice, Phase, Preference, SimConfig, SimResult, SwapError, TensorKind};
use crate::sync::lock;

/// What a session aims for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Peak bytes of an iteration (the pool's allocations) the plan must stay within.
    pub target_bytes: usize,
    /// Iterations run as written before the profiled one (first iterations pay one-time costs).
    pub warmup_iterations: usize,
    /// Ops ahead of its next use that a swap-in is issued.
    pub prefetch: usize,
    pub preference: Preference,
    /// Copy bandwidths the planner assumes.
    pub d2h_bytes_per_s: u64,
    pub h2d_bytes_per_s: u64,
}

impl Settings {
    /// The defaults for a device of `total_bytes`, overridden by the environment that
    /// glake's PyTorch side reads too: `GLAKE_SWAP_TARGET` (a fraction of the device when at
    /// most 1, else bytes; K/M/G suffixes allowed), `GLAKE_SWAP_PREFETCH` (ops ahead),
    /// `GLAKE_SWAP_PREFERENCE` (`performance` or `memory`), `GLAKE_SWAP_WARMUP` (iterations)
    /// and `GLAKE_SWAP_BANDWIDTH` (bytes per second each way). With no target the whole
    /// device is the target: nothing is moved.
    pub fn from_env(total_bytes: usize) -> Settings {
        let mut s = Settings {
            target_bytes: total_bytes,
            warmup_iterations: 1,
            prefetch: 1,
            preference: Preference::Performance,
            d2h_bytes_per_s: 50_000_000_000,
            h2d_bytes_per_s: 50_000_000_000,
        };
        if let Ok(raw) = std::env::var("GLAKE_SWAP_TARGET") {
            match raw.trim().parse::<f64>() {
                Ok(f) if f > 0.0 && f <= 1.0 => s.target_bytes = (f * total_bytes as f64) as usize,
                _ => match crate::config::env_bytes("GLAKE_SWAP_TARGET") {
                    Some(bytes) if bytes > 0 => s.target_bytes = bytes,
                    _ => log::warn!("glake smartswap: GLAKE_SWAP_TARGET={raw} ignored"),
                },
            }
        }
        let number = |name: &str| {
            let raw = std::env::var(name).ok()?;
            let parsed = raw.trim().parse::<u64>().ok();
            if parsed.is_none() {
                log::warn!("glake smartswap: {name}={raw} ignored");
            }
            parsed
        };
        if let Some(n) = number("GLAKE_SWAP_PREFETCH") {
            s.prefetch = n as usize;
        }
        if let Some(n) = number("GLAKE_SWAP_WARMUP") {
            s.warmup_iterations = n as usize;
        }
        if let Some(n) = number("GLAKE_SWAP_BANDWIDTH").filter(|&n| n > 0) {
            s.d2h_bytes_per_s = n;
            s.h2d_bytes_per_s = n;
        }
        match std::env::var("GLAKE_SWAP_PREFERENCE").as_deref() {
            Ok("memory") => s.preference = Preference::MemorySaving,
            Ok("performance") | Err(_) => {}
            Ok(other) => log::warn!("glake smartswap: GLAKE_SWAP_PREFERENCE={other} ignored"),
        }
        s
    }
}

/// Where a session stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionPhase {
    Warmup,
    Profile,
    Stable,
}

/// What the session has done so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Iterations begun.
    pub iterations: u64,
    /// The plan's prediction, once planned.
    pub prediction: Option<SimResult>,
    /// Tensors the plan swaps, and their bytes.
    pub planned_swaps: usize,
    pub planned_swap_bytes: usize,
    /// Swaps done (each out and each in counted once).
    pub swapped_out: u64,
    pub swapped_in: u64,
    /// Times the session went back to warm-up because an iteration left the profile.
    pub restarts: u64,
    /// Swap-ins the plan did not schedule: an op touched a tensor while it was out.
    pub off_plan: u64,
}

/// The plan in the executor's terms: allocation ordinals by op index.
#[derive(Debug, Default)]
struct Schedule {
    n_ops: usize,
    out_after: BTreeMap<usize, Vec<usize>>,
    issue_in: BTreeMap<usize, Vec<usize>>,
    need_in: BTreeMap<usize, Vec<usize>>,
}

/// What the pool's observer and placement share with the session (they run under the pool's
/// lock: the session never holds this lock while it calls into the pool).
#[derive(Default)]
struct Tracking {
    /// The profiler is told of allocations while an iteration is profiled.
    profiler: Option<Arc<Mutex<Profiler>>>,
    /// Bytes of each planned allocation by ordinal (absent: not planned), as profiled; made
    /// swappable it is rounded up to the mapping granularity.
    planned: HashMap<usize, usize>,
    granularity: usize,
    executing: bool,
    /// Allocations made so far in this iteration.
    next_ordinal: usize,
    /// This iteration's address of each planned allocation made so far.
    ptrs: HashMap<usize, DevicePtr>,
    /// Planned ordinals whose allocation came with a size other than planned.
    mismatched: bool,
}

/// One native training loop's SmartSwap.
pub struct Session {
    pool: Arc<Pool>,
    settings: Settings,
    /// Copy streams: out (device to host) and in.
    d2h: Stream,
    h2d: Stream,
    /// The stream of the op running.
    stream: Stream,
    tracking: Arc<Mutex<Tracking>>,
    profiler: Arc<Mutex<Profiler>>,
    phase: SessionPhase,
    warm: usize,
    schedule: Schedule,
    /// Index of the next op of this iteration, and whether an iteration is open.
    op: usize,
    open: bool,
    /// The last stage marker (it may come before the iteration's first op).
    stage: Option<Phase>,
    /// Planned allocations swapped out now (ordinal -> address).
    out: HashMap<usize, DevicePtr>,
    /// Allocated bytes when the iteration began: the planner counts them in every peak.
    base_bytes: usize,
    report: Report,
}

impl Session {
    /// A session on `pool`, which it observes (replacing any observer) and asks to place
    /// planned allocations until dropped.
    pub fn new(pool: Arc<Pool>, settings: Settings) -> Result<Session> {
        if settings.d2h_bytes_per_s == 0 || settings.h2d_bytes_per_s == 0 {
            return Err(Error::invalid_argument("copy bandwidths must be positive"));
        }
        let d2h = pool.device().create_stream()?;
        let h2d = match pool.device().create_stream() {
            Ok(stream) => stream,
            Err(err) => {
                let _ = pool.device().destroy_stream(d2h);
                return Err(err);
            }
        };
        let profiler = Arc::new(Mutex::new(Profiler::new(pool.device().clone())));
        let tracking = Arc::new(Mutex::new(Tracking {
            granularity: pool.device().granularity(),
            ..Tracking::default()
        }));
        let observed = Arc::downgrade(&tracking);
        pool.set_observer(Some(Arc::new(move |event| {
            let Some(tracking) = observed.upgrade() else {
                return;
            };
            let mut t = lock(&tracking);
            if let Some(profiler) = &t.profiler {
                let mut profiler = lock(profiler);
                match event {
                    AllocationEvent::Allocated { ptr, bytes } => profiler.allocated(ptr, bytes),
                    AllocationEvent::Freed { ptr } => profiler.freed(ptr),
                }
            }
            if let AllocationEvent::Allocated { ptr, bytes } = event {
                let ordinal = t.next_ordinal;
                t.next_ordinal += 1;
                if t.executing {
                    if let Some(&planned) = t.planned.get(&ordinal) {
                        if bytes >= planned && bytes - planned < t.granularity.max(1) {
                            t.ptrs.insert(ordinal, ptr);
                        } else {
                            t.mismatched = true;
                        }
                    }
                }
            }
        })));
        let placed = Arc::downgrade(&tracking);
        pool.set_swap_placement(Some(Arc::new(move |_size| {
            placed.upgrade().is_some_and(|tracking| {
                let t = lock(&tracking);
                t.executing && t.planned.contains_key(&t.next_ordinal)
            })
        })));
        Ok(Session {
            pool,
            settings,
            d2h,
            h2d,
            stream: Stream::DEFAULT,
            tracking,
            profiler,
            phase: SessionPhase::Warmup,
            warm: 0,
            schedule: Schedule::default(),
            op: 0,
            open: false,
            stage: None,
            out: HashMap::new(),
            base_bytes: 0,
            report: Report::default(),
        })
    }

    pub fn phase(&self) -> SessionPhase {
        self.phase
    }

    pub fn report(&self) -> Report {
        self.report.clone()
    }

    /// Whether the planned allocation made at `ordinal` in this iteration is swapped out now.
    pub fn is_out(&self, ordinal: usize) -> bool {
        self.out.contains_key(&ordinal)
    }

    /// An iteration begins.
    pub fn begin_iteration(&mut self) -> Result<()> {
        if self.open {
            self.end_iteration()?;
        }
        self.open = true;
        self.op = 0;
        self.report.iterations += 1;
        self.base_bytes =
            usize::try_from(self.pool.stats().allocated_bytes.all.current).unwrap_or(0);
        let mut t = lock(&self.tracking);
        t.next_ordinal = 0;
        t.ptrs.clear();
        t.mismatched = false;
        t.executing = self.phase == SessionPhase::Stable;
        t.profiler = None;
        if self.phase == SessionPhase::Profile {
            let mut profiler = lock(&self.profiler);
            profiler.begin_iteration();
            if let Some(stage) = self.stage {
                profiler.set_phase(stage);
            }
            t.profiler = Some(self.profiler.clone());
        }
        Ok(())
    }

    /// A stage marker for the profile: the phase of the ops that begin from now on.
    pub fn set_phase(&mut self, phase: Phase) {
        self.stage = Some(phase);
        if self.phase == SessionPhase::Profile && self.open {
            lock(&self.profiler).set_phase(phase);
        }
    }

    /// An op begins on `stream`: under the plan, what it (or a later op within the prefetch
    /// distance) needs comes back first.
    pub fn begin_op(&mut self, name: &str, stream: Stream) -> Result<()> {
        if !self.open {
            self.begin_iteration()?;
        }
        let op = self.op;
        self.op += 1;
        self.stream = stream;
        if !self.out.is_empty() {
            // Copies out seen done give their memory back.
            self.pool.finish_swap_outs(false)?;
        }
        match self.phase {
            SessionPhase::Warmup => Ok(()),
            SessionPhase::Profile => lock(&self.profiler).begin_op(name, stream).map(|_| ()),
            SessionPhase::Stable => {
                if op >= self.schedule.n_ops || lock(&self.tracking).mismatched {
                    return self.depart(format!(
                        "op {op} ({name}) left the profiled iteration of {} ops",
                        self.schedule.n_ops
                    ));
                }
                let mut wanted: Vec<usize> = Vec::new();
                for map in [&self.schedule.issue_in, &self.schedule.need_in] {
                    if let Some(list) = map.get(&op) {
                        wanted.extend(list);
                    }
                }
                for ordinal in wanted {
                    self.bring_back(ordinal)?;
                }
                Ok(())
            }
        }
    }

    /// The running op touches `bytes` at `ptr`: a planned allocation still out comes back.
    pub fn tensor(&mut self, ptr: DevicePtr, bytes: usize) -> Result<()> {
        match self.phase {
            SessionPhase::Profile if self.open => lock(&self.profiler).tensor(ptr, bytes),
            SessionPhase::Stable if !self.out.is_empty() => {
                let Some(base) = self.pool.allocation_of(ptr).map(|a| a.base) else {
                    return Ok(());
                };
                let found = self
                    .out
                    .iter()
                    .find(|(_, &p)| p == base)
                    .map(|(&ordinal, _)| ordinal);
                match found {
                    Some(ordinal) => {
                        self.report.off_plan += 1;
                        self.bring_back(ordinal)
                    }
                    None => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    /// The running op has queued its work: what the plan moves out after it goes.
    pub fn end_op(&mut self) -> Result<()> {
        let op = self.op.saturating_sub(1);
        match self.phase {
            SessionPhase::Profile if self.open => lock(&self.profiler).end_op(),
            SessionPhase::Stable => {
                let moves = self
                    .schedule
                    .out_after
                    .get(&op)
                    .cloned()
                    .unwrap_or_default();
                for ordinal in moves {
                    let ptr = lock(&self.tracking).ptrs.get(&ordinal).copied();
                    let Some(ptr) = ptr else { continue };
                    if self.out.contains_key(&ordinal) || self.pool.is_swapped(ptr) != Some(false) {
                        continue; // out already, freed, or not made swappable
                    }
                    self.order_with_op(ptr)?;
                    self.pool.swap_out_async(ptr, self.d2h)?;
                    self.out.insert(ordinal, ptr);
                    self.report.swapped_out += 1;
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The iteration has ended: warm-up counts it, the profiled one is planned, and under the
    /// plan anything still out comes back.
    pub fn end_iteration(&mut self) -> Result<()> {
        if !self.open {
            return Ok(());
        }
        self.open = false;
        match self.phase {
            SessionPhase::Warmup => {
                self.warm += 1;
                if self.warm >= self.settings.warmup_iterations {
                    self.phase = SessionPhase::Profile;
                }
                Ok(())
            }
            SessionPhase::Profile => {
                lock(&self.tracking).profiler = None;
                self.plan_from_profile()
            }
            SessionPhase::Stable => {
                let ops = self.op;
                self.bring_all_back()?;
                if ops != self.schedule.n_ops {
                    return self.depart(format!(
                        "the iteration ran {ops} ops where the profile had {}",
                        self.schedule.n_ops
                    ));
                }
                Ok(())
            }
        }
    }

    fn plan_from_profile(&mut self) -> Result<()> {
        let (mut profile, ordinals) = {
            let mut profiler = lock(&self.profiler);
            let profile = profiler.end_iteration()?;
            (profile, profiler.allocation_ordinals().to_vec())
        };
        profile.base_bytes = profile.base_bytes.max(self.base_bytes);
        // A planned allocation gets a segment of its own: below the mapping granularity that
        // costs more than it saves, so smaller tensors are never moved.
        let granularity = self.pool.device().granularity();
        for t in &mut profile.tensors {
            if t.bytes < granularity {
                t.kind = TensorKind::Other;
            }
        }
        let cfg = SimConfig {
            d2h_bytes_per_s: self.settings.d2h_bytes_per_s,
            h2d_bytes_per_s: self.settings.h2d_bytes_per_s,
            prefetch: self.settings.prefetch.max(1),
        };
        let planned = match plan(
            &profile,
            self.settings.target_bytes,
            &cfg,
            self.settings.preference,
        ) {
            Ok(planned) => planned,
            Err(err @ SwapError::TargetUnreachable { .. }) => {
                self.phase = SessionPhase::Warmup;
                self.warm = 0;
                return Err(Error::out_of_memory(format!("glake smartswap: {err}")));
            }
            Err(err) => return Err(Error::invalid_argument(err.to_string())),
        };
        let mut schedule = Schedule {
            n_ops: profile.ops.len(),
            ..Schedule::default()
        };
        let mut planned_bytes = HashMap::new();
        for (i, choice) in planned.choices.iter().enumerate() {
            let Choice::Swap {
                out_after,
                in_before,
            } = *choice
            else {
                continue;
            };
            let ordinal = ordinals[i];
            let bytes = profile.tensors[i].bytes;
            planned_bytes.insert(ordinal, bytes);
            schedule
                .out_after
                .entry(out_after)
                .or_default()
                .push(ordinal);
            let issue = in_before
                .saturating_sub(cfg.prefetch)
                .max(out_after + 1)
                .min(in_before);
            schedule.issue_in.entry(issue).or_default().push(ordinal);
            schedule.need_in.entry(in_before).or_default().push(ordinal);
        }
        self.report.planned_swaps = planned_bytes.len();
        self.report.planned_swap_bytes = planned_bytes.values().sum();
        self.report.prediction = Some(planned.result);
        log::info!(
            "glake smartswap: {} tensors ({} bytes) swapped per iteration, predicted peak {} bytes",
            self.report.planned_swaps,
            self.report.planned_swap_bytes,
            self.report.prediction.as_ref().map_or(0, |p| p.peak_bytes)
        );
        lock(&self.tracking).planned = planned_bytes;
        self.schedule = schedule;
        self.phase = SessionPhase::Stable;
        // The unplanned iterations left their memory cached: give it back once, and set the
        // pool's soft limit at the target, so memory the plan frees is memory the pool reuses
        // (it gives cached memory back before it grows past the target, and never fails a
        // request for it: an iteration off the plan still runs).
        self.pool.empty_cache()?;
        self.pool.set_soft_limit(Some(self.settings.target_bytes));
        Ok(())
    }

    fn bring_back(&mut self, ordinal: usize) -> Result<()> {
        let Some(ptr) = self.out.remove(&ordinal) else {
            return Ok(());
        };
        let back = self
            .order_with_op(ptr)
            .and_then(|()| self.pool.swap_in_async(ptr, self.h2d));
        if let Err(err) = back {
            self.out.insert(ordinal, ptr);
            return Err(err);
        }
        self.report.swapped_in += 1;
        Ok(())
    }

    /// The running op's stream, when it is not the allocation's own, is recorded as a user of
    /// it: copies out then wait for the op's work, and the op's stream waits for copies in.
    fn order_with_op(&self, ptr: DevicePtr) -> Result<()> {
        match self.pool.allocation_of(ptr) {
            Some(info) if info.stream != self.stream => self.pool.record_stream(ptr, self.stream),
            _ => Ok(()),
        }
    }

    fn bring_all_back(&mut self) -> Result<()> {
        let ordinals: Vec<usize> = self.out.keys().copied().collect();
        for ordinal in ordinals {
            self.bring_back(ordinal)?;
        }
        Ok(())
    }

    /// The iteration left the profile: nothing stays out, and the session starts over.
    fn depart(&mut self, why: String) -> Result<()> {
        log::warn!("glake smartswap: {why}: back to warm-up");
        self.bring_all_back()?;
        let mut t = lock(&self.tracking);
        t.executing = false;
        t.planned.clear();
        drop(t);
        self.pool.set_soft_limit(None);
        self.phase = SessionPhase::Warmup;
        self.warm = 0;
        self.report.restarts += 1;
        Ok(())
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Err(err) = self.bring_all_back() {
            log::warn!("glake smartswap: bringing swapped memory back failed: {err}");
        }
        // The copies in must be done before their streams go.
        for stream in [self.d2h, self.h2d] {
            let device = self.pool.device();
            if let Err(err) = device
                .synchronize_stream(stream)
                .and_then(|()| device.destroy_stream(stream))
            {
                log::warn!("glake smartswap: ending a copy stream failed: {err}");
            }
        }
        self.pool.set_soft_limit(None);
        self.pool.set_swap_placement(None);
        self.pool.set_observer(None);
    }
}
