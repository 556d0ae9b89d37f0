//! Replays a [`Trace`] through a real [`Pool`] and measures memory and allocator time.
//!
//! Every `malloc` and `free` is timed with the CPU's time-stamp counter where it runs at a
//! constant rate (`quanta`; a clock read costs about 10 ns there against 20-50 ns for
//! `Instant`, so less of each figure is the timer), else the monotonic clock; the device is
//! wrapped in a [`TimedDevice`] so that the time spent in driver calls within each call can be
//! subtracted.
//! A failed `malloc` is an OOM: the replay goes on without that allocation (and its free).

use std::sync::Arc;
use std::time::Instant;

use super::timed::{self, CallTime, TimedDevice};
use super::{NamedConfig, Op, Result, Trace, TraceError};
use glake::device::host::{HostDevice, HostOptions};
use glake::device::{DevicePtr, SharedDevice, Stream};
use glake::error::ErrorKind;
use glake::pool::snapshot::Snapshot;
use glake::pool::Pool;

/// Device memory of the host backend when no budget is given: far more than any trace needs.
/// The host backend never touches the pages, so this costs nothing.
pub const HOST_MEMORY: usize = 1 << 40;

/// Which backend the pool runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Host,
    Cuda,
}

impl Backend {
    pub fn parse(name: &str) -> Option<Backend> {
        match name {
            "host" => Some(Backend::Host),
            "cuda" => Some(Backend::Cuda),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Host => "host",
            Backend::Cuda => "cuda",
        }
    }
}

/// How to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayOptions {
    pub backend: Backend,
    /// Memory the pool may create, applied as its memory fraction.
    pub budget: Option<usize>,
    /// Keep per-operation memory figures for plotting.
    pub timeline: bool,
    /// Stop after this operation (an index into the trace's operations) with a snapshot of
    /// the pool there, in [`ReplayResult::snapshot`]; the other figures then cover the
    /// operations replayed so far.
    pub snapshot_after: Option<usize>,
    /// Check the pool's invariants (its blocks, statistics and stitched ranges agree) after
    /// every this many operations and at the end; the first failure ends the replay with an
    /// error naming the operation. A check returns parked blocks to the free lists, as
    /// statistics do, so later placements differ from an unchecked replay's.
    pub check_every: Option<usize>,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            backend: Backend::Host,
            budget: None,
            timeline: false,
            snapshot_after: None,
            check_every: None,
        }
    }
}

/// Median and 99th percentile (nearest rank) of a set of nanosecond figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Percentiles {
    pub median: u64,
    pub p99: u64,
}

impl Percentiles {
    pub fn of(mut values: Vec<u64>) -> Percentiles {
        if values.is_empty() {
            return Percentiles::default();
        }
        values.sort_unstable();
        let rank = |p: f64| {
            let index = ((p * values.len() as f64).ceil() as usize).max(1) - 1;
            values[index.min(values.len() - 1)]
        };
        Percentiles {
            median: rank(0.5),
            p99: rank(0.99),
        }
    }
}

/// Memory figures after each replayed operation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timeline {
    pub live: Vec<u64>,
    pub reserved: Vec<u64>,
    pub stitched: Vec<u64>,
    /// The native allocator's reserved bytes, from the trace's segment events.
    pub native: Option<Vec<u64>>,
}

/// One point of a downsampled timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Index of the last operation the point covers.
    pub index: usize,
    pub live: u64,
    pub reserved: u64,
    pub stitched: u64,
    pub native: Option<u64>,
}

impl Timeline {
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// At most `points` samples; each is the maximum over its run of operations, so that
    /// peaks survive the downsampling.
    pub fn downsample(&self, points: usize) -> Vec<Sample> {
        let n = self.len();
        if n == 0 || points == 0 {
            return Vec::new();
        }
        let bucket = n.div_ceil(points);
        let max = |series: &[u64], start: usize, end: usize| {
            series
                .get(start..end)
                .and_then(|s| s.iter().copied().max())
                .unwrap_or(0)
        };
        (0..n)
            .step_by(bucket)
            .map(|start| {
                let end = (start + bucket).min(n);
                Sample {
                    index: end - 1,
                    live: max(&self.live, start, end),
                    reserved: max(&self.reserved, start, end),
                    stitched: max(&self.stitched, start, end),
                    native: self.native.as_ref().map(|s| max(s, start, end)),
                }
            })
            .collect()
    }
}

