//! Random sequences of C-API calls on the host backend, with hostile arguments mixed in: bad
//! handles, pointers inside or past allocations, double frees, freed pointers, sizes of zero
//! and of 2^60, NaN fractions, hooks in any order, swaps of anything. No call may panic across
//! the boundary (`GLAKE_STATUS_PANIC`) or find an internal error, every resident allocation
//! keeps its bytes, every pool passes `glake_pool_check` as it goes, and once everything is
//! freed each pool gives all of its memory back.
//!
//! Bounded by default (CI); `GLAKE_FUZZ_OPS=10000000 cargo test --release --test fuzz_c_api
//! -- --nocapture` is the long mode, `GLAKE_FUZZ_SEED` picks the sequence.

mod common;

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::null_mut;

use glake::ffi::*;
use glake_status::*;

const MIB: usize = 1 << 20;

/// xorshift64*: the sequence from a seed, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Resident,
    Leaving,
    Out,
    /// In a sleeping region: not read until the region wakes.
    Asleep,
}

/// The region names the fuzzer uses.
const REGIONS: [&std::ffi::CStr; 2] = [c"r0", c"r1"];

struct Alloc {
    len: usize,
    seed: u8,
    swappable: bool,
    state: State,
    /// The region it was made in.
    region: Option<usize>,
}

struct Pool {
    handle: *mut glake_pool,
    live: HashMap<usize, Alloc>,
    freed: Vec<usize>,
    streams: Vec<glake_stream>,
    session: *mut glake_smartswap,
    /// Regions open on this thread, innermost last.
    open: Vec<usize>,
    /// Per region: asleep, and whether its sleep kept the bytes.
    asleep: [Option<bool>; 2],
}

struct Fuzz {
    rng: Rng,
    pools: Vec<Pool>,
    calls: u64,
    statuses: HashMap<u32, u64>,
    /// Sleeps and wakes that succeeded.
    cycles: (u64, u64),
}

impl Fuzz {
    /// Records a call's status; a panic or an internal error fails the run at once.
    fn status(&mut self, what: &str, status: glake_status) -> glake_status {
        self.calls += 1;
        *self.statuses.entry(status as u32).or_default() += 1;
        assert!(
            status != GLAKE_STATUS_PANIC && status != GLAKE_STATUS_INTERNAL,
            "{what}: {:?}: {}",
            status,
            unsafe { std::ffi::CStr::from_ptr(glake_last_error_message()) }.to_string_lossy()
        );
        status
    }

    fn create_pool(&mut self) {
        let mut config = common::c_host_config();
        config.stitch = self.rng.below(2) as u32;
        if self.rng.chance(25) {
            // Guard-page mode (GLAKE_GUARD=1, set for this process) through the environment.
            config.flags |= GLAKE_CONFIG_READ_ENV;
        }
        let mut handle = null_mut();
        let status = unsafe { glake_pool_create(&config, &mut handle) };
        if self.status("pool_create", status) == GLAKE_STATUS_SUCCESS {
            self.pools.push(Pool {
                handle,
                live: HashMap::new(),
                freed: Vec::new(),
                streams: Vec::new(),
                session: null_mut(),
                open: Vec::new(),
                asleep: [None; 2],
            });
        }
    }

    fn fill(&mut self, p: usize, ptr: usize) {
        let (len, seed) = {
            let a = &self.pools[p].live[&ptr];
            (a.len.min(64 * 1024), a.seed)
        };
        let data = vec![seed; len];
        let pool = self.pools[p].handle;
        let s = unsafe {
            glake_copy_to_device(
                pool,
                ptr as *mut c_void,
                data.as_ptr().cast(),
                len,
                null_mut(),
            )
        };
        self.status("copy_to_device", s);
        let s = glake_stream_synchronize(pool, null_mut());
        self.status("synchronize", s);
    }

    fn verify(&mut self, p: usize, ptr: usize) {
        let (len, seed) = {
            let a = &self.pools[p].live[&ptr];
            (a.len.min(64 * 1024), a.seed)
        };
        let mut back = vec![0u8; len];
        let pool = self.pools[p].handle;
        let session = self.pools[p].session;
        if !session.is_null() {
            // A session may have it out under its plan: touching it brings it back.
            let s = glake_smartswap_tensor(session, ptr as *mut c_void, len);
            self.status("smartswap_tensor", s);
        }
        let s = unsafe {
            glake_copy_to_host(
                pool,
                back.as_mut_ptr().cast(),
                ptr as *const c_void,
                len,
                null_mut(),
            )
        };
        assert_eq!(self.status("copy_to_host", s), GLAKE_STATUS_SUCCESS);
        let s = glake_stream_synchronize(pool, null_mut());
        self.status("synchronize", s);
        assert!(back.iter().all(|&b| b == seed), "bytes of {ptr:#x} changed");
    }

