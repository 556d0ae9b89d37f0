//! Configuration: a plain struct, filled from defaults, then from environment variables.
//!
//! Project-native names are `GLAKE_*`; GMLake's names and the tutorial's spellings are accepted
//! as aliases (the tutorial and GMLake's code disagree, so both work). A bad value is one warning
//! naming the variable and the value used instead, never a failure.

use std::sync::{Mutex, OnceLock};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// When stitching is tried for a large request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefragLevel {
    /// Stitch free blocks before creating new physical memory (GMLake level 0).
    BeforeGrow = 0,
    /// Stitch only once the device (or the memory cap) is full (GMLake level 1).
    WhenFull = 1,
}

/// Settings of one pool.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Stitching on (GMLake `vmmDefragment=1`); off means plain caching.
    pub stitch: bool,
    /// Free blocks smaller than this are not used as stitch pieces (GMLake `fragLimit`).
    pub frag_limit: usize,
    /// A cached stitched block is reused for a request only if it is at most this many times
    /// the request (GMLake `reuseLimit`).
    pub reuse_limit: f64,
    /// When stitching is tried (GMLake `defragLevel`).
    pub defrag_level: DefragLevel,
    /// Bytes of cached stitched address space past which unused stitched blocks are collected
    /// (GMLake `autoGC`, given there in GiB).
    pub auto_gc_bytes: usize,
    /// Largest request served by the small pool.
    pub small_limit: usize,
    /// Fraction of the device's total memory this pool may create (1.0 = no cap).
    pub memory_fraction: f64,
    /// Bytes of physical memory this pool may create (None = no byte cap). With a fraction
    /// below 1 too, the lower cap applies.
    pub memory_limit: Option<usize>,
    /// Most pieces one stitched block may map (each costs a set-access on CUDA).
    pub max_stitch_pieces: usize,
    /// Largest physical handle a segment is made of (a power of two; a small pool uses smaller
    /// ones, see `pool::blocks::chunk_limit`). Larger handles make creating, mapping and
    /// stitching cheaper (CUDA's costs are per handle); stitches cut segments only at handle
    /// boundaries. The device granularity gives GMLake's layout.
    pub max_chunk: usize,
    /// A new handle is at most 1/`chunk_divisor` of the memory the pool holds, so the bytes a
    /// stitch cannot use at the edges of split handles stay a small share of a pool of any
    /// size, while a large pool, where the per-handle cost adds up, gets large handles. A
    /// segment of 512 MiB or more is never cut into more than 32 handles this way (up to
    /// `max_chunk`).
    pub chunk_divisor: usize,
    /// Most handles a segment of 512 MiB or more is cut into (`GLAKE_SEGMENT_HANDLES`), so
    /// that one made early, while the pool is small, does not come in thousands of small
    /// handles. More handles leave smaller rests that stitches cannot map (less memory), and
    /// cost more access grants per stitch (see BENCHMARKS.md, "More handles per large
    /// segment").
    pub segment_handles: usize,
    /// A stitch that would map a whole idle segment of handles smaller than the pool now
    /// makes releases it and makes its bytes again in large handles (`GLAKE_GATHER`): each
    /// later stitch over that memory grants fewer handles (see `pool::gather`).
    pub gather: bool,
    /// A stitch for a request larger than an idle stitched range whose pieces are all free
    /// grows that range in place (`GLAKE_GROW_STITCHED`): it maps, and grants access to, only
    /// the handles it adds (see `pool::stitching::Growth`).
    pub grow_stitched: bool,
    /// Where a sleeping region's bytes wait on the host (`GLAKE_SLEEP_HOST`).
    pub sleep_host: SleepHost,
    /// The sleep region of every allocation made outside another region
    /// (`GLAKE_SLEEP_REGION`): the whole process's memory can then sleep and wake as one,
    /// without a code change (its allocations stitch the region's own free segments).
    pub default_region: Option<String>,
    /// Guard-page mode (`GLAKE_GUARD=1`), for finding out-of-bounds writes: every allocation of
    /// the shared pool gets memory of its own whose end meets an unmapped range, so a write
    /// past its end faults at once; freed memory is unmapped at once. Slow, and costs a
    /// mapping granule per allocation: a debugging mode.
    pub guard: bool,
    /// Where processes sharing read-only memory meet (`GLAKE_DEDUP_DIR`); by default
    /// `$XDG_RUNTIME_DIR/glake`, else `/tmp/glake-<uid>`.
    pub dedup_dir: Option<std::path::PathBuf>,
    /// Every content hashes alike (`GLAKE_DEDUP_WEAK_HASH=1`), so the byte-by-byte check
    /// alone decides what is shared: a drill for hash collisions, slow with many offers.
    pub dedup_weak_hash: bool,
}

