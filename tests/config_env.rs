//! Environment variables, GMLake's names and the tutorial's spellings. One test function, since
//! the environment is shared by the whole process.

use glake::config::{host_options_from_env, Config, DefragLevel, SleepHost};
use glake::device::host::HostOptions;
use glake::transfer::HostCopy;
use glake::TransferConfig;

const ALL_NAMES: &[&str] = &[
    "GLAKE_GUARD",
    "GLAKE_SLEEP_HOST",
    "GLAKE_SLEEP_REGION",
    "GLAKE_STITCH",
    "vmmDefragment",
    "GLAKE_FRAG_LIMIT",
    "fragLimit",
    "fragment_limit",
    "GLAKE_REUSE_LIMIT",
    "reuseLimit",
    "GLAKE_DEFRAG_LEVEL",
    "defragLevel",
    "defragment_level",
    "GLAKE_AUTO_GC",
    "autoGC",
    "auto_gc_limits",
    "GLAKE_MEMORY_FRACTION",
    "GLAKE_MEMORY_LIMIT",
    "GLAKE_HOST_MEMORY",
    "GLAKE_HOST_DEVICES",
    "GLAKE_COPY_STREAMING",
    "GLAKE_SWAP_TARGET",
    "GLAKE_SWAP_PREFETCH",
    "GLAKE_SWAP_PREFERENCE",
    "GLAKE_SWAP_WARMUP",
    "GLAKE_SWAP_BANDWIDTH",
    "GLAKE_SEGMENT_HANDLES",
    "GLAKE_GATHER",
    "GLAKE_GROW_STITCHED",
];

fn clear() {
    for name in ALL_NAMES {
        unsafe { std::env::remove_var(name) };
    }
}

fn set(name: &str, value: &str) {
    unsafe { std::env::set_var(name, value) };
}