    /// A pointer to hand to a call: mostly a live one, sometimes freed, inside, or garbage.
    fn some_ptr(&mut self, p: usize) -> usize {
        let pool = &self.pools[p];
        match self.rng.below(10) {
            0 if !pool.freed.is_empty() => {
                pool.freed[self.rng.below(pool.freed.len() as u64) as usize]
            }
            1 => (self.rng.next() | 1) as usize,
            2 if !pool.live.is_empty() => {
                let k: Vec<_> = pool.live.keys().copied().collect();
                k[self.rng.below(k.len() as u64) as usize] + 512
            }
            _ if !pool.live.is_empty() => {
                let k: Vec<_> = pool.live.keys().copied().collect();
                k[self.rng.below(k.len() as u64) as usize]
            }
            _ => 0,
        }
    }

    fn some_stream(&mut self, p: usize) -> glake_stream {
        let pool = &self.pools[p];
        match self.rng.below(6) {
            0 => (self.rng.next() | 1) as glake_stream,
            1 | 2 if !pool.streams.is_empty() => {
                pool.streams[self.rng.below(pool.streams.len() as u64) as usize]
            }
            _ => null_mut(),
        }
    }

    fn step(&mut self) {
        if self.pools.is_empty() || (self.pools.len() < 3 && self.rng.chance(1)) {
            self.create_pool();
            return;
        }
        let p = self.rng.below(self.pools.len() as u64) as usize;
        let pool = self.pools[p].handle;
        match self.rng.below(22) {
            0..=3 => {
                let len = match self.rng.below(8) {
                    0 => 0,
                    1 => 1 << 60,
                    2 => self.rng.below(8 * MIB as u64) as usize + 1,
                    _ => self.rng.below(256 * 1024) as usize + 1,
                };
                let swappable = self.rng.chance(25);
                let stream = null_mut();
                let mut out = null_mut();
                let s = unsafe {
                    if swappable {
                        glake_malloc_swappable(pool, len, stream, &mut out)
                    } else {
                        glake_malloc(pool, len, stream, &mut out)
                    }
                };
                let region = (!swappable)
                    .then(|| self.pools[p].open.last().copied())
                    .flatten();
                if region.is_some_and(|r| self.pools[p].asleep[r].is_some()) {
                    assert!(s != GLAKE_STATUS_SUCCESS, "allocated in a sleeping region");
                }
                if self.status("malloc", s) == GLAKE_STATUS_SUCCESS && !out.is_null() {
                    let seed = self.rng.below(255) as u8 + 1;
                    let ptr = out as usize;
                    self.pools[p].freed.retain(|&f| f != ptr);
                    self.pools[p].live.insert(
                        ptr,
                        Alloc {
                            len,
                            seed,
                            swappable,
                            state: State::Resident,
                            region,
                        },
                    );
                    self.fill(p, ptr);
                }
            }
            4..=6 => {
                let ptr = self.some_ptr(p);
                let s = glake_free(pool, ptr as *mut c_void);
                let freed = if self.status("free", s) == GLAKE_STATUS_SUCCESS {
                    true
                } else {
                    // A free that reports a failure to order it after a stream (one destroyed
                    // since the allocation was used there) still frees: ask the pool.
                    let probe = glake_record_stream(pool, ptr as *mut c_void, null_mut());
                    self.status("record_stream probe", probe) != GLAKE_STATUS_SUCCESS
                };
                if freed && self.pools[p].live.remove(&ptr).is_some() {
                    self.pools[p].freed.push(ptr);
                } else if !freed {
                    assert!(s != GLAKE_STATUS_SUCCESS);
                } else {
                    assert!(s != GLAKE_STATUS_SUCCESS, "freed an unknown {ptr:#x}");
                }
            }
            7 => {
                let ptr = self.some_ptr(p);
                if self.pools[p]
                    .live
                    .get(&ptr)
                    .is_some_and(|a| a.state == State::Resident)
                {
                    self.verify(p, ptr);
                }
            }
            8 => {
                let ptr = self.some_ptr(p);
                let stream = self.some_stream(p);
                let s = glake_record_stream(pool, ptr as *mut c_void, stream);
                self.status("record_stream", s);
            }
            9 => {
                let s = glake_empty_cache(pool);
                self.status("empty_cache", s);
            }
            10 => {
                let f = [0.5, 1.0, 0.0, -1.0, f64::NAN, 2.0][self.rng.below(6) as usize];
                let s = glake_set_memory_fraction(pool, f);
                self.status("set_memory_fraction", s);
                let s = glake_set_memory_fraction(pool, 1.0);
                self.status("set_memory_fraction", s);
            }
            11 => {
                let mut text = null_mut();
                let s = unsafe { glake_snapshot_json(pool, &mut text) };
                self.status("snapshot_json", s);
                unsafe { glake_string_free(text) };
                let mut stats = std::mem::MaybeUninit::<glake::stats::MemoryStats>::zeroed();
                let s = unsafe { glake_get_stats(pool, stats.as_mut_ptr()) };
                self.status("get_stats", s);
            }
            12..=14 => self.swap(p),
            15 => {
                if self.pools[p].streams.len() < 3 && self.rng.chance(60) {
                    let mut stream = null_mut();
                    let s = unsafe { glake_stream_create(pool, &mut stream) };
                    if self.status("stream_create", s) == GLAKE_STATUS_SUCCESS {
                        self.pools[p].streams.push(stream);
                    }
                } else {
                    let stream = self.some_stream(p);
                    let s = glake_stream_destroy(pool, stream);
                    if self.status("stream_destroy", s) == GLAKE_STATUS_SUCCESS {
                        self.pools[p].streams.retain(|&x| x != stream);
                    }
                }
            }
            16..=17 => self.hooks(p),
            20..=21 => self.regions(p),
            18 => {
                let garbage = (self.rng.next() | 1) as *mut glake_pool;
                let s = glake_empty_cache(garbage);
                assert_eq!(self.status("bad handle", s), GLAKE_STATUS_INVALID_HANDLE);
            }
            _ => {
                let s = glake_pool_check(pool);
                assert_eq!(self.status("pool_check", s), GLAKE_STATUS_SUCCESS);
            }
        }
    }