/// Host memory of sleeping regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SleepHost {
    /// Page-locked buffers, copied by the device's DMA engine at the link's speed; kept for the
    /// next sleep, so only the first sleep pays for pinning (slow: the driver locks each page).
    Pinned,
    /// Ordinary memory the copy engine fills and drains through its staging lanes: no pinning
    /// cost and no locked memory, at the engine's speed for pageable memory.
    Pageable,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            stitch: true,
            frag_limit: 2 * MIB,
            reuse_limit: 10.0,
            defrag_level: DefragLevel::BeforeGrow,
            auto_gc_bytes: 1000 * GIB,
            small_limit: MIB,
            memory_fraction: 1.0,
            memory_limit: None,
            max_stitch_pieces: 256,
            max_chunk: 32 * MIB,
            chunk_divisor: 2048,
            segment_handles: 32,
            gather: true,
            grow_stitched: true,
            sleep_host: SleepHost::Pinned,
            default_region: None,
            guard: false,
            dedup_dir: None,
            dedup_weak_hash: false,
        }
    }
}

/// One environment variable and its aliases, first match wins.
struct Var {
    names: &'static [&'static str],
}

const STITCH: Var = Var {
    names: &["GLAKE_STITCH", "vmmDefragment", "VMM_DEFRAGMENT"],
};
const FRAG_LIMIT: Var = Var {
    names: &[
        "GLAKE_FRAG_LIMIT",
        "fragLimit",
        "fragment_limit",
        "FRAGMENT_LIMIT",
    ],
};
const REUSE_LIMIT: Var = Var {
    names: &["GLAKE_REUSE_LIMIT", "reuseLimit", "reuse_limit"],
};
const DEFRAG_LEVEL: Var = Var {
    names: &[
        "GLAKE_DEFRAG_LEVEL",
        "defragLevel",
        "defragment_level",
        "DEFRAGMENT_LEVEL",
    ],
};
const AUTO_GC: Var = Var {
    names: &[
        "GLAKE_AUTO_GC",
        "autoGC",
        "auto_gc_limits",
        "AUTO_GC_LIMITS",
    ],
};
const MEMORY_FRACTION: Var = Var {
    names: &["GLAKE_MEMORY_FRACTION"],
};
const MEMORY_LIMIT: Var = Var {
    names: &["GLAKE_MEMORY_LIMIT"],
};
const MAX_STITCH_PIECES: Var = Var {
    names: &["GLAKE_MAX_STITCH_PIECES"],
};
const MAX_CHUNK: Var = Var {
    names: &["GLAKE_MAX_CHUNK"],
};
const CHUNK_DIVISOR: Var = Var {
    names: &["GLAKE_CHUNK_DIVISOR"],
};
const SEGMENT_HANDLES: Var = Var {
    names: &["GLAKE_SEGMENT_HANDLES"],
};
const GATHER: Var = Var {
    names: &["GLAKE_GATHER"],
};
const GROW_STITCHED: Var = Var {
    names: &["GLAKE_GROW_STITCHED"],
};
const SLEEP_HOST: Var = Var {
    names: &["GLAKE_SLEEP_HOST"],
};
const SLEEP_REGION: Var = Var {
    names: &["GLAKE_SLEEP_REGION"],
};
const GUARD: Var = Var {
    names: &["GLAKE_GUARD"],
};
const DEDUP_DIR: Var = Var {
    names: &["GLAKE_DEDUP_DIR"],
};
const DEDUP_WEAK_HASH: Var = Var {
    names: &["GLAKE_DEDUP_WEAK_HASH"],
};