/// The pool's counters where the trace names a point (a [`crate::Mark`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkSample {
    pub label: String,
    /// Operations replayed before it.
    pub at: usize,
    /// Stitches made and cached stitched ranges reused so far.
    pub stitches: u64,
    pub reuse_hits: u64,
    pub reserved: u64,
}

/// What one replay measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayResult {
    pub trace: String,
    pub config: String,
    pub backend: Backend,
    pub budget: Option<usize>,
    /// Peak of the requested bytes of live allocations (counted by the replay).
    pub peak_live_bytes: u64,
    /// Peak of the bytes handed out (requests rounded up by the pool).
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// Peak live over peak reserved.
    pub utilization: f64,
    pub stitches: u64,
    /// Of the stitches, those that grew an idle stitched range in place.
    pub growths: u64,
    pub stitched_allocations: u64,
    pub reuse_hits: u64,
    pub collections: u64,
    pub ooms: u64,
    /// Physical memory creations and releases.
    pub device_allocs: u64,
    pub device_frees: u64,
    /// `malloc` + `free` time of each allocation that was freed.
    pub alloc_free_ns: Percentiles,
    /// The same without the time spent in driver calls.
    pub alloc_free_excl_driver_ns: Percentiles,
    pub pairs: usize,
    /// Time inside driver calls made by `malloc` and `free`.
    pub driver_ns_total: u64,
    pub driver_calls: u64,
    pub driver_by_kind: Vec<CallTime>,
    pub native_peak_reserved_bytes: u64,
    /// Median cost of timing one call (two clock reads); every call's figure includes it.
    pub timer_ns: u64,
    /// Wall time of the replay loop.
    pub wall_ns: u64,
    pub timeline: Option<Timeline>,
    /// The counters at each of the trace's marks, and at its end (labelled "end of the trace"
    /// unless a mark stands there).
    pub marks: Vec<MarkSample>,
    /// The pool after [`ReplayOptions::snapshot_after`]'s operation, when it asked for one.
    pub snapshot: Option<Snapshot>,
}

/// Opens the device a replay runs on.
fn open_device(options: &ReplayOptions) -> Result<SharedDevice> {
    match options.backend {
        Backend::Host => {
            // The budget is enforced as the pool's memory cap, as on CUDA, not as the device's
            // size: the host backend places physical memory in one file, first fit, and a file
            // only as large as the budget fragments into failures that a GPU does not have.
            let total_memory = options
                .budget
                .map_or(HOST_MEMORY, |b| b.saturating_mul(2).max(HOST_MEMORY));
            let device = HostDevice::new(
                0,
                HostOptions {
                    total_memory,
                    ..HostOptions::default()
                },
            )
            .map_err(|e| TraceError::from(e).context("opening the host backend"))?;
            Ok(Arc::new(device))
        }
        Backend::Cuda => match glake::device::cuda::CudaDevice::open(0) {
            Ok(device) => Ok(Arc::new(device)),
            Err(err) => Err(TraceError::new(format!(
                "--backend cuda: no usable CUDA device 0 ({err})"
            ))),
        },
    }
}

fn driver_error(err: glake::Error, what: &str) -> TraceError {
    let hint = if err.kind() == ErrorKind::ResourceLimit {
        " (the host backend maps every segment and stitched piece separately; raise the \
         limit with `sysctl -w vm.max_map_count=1048576`, or use --backend cuda)"
    } else {
        ""
    };
    TraceError::new(format!("{what}: {err}{hint}"))
}

/// The median cost of timing an empty call, so that readers can tell the timer from the work.
fn timer_overhead(clock: &quanta::Clock) -> u64 {
    let samples = (0..1001)
        .map(|_| {
            let start = clock.raw();
            std::hint::black_box(());
            clock.delta_as_nanos(start, clock.raw())
        })
        .collect();
    Percentiles::of(samples).median
}

/// A live allocation of the replay.
#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// 0: not live (never allocated, failed, or freed); pools never hand out 0.
    ptr: DevicePtr,
    size: u64,
    malloc_ns: u64,
    malloc_driver_ns: u64,
}