    fn swap(&mut self, p: usize) {
        let pool = self.pools[p].handle;
        let ptr = self.some_ptr(p);
        let copy = self.some_stream(p);
        let op = self.rng.below(5);
        let s = match op {
            0 => glake_swap_out(pool, ptr as *mut c_void),
            1 => glake_swap_in(pool, ptr as *mut c_void),
            2 => glake_swap_out_async(pool, ptr as *mut c_void, copy),
            3 => glake_swap_in_async(pool, ptr as *mut c_void, copy),
            _ => unsafe { glake_swap_finish(pool, self.rng.below(2) as u32, null_mut()) },
        };
        let s = self.status("swap", s);
        if s != GLAKE_STATUS_SUCCESS {
            return;
        }
        if op == 4 {
            // Some swap-outs under way may be out now: none is read until it is swapped in.
            for a in self.pools[p].live.values_mut() {
                if a.state == State::Leaving {
                    a.state = State::Out;
                }
            }
            return;
        }
        let a = self.pools[p]
            .live
            .get_mut(&ptr)
            .expect("a swap succeeded on a live one");
        assert!(a.swappable, "swapped a plain allocation");
        a.state = match op {
            0 => State::Out,
            2 => State::Leaving,
            _ => State::Resident,
        };
        if a.state == State::Resident {
            let _ = glake_stream_synchronize(pool, null_mut());
            self.verify(p, ptr);
        }
    }