impl Var {
    fn lookup(&self) -> Option<(&'static str, String)> {
        self.names
            .iter()
            .find_map(|name| std::env::var(name).ok().map(|value| (*name, value)))
    }

    /// Sets `field` from a count of at least `least` in the variable, if set; a bad value is
    /// warned about and leaves `field` as it is.
    fn read_count(&self, least: usize, field: &mut usize) {
        if let Some((name, value)) = self.lookup() {
            match value.trim().parse::<usize>() {
                Ok(n) if n >= least => *field = n,
                _ => warn_bad_value(name, &value, &field.to_string()),
            }
        }
    }
}

/// Warns once per (variable, value) pair, so that a bad value read by many pools is one line.
fn warn_bad_value(name: &str, value: &str, used: &str) {
    static WARNED: OnceLock<Mutex<Vec<(String, String)>>> = OnceLock::new();
    let warned = WARNED.get_or_init(|| Mutex::new(Vec::new()));
    let mut warned = crate::sync::lock(warned);
    let key = (name.to_string(), value.to_string());
    if !warned.contains(&key) {
        log::warn!("glake: ignoring {name}={value:?}: not a valid value; using {used}");
        warned.push(key);
    }
}

/// Parses a byte count: a plain integer, or one with a K, M, G or T suffix (powers of 1024).
pub fn parse_bytes(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last()? {
        (i, 'k' | 'K') => (&text[..i], 10),
        (i, 'm' | 'M') => (&text[..i], 20),
        (i, 'g' | 'G') => (&text[..i], 30),
        (i, 't' | 'T') => (&text[..i], 40),
        _ => (text, 0),
    };
    let value: usize = digits.trim().parse().ok()?;
    value.checked_mul(1usize << shift)
}

/// A byte count from one environment variable, with a warning on a bad value.
pub fn env_bytes(name: &str) -> Option<usize> {
    let value = std::env::var(name).ok()?;
    match parse_bytes(&value) {
        Some(bytes) => Some(bytes),
        None => {
            warn_bad_value(name, &value, "the default");
            None
        }
    }
}

/// Settings of the host backend: the defaults, overridden by `GLAKE_HOST_MEMORY` (bytes, or with
/// a K/M/G/T suffix) and `GLAKE_HOST_DEVICES` (at least 1).
pub fn host_options_from_env() -> crate::device::host::HostOptions {
    let mut options = crate::device::host::HostOptions::default();
    if let Some(bytes) = env_bytes("GLAKE_HOST_MEMORY") {
        options.total_memory = bytes;
    }
    if let Some(count) = env_bytes("GLAKE_HOST_DEVICES") {
        options.device_count = count.max(1);
    }
    options
}

fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

impl Config {
    /// Defaults with every environment variable applied.
    pub fn from_env() -> Self {
        let mut config = Config::default();
        config.apply_env();
        config
    }