/// Replays `trace` through a new pool with `config`.
pub fn replay(
    trace: &Trace,
    config: &NamedConfig,
    options: &ReplayOptions,
) -> Result<ReplayResult> {
    let measured = with_pool(trace, config, options, |pool, timed, streams| {
        run(trace, pool, timed, streams, options)
    })?;
    Ok(ReplayResult {
        trace: trace.name.clone(),
        config: config.name.clone(),
        backend: options.backend,
        budget: options.budget,
        native_peak_reserved_bytes: trace.native_peak_reserved_bytes,
        ..measured
    })
}

/// Runs `work` on a new pool with `config` on the device `options` name, with one stream per
/// stream of `trace` (index as in its operations), and tears the streams down afterwards.
fn with_pool<T>(
    trace: &Trace,
    config: &NamedConfig,
    options: &ReplayOptions,
    work: impl FnOnce(&Pool, &TimedDevice, &[Stream]) -> Result<T>,
) -> Result<T> {
    let inner = open_device(options)?;
    let timed = Arc::new(timed::timed(inner));
    let device: SharedDevice = timed.clone();
    let mut pool_config = config.config.clone();
    if let Some(budget) = options.budget {
        let total = device.mem_info()?.total;
        if budget > total {
            return Err(TraceError::new(format!(
                "budget {budget} is more than the device's {total} bytes"
            )));
        }
        pool_config.memory_limit = Some(budget);
    }
    let pool = Pool::new(device.clone(), pool_config)
        .map_err(|e| TraceError::from(e).context(format!("config {}", config.name)))?;
    let mut streams = Vec::with_capacity(trace.streams.len());
    let mut created = Vec::new();
    for &value in &trace.streams {
        if value == 0 {
            streams.push(Stream::DEFAULT);
        } else {
            let stream = device.create_stream()?;
            created.push(stream);
            streams.push(stream);
        }
    }
    let result = work(&pool, &timed, &streams);
    drop(pool);
    for stream in created {
        if let Err(err) = device.destroy_stream(stream) {
            log::warn!("destroying a replay stream failed: {err}");
        }
    }
    result
}