#[test]
fn environment_names_and_aliases() {
    clear();
    assert_eq!(Config::from_env(), Config::default());

    // GMLake's code names, as in the tutorial's export lines.
    set("vmmDefragment", "1");
    set("autoGC", "10000");
    set("fragLimit", "268435456");
    set("reuseLimit", "10");
    set("defragLevel", "0");
    let c = Config::from_env();
    assert!(c.stitch);
    assert_eq!(c.frag_limit, 268435456);
    assert_eq!(c.reuse_limit, 10.0);
    assert_eq!(c.defrag_level, DefragLevel::BeforeGrow);
    assert_eq!(c.auto_gc_bytes, 10000usize << 30);
    clear();

    // Handles per large segment: a count of at least 1, else the default.
    set("GLAKE_SEGMENT_HANDLES", "64");
    assert_eq!(Config::from_env().segment_handles, 64);
    set("GLAKE_SEGMENT_HANDLES", "0");
    assert_eq!(
        Config::from_env().segment_handles,
        Config::default().segment_handles
    );
    clear();

    // The tutorial's spellings.
    set("vmmDefragment", "0");
    set("fragment_limit", "64M");
    set("defragment_level", "1");
    set("auto_gc_limits", "0.5");
    let c = Config::from_env();
    assert!(!c.stitch);
    assert_eq!(c.frag_limit, 64 << 20);
    assert_eq!(c.defrag_level, DefragLevel::WhenFull);
    assert_eq!(c.auto_gc_bytes, 512 << 20);
    clear();

    // Project names win over aliases.
    set("GLAKE_FRAG_LIMIT", "4M");
    set("fragLimit", "8M");
    assert_eq!(Config::from_env().frag_limit, 4 << 20);
    clear();

    // Bad values keep the default and never fail.
    set("reuseLimit", "lots");
    set("defragLevel", "7");
    set("vmmDefragment", "maybe");
    set("GLAKE_MEMORY_FRACTION", "2");
    assert_eq!(Config::from_env(), Config::default());
    clear();

    // Switches of the stitch: off, on, and a bad value that keeps the default.
    set("GLAKE_GROW_STITCHED", "0");
    set("GLAKE_GATHER", "0");
    let c = Config::from_env();
    assert!(!c.grow_stitched && !c.gather);
    set("GLAKE_GROW_STITCHED", "1");
    set("GLAKE_GATHER", "sometimes");
    let c = Config::from_env();
    assert!(c.grow_stitched && c.gather);
    clear();

    set("GLAKE_SLEEP_HOST", "Pageable");
    assert_eq!(Config::from_env().sleep_host, SleepHost::Pageable);
    set("GLAKE_SLEEP_HOST", "disk");
    assert_eq!(Config::from_env().sleep_host, SleepHost::Pinned);
    set("GLAKE_GUARD", "1");
    assert!(Config::from_env().guard);
    set("GLAKE_GUARD", "maybe");
    assert!(!Config::from_env().guard);
    set("GLAKE_SLEEP_REGION", " process ");
    assert_eq!(
        Config::from_env().default_region.as_deref(),
        Some("process")
    );
    set("GLAKE_SLEEP_REGION", "");
    assert_eq!(Config::from_env().default_region, None);
    clear();

    set("GLAKE_MEMORY_FRACTION", "0.25");
    assert_eq!(Config::from_env().memory_fraction, 0.25);
    clear();

    set("GLAKE_MEMORY_LIMIT", "12G");
    assert_eq!(Config::from_env().memory_limit, Some(12 << 30));
    set("GLAKE_MEMORY_LIMIT", "0");
    assert_eq!(Config::from_env().memory_limit, None);
    clear();

    // The host backend's settings.
    assert_eq!(host_options_from_env(), HostOptions::default());
    set("GLAKE_HOST_MEMORY", "1G");
    set("GLAKE_HOST_DEVICES", "4");
    let host = host_options_from_env();
    assert_eq!((host.total_memory, host.device_count), (1 << 30, 4));
    set("GLAKE_HOST_MEMORY", "lots");
    set("GLAKE_HOST_DEVICES", "0");
    let host = host_options_from_env();
    assert_eq!(host.total_memory, HostOptions::default().total_memory);
    assert_eq!(host.device_count, 1);
    clear();

    // How the copy engine's lanes copy host memory, per direction.
    let copies = || {
        let c = TransferConfig::from_env();
        (c.fill_copy, c.drain_copy)
    };
    let default = copies();
    for (value, expected) in [
        ("1", (HostCopy::Streaming, HostCopy::Streaming)),
        ("off", (HostCopy::Plain, HostCopy::Plain)),
        ("h2d", (HostCopy::Streaming, HostCopy::Plain)),
        ("D2H", (HostCopy::Plain, HostCopy::Streaming)),
        ("sometimes", default),
        ("auto", default),
    ] {
        set("GLAKE_COPY_STREAMING", value);
        assert_eq!(copies(), expected, "GLAKE_COPY_STREAMING={value}");
    }
    clear();

    // SmartSwap sessions: a fraction of the device or bytes; bad values leave the defaults.
    use glake::smartswap::Settings;
    use glake::swap::Preference;
    let gib = 1usize << 30;
    let defaults = Settings::from_env(80 * gib);
    assert_eq!(
        defaults.target_bytes,
        80 * gib,
        "no target: the whole device"
    );
    assert_eq!(defaults.preference, Preference::Performance);
    set("GLAKE_SWAP_TARGET", "0.6");
    assert_eq!(Settings::from_env(100 * gib).target_bytes, 60 * gib);
    set("GLAKE_SWAP_TARGET", "24G");
    assert_eq!(Settings::from_env(100 * gib).target_bytes, 24 * gib);
    set("GLAKE_SWAP_TARGET", "lots");
    assert_eq!(Settings::from_env(100 * gib).target_bytes, 100 * gib);
    set("GLAKE_SWAP_PREFETCH", "3");
    set("GLAKE_SWAP_WARMUP", "2");
    set("GLAKE_SWAP_PREFERENCE", "memory");
    set("GLAKE_SWAP_BANDWIDTH", "25000000000");
    let s = Settings::from_env(gib);
    assert_eq!((s.prefetch, s.warmup_iterations), (3, 2));
    assert_eq!(s.preference, Preference::MemorySaving);
    assert_eq!(
        (s.d2h_bytes_per_s, s.h2d_bytes_per_s),
        (25_000_000_000, 25_000_000_000)
    );
    set("GLAKE_SWAP_PREFERENCE", "fast");
    set("GLAKE_SWAP_PREFETCH", "-1");
    let s = Settings::from_env(gib);
    assert_eq!((s.preference, s.prefetch), (Preference::Performance, 1));
    clear();
}