    /// Overrides fields with the environment variables that are set.
    pub fn apply_env(&mut self) {
        if let Some((name, value)) = STITCH.lookup() {
            match parse_bool(&value) {
                Some(on) => self.stitch = on,
                None => warn_bad_value(name, &value, &format!("{}", self.stitch as u8)),
            }
        }
        if let Some((name, value)) = FRAG_LIMIT.lookup() {
            match parse_bytes(&value) {
                Some(bytes) => self.frag_limit = bytes,
                None => warn_bad_value(name, &value, &self.frag_limit.to_string()),
            }
        }
        if let Some((name, value)) = REUSE_LIMIT.lookup() {
            match value.trim().parse::<f64>() {
                Ok(limit) if limit.is_finite() && limit >= 1.0 => self.reuse_limit = limit,
                _ => warn_bad_value(name, &value, &self.reuse_limit.to_string()),
            }
        }
        if let Some((name, value)) = DEFRAG_LEVEL.lookup() {
            match value.trim() {
                "0" => self.defrag_level = DefragLevel::BeforeGrow,
                "1" => self.defrag_level = DefragLevel::WhenFull,
                _ => warn_bad_value(name, &value, &(self.defrag_level as u8).to_string()),
            }
        }
        if let Some((name, value)) = AUTO_GC.lookup() {
            // GMLake gives this in GiB; a fractional value is accepted.
            match value.trim().parse::<f64>() {
                Ok(gib) if gib.is_finite() && gib > 0.0 => {
                    self.auto_gc_bytes = (gib * GIB as f64).min(usize::MAX as f64) as usize
                }
                _ => warn_bad_value(
                    name,
                    &value,
                    &format!("{} GiB", self.auto_gc_bytes as f64 / GIB as f64),
                ),
            }
        }
        if let Some((name, value)) = MEMORY_FRACTION.lookup() {
            match value.trim().parse::<f64>() {
                Ok(f) if f > 0.0 && f <= 1.0 => self.memory_fraction = f,
                _ => warn_bad_value(name, &value, &self.memory_fraction.to_string()),
            }
        }
        if let Some((name, value)) = MEMORY_LIMIT.lookup() {
            match parse_bytes(&value) {
                Some(bytes) if bytes > 0 => self.memory_limit = Some(bytes),
                _ => warn_bad_value(name, &value, "no byte limit"),
            }
        }
        MAX_STITCH_PIECES.read_count(2, &mut self.max_stitch_pieces);
        if let Some((name, value)) = MAX_CHUNK.lookup() {
            match parse_bytes(&value) {
                Some(bytes) if bytes.is_power_of_two() => self.max_chunk = bytes,
                _ => warn_bad_value(name, &value, &self.max_chunk.to_string()),
            }
        }
        CHUNK_DIVISOR.read_count(1, &mut self.chunk_divisor);
        SEGMENT_HANDLES.read_count(1, &mut self.segment_handles);
        for (var, field) in [
            (GATHER, &mut self.gather),
            (GROW_STITCHED, &mut self.grow_stitched),
        ] {
            if let Some((name, value)) = var.lookup() {
                match parse_bool(&value) {
                    Some(on) => *field = on,
                    None => warn_bad_value(name, &value, &format!("{}", *field as u8)),
                }
            }
        }
        if let Some((name, value)) = SLEEP_HOST.lookup() {
            match value.trim().to_ascii_lowercase().as_str() {
                "pinned" => self.sleep_host = SleepHost::Pinned,
                "pageable" => self.sleep_host = SleepHost::Pageable,
                _ => warn_bad_value(name, &value, &format!("{:?}", self.sleep_host)),
            }
        }
        if let Some((name, value)) = GUARD.lookup() {
            match parse_bool(&value) {
                Some(on) => self.guard = on,
                None => warn_bad_value(name, &value, &format!("{}", self.guard as u8)),
            }
        }
        if let Some((name, value)) = DEDUP_DIR.lookup() {
            match value.trim() {
                "" => warn_bad_value(name, &value, "the default directory"),
                dir => self.dedup_dir = Some(dir.into()),
            }
        }
        if let Some((name, value)) = DEDUP_WEAK_HASH.lookup() {
            match parse_bool(&value) {
                Some(on) => self.dedup_weak_hash = on,
                None => warn_bad_value(name, &value, &format!("{}", self.dedup_weak_hash as u8)),
            }
        }
        if let Some((name, value)) = SLEEP_REGION.lookup() {
            let value = value.trim();
            if value.is_empty() || value.len() > crate::pool::MAX_REGION_NAME {
                warn_bad_value(name, value, "no default region");
            } else {
                self.default_region = Some(value.to_string());
            }
        }
    }