    /// Region calls: begin and end (hostile names among them), sleep in either mode (or a bad
    /// one), wake, info. A wake must bring back the bytes a kept sleep saved.
    fn regions(&mut self, p: usize) {
        let pool = self.pools[p].handle;
        let r = self.rng.below(2) as usize;
        let bad = [0xffu8, 0];
        let name = match self.rng.below(12) {
            0 => std::ptr::null(),
            1 => bad.as_ptr().cast(),
            2 => c"unknown".as_ptr(),
            _ => REGIONS[r].as_ptr(),
        };
        let named = name == REGIONS[r].as_ptr();
        match self.rng.below(5) {
            // "unknown" stays unknown: only the fuzzer's names are ever begun.
            0 if name != c"unknown".as_ptr() => {
                let s = unsafe { glake_region_begin(pool, name) };
                if self.status("region_begin", s) == GLAKE_STATUS_SUCCESS {
                    assert!(named, "began a region with a bad name");
                    self.pools[p].open.push(r);
                }
            }
            0 => {}
            1 => {
                let s = glake_region_end(pool);
                let ok = self.status("region_end", s) == GLAKE_STATUS_SUCCESS;
                assert_eq!(ok, self.pools[p].open.pop().is_some());
            }
            2 => {
                let mode = [0u32, 1, 7][self.rng.below(3) as usize];
                let s = unsafe { glake_sleep(pool, name, mode) };
                if self.status("sleep", s) == GLAKE_STATUS_SUCCESS {
                    assert!(named && mode < 2, "slept with a bad argument");
                    assert!(self.pools[p].asleep[r].is_none(), "slept twice");
                    self.pools[p].asleep[r] = Some(mode == 0);
                    self.cycles.0 += 1;
                    for a in self.pools[p].live.values_mut() {
                        if a.region == Some(r) {
                            a.state = State::Asleep;
                        }
                    }
                }
            }
            3 => {
                let s = unsafe { glake_wake(pool, name) };
                if self.status("wake", s) == GLAKE_STATUS_SUCCESS {
                    assert!(named);
                    let keep = self.pools[p].asleep[r]
                        .take()
                        .expect("woke an awake region");
                    self.cycles.1 += 1;
                    let woken: Vec<usize> = self.pools[p]
                        .live
                        .iter()
                        .filter(|(_, a)| a.region == Some(r))
                        .map(|(&k, _)| k)
                        .collect();
                    for ptr in woken {
                        if let Some(a) = self.pools[p].live.get_mut(&ptr) {
                            a.state = State::Resident;
                        }
                        if keep {
                            self.verify(p, ptr);
                        } else {
                            self.fill(p, ptr); // dropped bytes: a new fill
                        }
                    }
                }
            }
            4 if self.rng.chance(30) => {
                let mut made = 0usize;
                let out = if self.rng.chance(20) {
                    null_mut()
                } else {
                    &mut made
                };
                let s = unsafe { glake_sleep_prepare(pool, name, out) };
                if self.status("sleep_prepare", s) == GLAKE_STATUS_SUCCESS {
                    assert!(named, "prepared a region with a bad name");
                }
            }
            _ => {
                let mut info = glake_region_info::default();
                let out = if self.rng.chance(10) {
                    null_mut()
                } else {
                    &mut info
                };
                let s = unsafe { glake_get_region_info(pool, name, out) };
                if self.status("region_info", s) == GLAKE_STATUS_SUCCESS && named {
                    assert_eq!(info.asleep == 1, self.pools[p].asleep[r].is_some());
                }
            }
        }
    }

    fn hooks(&mut self, p: usize) {
        let pool = self.pools[p].handle;
        let session = self.pools[p].session;
        if session.is_null() || self.rng.chance(3) {
            if !session.is_null() {
                let s = glake_smartswap_destroy(session);
                self.status("smartswap_destroy", s);
                self.pools[p].session = null_mut();
                return;
            }
            let settings = glake_smartswap_settings {
                target_bytes: [0, 1, 8 * MIB as u64, 64 * MIB as u64][self.rng.below(4) as usize],
                warmup_iterations: self.rng.below(3),
                config: glake_swap_config {
                    d2h_bytes_per_s: [0, 1 << 30, 1 << 40][self.rng.below(3) as usize],
                    h2d_bytes_per_s: 1 << 40,
                    prefetch: self.rng.below(3) as usize,
                    preference: self.rng.below(3) as u32,
                },
            };
            let mut out = null_mut();
            let s = unsafe { glake_smartswap_create(pool, &settings, &mut out) };
            if self.status("smartswap_create", s) == GLAKE_STATUS_SUCCESS {
                self.pools[p].session = out;
            }
            return;
        }
        let ptr = self.some_ptr(p);
        let stream = self.some_stream(p);
        let s = match self.rng.below(6) {
            0 => glake_smartswap_begin_iteration(session),
            1 => unsafe { glake_smartswap_begin_op(session, c"op".as_ptr(), stream) },
            2 => glake_smartswap_tensor(
                session,
                ptr as *mut c_void,
                self.rng.below(MIB as u64) as usize,
            ),
            3 => glake_smartswap_end_op(session),
            4 => glake_smartswap_end_iteration(session),
            _ => glake_smartswap_set_phase(session, self.rng.below(5) as u32),
        };
        self.status("smartswap hook", s);
    }