fn run(
    trace: &Trace,
    pool: &Pool,
    timed: &TimedDevice,
    streams: &[Stream],
    options: &ReplayOptions,
) -> Result<ReplayResult> {
    let keep_timeline = options.timeline;
    let mut snapshot = None;
    let mut slots = vec![Slot::default(); trace.allocs];
    let mut pairs = Vec::with_capacity(trace.frees);
    let mut pairs_excl = Vec::with_capacity(trace.frees);
    let mut timeline = keep_timeline.then(|| Timeline {
        native: trace.has_segments.then(Vec::new),
        ..Timeline::default()
    });
    let mut native_step = 0;
    let mut native_now = 0;
    let (mut live, mut peak_live, mut ooms, mut driver_total) = (0u64, 0u64, 0u64, 0u64);
    let calls_before = timed.hook().calls();
    let kinds_before = timed.hook().by_kind();
    let clock = quanta::Clock::new();
    let mut marks = Vec::with_capacity(trace.marks.len() + 1);
    let mut sample = |label: &str, at: usize| {
        let now = pool.footprint();
        marks.push(MarkSample {
            label: label.to_string(),
            at,
            stitches: now.stitches,
            reuse_hits: now.stitch_reuse_hits,
            reserved: now.reserved as u64,
        });
    };
    let mut next_mark = trace.marks.iter().peekable();
    let wall = Instant::now();
    for (index, op) in trace.ops.iter().enumerate() {
        while let Some(mark) = next_mark.next_if(|m| m.at <= index) {
            sample(&mark.label, index);
        }
        match *op {
            Op::Alloc { id, size, stream } => {
                let stream = streams.get(stream as usize).copied().unwrap_or_default();
                let driver_before = timed.hook().nanos();
                let start = clock.raw();
                let result = pool.malloc(size as usize, stream);
                let nanos = clock.delta_as_nanos(start, clock.raw());
                let driver = timed.hook().nanos() - driver_before;
                driver_total += driver;
                match result {
                    Ok(ptr) => {
                        if let Some(slot) = slots.get_mut(id as usize) {
                            *slot = Slot {
                                ptr,
                                size,
                                malloc_ns: nanos,
                                malloc_driver_ns: driver,
                            };
                        }
                        live += size;
                        peak_live = peak_live.max(live);
                    }
                    Err(err) if err.kind() == ErrorKind::OutOfMemory => ooms += 1,
                    Err(err) => {
                        return Err(driver_error(err, &format!("malloc({size}), op {index}")))
                    }
                }
            }
            Op::Free { id } => {
                let Some(slot) = slots.get_mut(id as usize) else {
                    continue;
                };
                if slot.ptr == 0 {
                    continue;
                }
                let driver_before = timed.hook().nanos();
                let start = clock.raw();
                let result = pool.free(slot.ptr);
                let nanos = clock.delta_as_nanos(start, clock.raw());
                let driver = timed.hook().nanos() - driver_before;
                driver_total += driver;
                result.map_err(|e| driver_error(e, &format!("free, op {index}")))?;
                pairs.push(slot.malloc_ns + nanos);
                pairs_excl
                    .push((slot.malloc_ns + nanos).saturating_sub(slot.malloc_driver_ns + driver));
                live -= slot.size;
                slot.ptr = 0;
            }
        }
        if let Some(t) = timeline.as_mut() {
            // Not `pool.stats()`: it returns parked blocks to the free lists, and a sampled
            // replay would then place later requests differently from an unsampled one.
            let footprint = pool.footprint();
            t.live.push(live);
            t.reserved.push(footprint.reserved as u64);
            t.stitched.push(footprint.stitched_mapped as u64);
            if let Some(native) = t.native.as_mut() {
                while let Some(&(at, bytes)) = trace.native_steps.get(native_step) {
                    if at > index + 1 {
                        break;
                    }
                    native_now = bytes;
                    native_step += 1;
                }
                native.push(native_now);
            }
        }
        if options.snapshot_after == Some(index) {
            snapshot = Some(pool.snapshot());
            break;
        }
        let last = index + 1 == trace.ops.len();
        if let Some(every) = options.check_every.filter(|&n| n > 0) {
            if (index + 1) % every == 0 || last {
                pool.check_invariants().map_err(|err| {
                    TraceError::new(format!(
                        "after operation {index}: the pool is inconsistent: {err}"
                    ))
                })?;
            }
        }
    }
    let wall_ns = wall.elapsed().as_nanos() as u64;
    if snapshot.is_none() {
        for mark in next_mark {
            sample(&mark.label, trace.ops.len());
        }
        if trace.marks.last().is_none_or(|m| m.at < trace.ops.len()) {
            sample("end of the trace", trace.ops.len());
        }
    }
    let stats = pool.stats();
    let driver_calls = timed.hook().calls() - calls_before;
    let driver_by_kind = timed
        .hook()
        .by_kind()
        .into_iter()
        .map(|mut c| {
            if let Some(before) = kinds_before.iter().find(|b| b.kind == c.kind) {
                c.calls -= before.calls;
                c.nanos -= before.nanos;
            }
            c
        })
        .filter(|c| c.calls > 0)
        .collect();
    // Leave the pool empty, so that dropping it releases everything quietly.
    for slot in slots.iter().filter(|s| s.ptr != 0) {
        pool.free(slot.ptr)
            .map_err(|e| driver_error(e, "freeing what the trace left live"))?;
    }
    let peak_reserved = stats.reserved_bytes.all.peak.max(0) as u64;
    let count = |v: i64| v.max(0) as u64;
    Ok(ReplayResult {
        trace: String::new(),
        config: String::new(),
        backend: Backend::Host,
        budget: None,
        peak_live_bytes: peak_live,
        peak_allocated_bytes: count(stats.allocated_bytes.all.peak),
        peak_reserved_bytes: peak_reserved,
        utilization: if peak_reserved == 0 {
            0.0
        } else {
            peak_live as f64 / peak_reserved as f64
        },
        stitches: count(stats.stitches),
        growths: pool.footprint().stitch_growths,
        stitched_allocations: count(stats.stitched_allocations),
        reuse_hits: count(stats.stitch_reuse_hits),
        collections: count(stats.stitch_collections),
        ooms,
        device_allocs: count(stats.num_device_alloc),
        device_frees: count(stats.num_device_free),
        pairs: pairs.len(),
        alloc_free_ns: Percentiles::of(pairs),
        alloc_free_excl_driver_ns: Percentiles::of(pairs_excl),
        driver_ns_total: driver_total,
        driver_calls,
        driver_by_kind,
        native_peak_reserved_bytes: 0,
        timer_ns: timer_overhead(&clock),
        wall_ns,
        timeline,
        marks,
        snapshot,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{configs, read_trace};

    const MIB: u64 = 1 << 20;

    /// Four 4 MiB holes inside one partly used 32 MiB segment, then a 16 MiB request.
    fn fragmenting() -> Trace {
        let mut text = String::from("alloc 1 33554432 0\nfree_completed 1 33554432 0\n");
        for i in 0..8 {
            text += &format!("alloc {} {} 0\n", 100 + i, 4 * MIB);
        }
        for i in (1..8).step_by(2) {
            text += &format!("free_completed {} {} 0\n", 100 + i, 4 * MIB);
        }
        text += &format!(
            "alloc 200 {} 0\nfree_completed 200 {} 0\n",
            16 * MIB,
            16 * MIB
        );
        read_trace(text.as_bytes(), "frag", 0).unwrap()
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        assert_eq!(Percentiles::of(vec![]), Percentiles::default());
        let p = Percentiles::of((1..=100).rev().collect());
        assert_eq!((p.median, p.p99), (50, 99));
        let p = Percentiles::of(vec![7]);
        assert_eq!((p.median, p.p99), (7, 7));
    }

    #[test]
    fn downsample_keeps_peaks() {
        let t = Timeline {
            live: vec![1, 9, 2, 3, 4],
            reserved: vec![5, 5, 5, 8, 5],
            stitched: vec![0; 5],
            native: None,
        };
        let s = t.downsample(2);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].index, s[0].live, s[0].reserved), (2, 9, 5));
        assert_eq!((s[1].index, s[1].live, s[1].reserved), (4, 4, 8));
        assert_eq!(t.downsample(10).len(), 5);
    }

    #[test]
    fn stitching_removes_the_growth_caching_needs() {
        let trace = fragmenting();
        let options = ReplayOptions {
            timeline: true,
            ..ReplayOptions::default()
        };
        let caching = replay(&trace, &configs::named("caching").unwrap(), &options).unwrap();
        let stitch = replay(&trace, &configs::named("stitch").unwrap(), &options).unwrap();
        assert_eq!(caching.peak_live_bytes, 32 * MIB);
        assert_eq!(stitch.peak_live_bytes, 32 * MIB);
        assert_eq!(caching.peak_reserved_bytes, 48 * MIB);
        assert_eq!(stitch.peak_reserved_bytes, 32 * MIB);
        assert_eq!((caching.stitches, stitch.stitches), (0, 1));
        assert_eq!(stitch.utilization, 1.0);
        assert_eq!(stitch.pairs, 6);
        assert_eq!(stitch.timeline.as_ref().unwrap().len(), trace.ops.len());
        assert!(stitch.driver_ns_total > 0);

        let tight = ReplayOptions {
            budget: Some(32 * MIB as usize),
            ..ReplayOptions::default()
        };
        let caching = replay(&trace, &configs::named("caching").unwrap(), &tight).unwrap();
        let stitch = replay(&trace, &configs::named("stitch").unwrap(), &tight).unwrap();
        assert_eq!(caching.ooms, 1);
        assert_eq!(stitch.ooms, 0);
        assert_eq!(caching.peak_live_bytes, 32 * MIB);
    }

    #[test]
    fn a_checked_replay_checks_the_pool_and_finds_it_consistent() {
        let trace = fragmenting();
        let options = ReplayOptions {
            check_every: Some(1),
            ..ReplayOptions::default()
        };
        let stitch = replay(&trace, &configs::named("stitch").unwrap(), &options).unwrap();
        assert_eq!(stitch.stitches, 1);
        assert_eq!(stitch.peak_reserved_bytes, 32 * MIB);
    }
}