    /// Checks the values a program set directly (the environment path never fails).
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |what: String| Err(crate::Error::invalid_argument(what));
        if !(self.reuse_limit.is_finite() && self.reuse_limit >= 1.0) {
            return bad(format!("reuse_limit {} must be >= 1", self.reuse_limit));
        }
        if !(self.memory_fraction > 0.0 && self.memory_fraction <= 1.0) {
            return bad(format!(
                "memory_fraction {} must be in (0, 1]",
                self.memory_fraction
            ));
        }
        if self.memory_limit == Some(0) {
            return bad("memory_limit must be at least 1 byte".to_string());
        }
        if self.small_limit == 0 || self.small_limit > 64 * MIB {
            return bad(format!(
                "small_limit {} must be in 1..=64 MiB",
                self.small_limit
            ));
        }
        if self.max_stitch_pieces < 2 {
            return bad(format!(
                "max_stitch_pieces {} must be >= 2",
                self.max_stitch_pieces
            ));
        }
        if self.segment_handles == 0 {
            return bad("segment_handles must be at least 1".to_string());
        }
        if self.chunk_divisor == 0 {
            return bad("chunk_divisor must be at least 1".to_string());
        }
        if let Some(name) = &self.default_region {
            if name.is_empty() || name.len() > crate::pool::MAX_REGION_NAME {
                return bad(format!(
                    "default_region has {} bytes: 1 to {} are allowed",
                    name.len(),
                    crate::pool::MAX_REGION_NAME
                ));
            }
        }
        if !self.max_chunk.is_power_of_two() {
            return bad(format!(
                "max_chunk {} must be a power of two",
                self.max_chunk
            ));
        }
        Ok(())
    }
}

/// Settings of a copy engine ([`crate::transfer::Engine`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TransferConfig {
    /// Lanes (threads with their own staging) of the target's own link. Pageable copies are
    /// bound by how fast threads copy host memory, so this sets their speed.
    pub lanes: usize,
    /// Lanes of each relay through a peer.
    pub relay_lanes: usize,
    /// Staging slots per lane: chunks in flight at once.
    pub slots: usize,
    /// Bytes of each slot (the largest chunk).
    pub chunk: usize,
    /// The smallest chunk a copy is cut into.
    pub min_chunk: usize,
    /// The smallest chunk of a device-to-host copy: smaller than host-to-device, since there
    /// the lanes beat the driver from 2 MiB on and need several chunks to do it.
    pub min_chunk_d2h: usize,
    /// A pageable copy wakes one lane per this many bytes (all of them from lanes x this on),
    /// so that mid-sized copies do not pay for waking lanes that would each move little.
    pub bytes_per_lane: usize,
    /// Most peers to relay through (0: the target's own link only).
    pub max_peers: usize,
    /// Measure each path's bandwidth when the engine starts (with relays only).
    pub measure: bool,
    /// Most bytes of pinned host staging an engine holds (every lane's slots together), and
    /// most bytes of relay buffers on each peer. Past it, chunks shrink (down to the smaller
    /// chunk floor), then lanes are dropped.
    pub max_staging: usize,
    /// Lanes wait for their slots by polling and yielding the CPU to the other lanes, instead
    /// of in the driver's wait (which may spin on a core the host copies need). Measured on an
    /// H200 the two were alike, so the driver's wait stays the default.
    pub yield_waits: bool,
    /// How lanes copy pageable host memory into staging buffers (host-to-device copies).
    pub fill_copy: crate::transfer::HostCopy,
    /// How lanes copy staging buffers out to pageable host memory (device-to-host copies).
    pub drain_copy: crate::transfer::HostCopy,
    pub policy: crate::transfer::Policy,
}