    /// Frees everything, checks the pool, and destroys it: all memory must come back.
    fn drain(&mut self) {
        for p in 0..self.pools.len() {
            let pool = self.pools[p].handle;
            for _ in std::mem::take(&mut self.pools[p].open) {
                let s = glake_region_end(pool);
                assert_eq!(self.status("region_end", s), GLAKE_STATUS_SUCCESS);
            }
            if !self.pools[p].session.is_null() {
                let s = glake_smartswap_destroy(self.pools[p].session);
                self.status("smartswap_destroy", s);
            }
            let resident: Vec<usize> = self.pools[p]
                .live
                .iter()
                .filter(|(_, a)| a.state == State::Resident)
                .map(|(&k, _)| k)
                .collect();
            for ptr in resident {
                self.verify(p, ptr);
            }
            let live: Vec<usize> = self.pools[p].live.keys().copied().collect();
            for ptr in live {
                let s = glake_free(pool, ptr as *mut c_void);
                if self.status("free", s) != GLAKE_STATUS_SUCCESS {
                    // Only a free that reports a destroyed stream, and frees anyway.
                    let probe = glake_record_stream(pool, ptr as *mut c_void, null_mut());
                    assert_ne!(self.status("probe", probe), GLAKE_STATUS_SUCCESS, "{s:?}");
                }
            }
            for stream in std::mem::take(&mut self.pools[p].streams) {
                let s = glake_stream_destroy(pool, stream);
                self.status("stream_destroy", s);
            }
            let s = glake_empty_cache(pool);
            assert_eq!(self.status("empty_cache", s), GLAKE_STATUS_SUCCESS);
            assert_eq!(
                self.status("pool_check", glake_pool_check(pool)),
                GLAKE_STATUS_SUCCESS
            );
            let mut stats = std::mem::MaybeUninit::<glake::stats::MemoryStats>::zeroed();
            assert_eq!(
                unsafe { glake_get_stats(pool, stats.as_mut_ptr()) },
                GLAKE_STATUS_SUCCESS
            );
            let stats = unsafe { stats.assume_init() };
            assert_eq!(
                stats.reserved_bytes.all.current, 0,
                "memory left in a drained pool"
            );
            assert_eq!(stats.swapped_bytes.current, 0);
            assert_eq!(
                self.status("pool_destroy", glake_pool_destroy(pool)),
                GLAKE_STATUS_SUCCESS
            );
        }
        self.pools.clear();
    }
}

#[test]
fn random_c_api_sequences_never_panic_lose_bytes_or_leak() {
    let ops: u64 = std::env::var("GLAKE_FUZZ_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let seed: u64 = std::env::var("GLAKE_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_1234_abcd_0001);
    // Pools made with GLAKE_CONFIG_READ_ENV run in guard-page mode.
    // SAFETY: this binary's only test sets it before any thread reads the environment.
    unsafe { std::env::set_var("GLAKE_GUARD", "1") };
    let mut fuzz = Fuzz {
        rng: Rng(seed | 1),
        pools: Vec::new(),
        calls: 0,
        statuses: HashMap::new(),
        cycles: (0, 0),
    };
    let mut done = 0;
    while done < ops {
        fuzz.step();
        done += 1;
        if done % 5_000 == 0 {
            fuzz.drain(); // a full cycle: everything freed and given back, pools made again
        }
    }
    fuzz.drain();
    let mut statuses: Vec<_> = fuzz.statuses.iter().map(|(&s, &n)| (s, n)).collect();
    statuses.sort();
    println!(
        "{ops} steps, {} C calls, seed {seed:#x}: {statuses:?}; {} sleeps, {} wakes",
        fuzz.calls, fuzz.cycles.0, fuzz.cycles.1
    );
    assert!(
        fuzz.cycles.0 > 0 && fuzz.cycles.1 > 0,
        "no sleep and wake reached"
    );
    // The run reached both sides: calls that worked and each kind of refusal it aims at.
    for status in [
        GLAKE_STATUS_SUCCESS,
        GLAKE_STATUS_INVALID_ARGUMENT,
        GLAKE_STATUS_INVALID_POINTER,
        GLAKE_STATUS_DOUBLE_FREE,
        GLAKE_STATUS_OUT_OF_MEMORY,
        GLAKE_STATUS_INVALID_STATE,
        GLAKE_STATUS_INVALID_HANDLE,
    ] {
        let seen = fuzz.statuses.get(&(status as u32)).copied().unwrap_or(0);
        assert!(seen > 0, "no {status:?} in the run");
    }
}