impl Default for TransferConfig {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Pageable copies are bound by how fast threads copy host memory, which on the GPU
        // machines measured grows up to about 16 threads (an H100 host copied out of pageable
        // memory at 36 GB/s with 8 threads and 45 with 16).
        TransferConfig {
            lanes: cpus.clamp(1, 16),
            relay_lanes: (cpus / 2).clamp(1, 16),
            slots: 3,
            chunk: 4 * MIB,
            min_chunk: MIB,
            min_chunk_d2h: 512 << 10,
            bytes_per_lane: MIB,
            max_peers: 8,
            measure: true,
            max_staging: 512 * MIB,
            yield_waits: false,
            fill_copy: crate::transfer::HostCopy::Streaming,
            drain_copy: default_drain_copy(),
            policy: crate::transfer::Policy::default(),
        }
    }
}

/// Device-to-host copies stream their stores once the whole copy is larger than the CPU's
/// last-level cache (32 MiB where the system does not say): see [`crate::transfer::HostCopy`].
fn default_drain_copy() -> crate::transfer::HostCopy {
    let cache = crate::transfer::topology::last_level_cache().unwrap_or(32 * MIB);
    crate::transfer::HostCopy::StreamingAbove(cache)
}

const COPY_LANES: Var = Var {
    names: &["GLAKE_COPY_LANES"],
};
const COPY_RELAY_LANES: Var = Var {
    names: &["GLAKE_COPY_RELAY_LANES"],
};
const COPY_SLOTS: Var = Var {
    names: &["GLAKE_COPY_SLOTS"],
};
const COPY_CHUNK: Var = Var {
    names: &["GLAKE_COPY_CHUNK"],
};
const COPY_PEERS: Var = Var {
    names: &["GLAKE_COPY_PEERS"],
};
const COPY_MIN_PAGEABLE: Var = Var {
    names: &["GLAKE_COPY_MIN_PAGEABLE"],
};
const COPY_MIN_PAGEABLE_D2H: Var = Var {
    names: &["GLAKE_COPY_MIN_PAGEABLE_D2H"],
};
const COPY_BYTES_PER_LANE: Var = Var {
    names: &["GLAKE_COPY_BYTES_PER_LANE"],
};
const COPY_MIN_CHUNK: Var = Var {
    names: &["GLAKE_COPY_MIN_CHUNK"],
};
const COPY_MIN_CHUNK_D2H: Var = Var {
    names: &["GLAKE_COPY_MIN_CHUNK_D2H"],
};
const COPY_STAGING: Var = Var {
    names: &["GLAKE_COPY_STAGING"],
};
const COPY_YIELD: Var = Var {
    names: &["GLAKE_COPY_YIELD"],
};
const COPY_STREAMING: Var = Var {
    names: &["GLAKE_COPY_STREAMING"],
};
const COPY_MIN_RELAY: Var = Var {
    names: &["GLAKE_COPY_MIN_RELAY"],
};

/// Sets `field` from a count variable (at least `min`), warning on a bad value.
fn apply_count(var: &Var, min: usize, field: &mut usize) {
    if let Some((name, value)) = var.lookup() {
        match value.trim().parse::<usize>() {
            Ok(n) if n >= min => *field = n,
            _ => warn_bad_value(name, &value, &field.to_string()),
        }
    }
}

/// Sets `field` from a byte-count variable (at least `min`), warning on a bad value.
fn apply_size(var: &Var, min: usize, field: &mut usize) {
    if let Some((name, value)) = var.lookup() {
        match parse_bytes(&value) {
            Some(n) if n >= min => *field = n,
            _ => warn_bad_value(name, &value, &field.to_string()),
        }
    }
}

impl TransferConfig {
    /// Defaults with every `GLAKE_COPY_*` variable applied.
    pub fn from_env() -> Self {
        let mut config = TransferConfig::default();
        config.apply_env();
        config
    }

    /// Overrides fields with the `GLAKE_COPY_*` variables that are set.
    pub fn apply_env(&mut self) {
        apply_count(&COPY_LANES, 1, &mut self.lanes);
        apply_count(&COPY_RELAY_LANES, 1, &mut self.relay_lanes);
        apply_count(&COPY_SLOTS, 1, &mut self.slots);
        apply_size(&COPY_CHUNK, 64 << 10, &mut self.chunk);
        apply_size(&COPY_MIN_CHUNK, 4096, &mut self.min_chunk);
        apply_size(&COPY_MIN_CHUNK_D2H, 4096, &mut self.min_chunk_d2h);
        apply_size(&COPY_STAGING, 64 << 10, &mut self.max_staging);
        apply_count(&COPY_PEERS, 0, &mut self.max_peers);
        apply_size(&COPY_MIN_PAGEABLE, 0, &mut self.policy.min_pageable);
        apply_size(&COPY_MIN_PAGEABLE_D2H, 0, &mut self.policy.min_pageable_d2h);
        apply_size(&COPY_BYTES_PER_LANE, 1, &mut self.bytes_per_lane);
        apply_size(&COPY_MIN_RELAY, 0, &mut self.policy.min_relay);
        if let Some((name, value)) = COPY_YIELD.lookup() {
            match parse_bool(&value) {
                Some(on) => self.yield_waits = on,
                None => warn_bad_value(name, &value, &(self.yield_waits as u8).to_string()),
            }
        }
        if let Some((name, value)) = COPY_STREAMING.lookup() {
            use crate::transfer::HostCopy::{Plain, Streaming};
            let both = |on: bool| if on { Streaming } else { Plain };
            match (
                value.trim().to_ascii_lowercase().as_str(),
                parse_bool(&value),
            ) {
                ("auto", _) => {
                    (self.fill_copy, self.drain_copy) = (Streaming, default_drain_copy())
                }
                ("h2d", _) => (self.fill_copy, self.drain_copy) = (Streaming, Plain),
                ("d2h", _) => (self.fill_copy, self.drain_copy) = (Plain, Streaming),
                (_, Some(on)) => (self.fill_copy, self.drain_copy) = (both(on), both(on)),
                _ => warn_bad_value(name, &value, "the default"),
            }
        }
        self.min_chunk = self.min_chunk.min(self.chunk);
        self.min_chunk_d2h = self.min_chunk_d2h.min(self.chunk);
    }

    /// This configuration with chunks and then lanes cut until the staging of `relays` relay
    /// paths fits `max_staging`: pinned host buffers of every lane together, and the relay
    /// buffers each peer holds.
    pub fn fit_staging(&self, relays: usize) -> TransferConfig {
        let mut fitted = self.clone();
        let floor = fitted.min_chunk.min(fitted.min_chunk_d2h).max(4096);
        let host = |c: &TransferConfig| {
            (c.lanes + relays * c.relay_lanes)
                .saturating_mul(c.slots)
                .saturating_mul(c.chunk)
        };
        let peer = |c: &TransferConfig| {
            c.relay_lanes
                .saturating_mul(c.slots)
                .saturating_mul(c.chunk)
        };
        let fits = |c: &TransferConfig| {
            host(c) <= c.max_staging && (relays == 0 || peer(c) <= c.max_staging)
        };
        while !fits(&fitted) && fitted.chunk / 2 >= floor {
            fitted.chunk /= 2;
        }
        while !fits(&fitted) && (fitted.lanes > 1 || fitted.relay_lanes > 1) {
            if fitted.lanes >= fitted.relay_lanes && fitted.lanes > 1 {
                fitted.lanes -= 1;
            } else {
                fitted.relay_lanes -= 1;
            }
        }
        while !fits(&fitted) && fitted.slots > 1 {
            fitted.slots -= 1;
        }
        if !fits(&fitted) {
            log::warn!(
                "glake: copy staging of {} bytes stays above GLAKE_COPY_STAGING ({} bytes): one \
                 slot of {} bytes per lane is the least the engine works with",
                host(&fitted),
                fitted.max_staging,
                fitted.chunk
            );
        }
        fitted.min_chunk = fitted.min_chunk.min(fitted.chunk);
        fitted.min_chunk_d2h = fitted.min_chunk_d2h.min(fitted.chunk);
        fitted
    }

    /// Checks values a program set directly.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |what: String| Err(crate::Error::invalid_argument(what));
        if self.lanes == 0 || self.lanes > 256 {
            return bad(format!("lanes {} must be in 1..=256", self.lanes));
        }
        if self.relay_lanes == 0 || self.relay_lanes > 256 {
            return bad(format!(
                "relay_lanes {} must be in 1..=256",
                self.relay_lanes
            ));
        }
        if self.slots == 0 || self.slots > 64 {
            return bad(format!("slots {} must be in 1..=64", self.slots));
        }
        if self.chunk < 4096 || self.chunk > 1 << 30 {
            return bad(format!("chunk {} must be in 4 KiB..=1 GiB", self.chunk));
        }
        if self.min_chunk_d2h == 0 || self.min_chunk_d2h > self.chunk {
            return bad(format!(
                "min_chunk_d2h {} must be in 1..=chunk ({})",
                self.min_chunk_d2h, self.chunk
            ));
        }
        if self.min_chunk == 0 || self.min_chunk > self.chunk {
            return bad(format!(
                "min_chunk {} must be in 1..=chunk ({})",
                self.min_chunk, self.chunk
            ));
        }
        if self.bytes_per_lane == 0 {
            return bad("bytes_per_lane must be at least 1".to_string());
        }
        if !(self.policy.min_share.is_finite() && (0.0..=1.0).contains(&self.policy.min_share)) {
            return bad(format!(
                "policy.min_share {} must be in [0, 1]",
                self.policy.min_share
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("512"), Some(512));
        assert_eq!(parse_bytes("2M"), Some(2 * MIB));
        assert_eq!(parse_bytes(" 3g "), Some(3 * GIB));
        assert_eq!(parse_bytes("x"), None);
        assert_eq!(parse_bytes(""), None);
        assert_eq!(parse_bytes("99999999999999T"), None);
    }

    #[test]
    fn staging_fits_its_cap() {
        let config = TransferConfig {
            lanes: 16,
            relay_lanes: 8,
            slots: 3,
            chunk: 4 * MIB,
            min_chunk: MIB,
            min_chunk_d2h: 512 << 10,
            max_staging: 64 * MIB,
            ..TransferConfig::default()
        };
        let fitted = config.fit_staging(1);
        let host = (fitted.lanes + fitted.relay_lanes) * fitted.slots * fitted.chunk;
        assert!(host <= 64 * MIB, "{fitted:?}");
        assert_eq!(fitted.chunk, 512 << 10, "chunks shrink to the floor first");
        assert_eq!(fitted.min_chunk, fitted.chunk);
        assert!(fitted.validate().is_ok());
        // Room enough: nothing changes.
        let roomy = TransferConfig {
            max_staging: 1 << 30,
            ..config.clone()
        };
        assert_eq!(roomy.fit_staging(1), roomy);
        // A small cap keeps one lane of each kind, the smallest chunk and fewer slots.
        let tiny = TransferConfig {
            max_staging: 2 * MIB,
            ..config
        };
        let fitted = tiny.fit_staging(1);
        assert_eq!((fitted.lanes, fitted.relay_lanes), (1, 1));
        assert!(2 * fitted.slots * fitted.chunk <= 2 * MIB, "{fitted:?}");
    }

    #[test]
    fn validate_rejects_nonsense() {
        let mut c = Config::default();
        assert!(c.validate().is_ok());
        c.reuse_limit = 0.5;
        assert!(c.validate().is_err());
        c = Config {
            memory_fraction: 0.0,
            ..Config::default()
        };
        assert!(c.validate().is_err());
    }
}
