//! Cross-process deduplication with real processes: each "replica" is this test binary run
//! again as a child (`replica` below), talking to the test over its standard input and output,
//! on the backend under test (`GLAKE_TEST_BACKEND`). Host devices of different processes share
//! memory through memfd descriptors, as CUDA devices do through exported handles.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;

use common::{pattern, read, write};
use glake::device::host::{HostDevice, HostOptions};
use glake::device::{SharedDevice, Stream};
use glake::{Config, ErrorKind, Pool};

/// Bytes of each layer of a replica's "weights": four 2 MiB handles.
const LAYER: usize = 8 << 20;

/// A replica process: layers of weights filled from seeds, marked read-only one by one.
struct Replica {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// What a replica reported after marking its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Marked {
    shared: u64,
    offered: u64,
    kept: u64,
    /// Bytes of memory the replica holds of its own: reserved, less what it maps of others'.
    created: u64,
    /// Bytes the device would hold more without sharing, all processes together.
    device_saved: u64,
}

impl Replica {
    /// Starts a replica with one layer per seed, sharing through `dir`.
    fn start(dir: &Path, seeds: &[u64], envs: &[(&str, &str)]) -> Replica {
        let seeds: Vec<String> = seeds.iter().map(u64::to_string).collect();
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args(["--exact", "replica", "--nocapture", "--test-threads=1"])
            .env("GLAKE_TEST_REPLICA", seeds.join(","))
            .env("GLAKE_DEDUP_DIR", dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (k, v) in envs {
            command.env(k, v);
        }
        let mut child = command.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Replica {
            child,
            stdin,
            stdout,
        }
    }

    /// The next line the replica says that starts with `tag`, without the tag.
    fn expect(&mut self, tag: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "replica ended before saying {tag}");
            // The test harness may start the line with its own "test replica ... ".
            if let Some(at) = line.find(tag) {
                return line[at + tag.len()..].trim().to_string();
            }
        }
    }

    fn marked(&mut self) -> Marked {
        let text = self.expect("MARKED");
        let n: Vec<u64> = text.split(' ').map(|v| v.parse().unwrap()).collect();
        Marked {
            shared: n[0],
            offered: n[1],
            kept: n[2],
            created: n[3],
            device_saved: n[4],
        }
    }

    /// Asks the replica to read its weights back; true when every byte is as written.
    fn weights_intact(&mut self) -> bool {
        writeln!(self.stdin, "check").unwrap();
        self.expect("CHECK") == "ok"
    }

    fn finish(mut self) {
        drop(self.stdin);
        assert!(self.child.wait().unwrap().success());
    }
}

/// The child side: runs only when started by `Replica::start`.
#[test]
fn replica() {
    let Ok(seeds) = std::env::var("GLAKE_TEST_REPLICA") else {
        return;
    };
    let seeds: Vec<u64> = seeds.split(',').map(|s| s.parse().unwrap()).collect();
    let host = (!common::backend_is_cuda())
        .then(|| Arc::new(HostDevice::new(0, HostOptions::default()).unwrap()));
    let device: SharedDevice = match &host {
        Some(host) => host.clone(),
        None => common::device(),
    };
    let mut config = Config::default();
    config.apply_env();
    let pool = Pool::new(device.clone(), config).unwrap();
    let layers: Vec<u64> = seeds
        .iter()
        .map(|&seed| {
            let ptr = pool.malloc(LAYER, Stream::DEFAULT).unwrap();
            write(&device, ptr, &pattern(seed, LAYER));
            ptr
        })
        .collect();
    let mut total = glake::pool::ShareReport::default();
    for &ptr in &layers {
        match pool.share_read_only(ptr, LAYER) {
            Ok(report) => {
                total.shared_bytes += report.shared_bytes;
                total.offered_bytes += report.offered_bytes;
                total.kept_bytes += report.kept_bytes;
            }
            Err(err) => {
                println!("ERROR {:?} {}", err.kind(), err.message());
                total.kept_bytes += LAYER as u64;
            }
        }
    }
    let stats = pool.stats();
    assert_eq!(stats.shared_bytes as u64, total.shared_bytes);
    assert_eq!(stats.offered_bytes as u64, total.offered_bytes);
    let own = stats.reserved_bytes.all.current - stats.shared_bytes;
    if let Some(host) = &host {
        assert_eq!(
            host.created_bytes() as i64,
            own,
            "the books and the device disagree"
        );
    }
    println!(
        "MARKED {} {} {} {} {}",
        total.shared_bytes, total.offered_bytes, total.kept_bytes, own, stats.device_saved_bytes
    );
    let mut lines = std::io::stdin().lock().lines();
    while let Some(Ok(line)) = lines.next() {
        if line == "check" {
            let intact = layers
                .iter()
                .zip(&seeds)
                .all(|(&ptr, &seed)| read(&device, ptr, LAYER) == pattern(seed, LAYER));
            println!("CHECK {}", if intact { "ok" } else { "bad" });
        }
    }
    for ptr in layers {
        pool.free(ptr).unwrap();
    }
    pool.empty_cache().unwrap();
    assert_eq!(
        pool.stats().reserved_bytes.all.current,
        0,
        "memory left behind"
    );
    pool.check_invariants().unwrap();
}

/// A private meeting directory for one test.
fn meeting(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("glake-dedup-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn identical_replicas_hold_their_weights_once() {
    let dir = meeting("identical");
    let mut first = Replica::start(&dir, &[1, 2, 3], &[]);
    let a = first.marked();
    assert_eq!((a.shared, a.offered, a.kept), (0, 3 * LAYER as u64, 0));
    let mut second = Replica::start(&dir, &[1, 2, 3], &[]);
    let b = second.marked();
    assert_eq!((b.shared, b.offered, b.kept), (3 * LAYER as u64, 0, 0));
    assert_eq!(
        b.created, 0,
        "the second replica keeps no weights of its own"
    );
    assert_eq!((a.device_saved, b.device_saved), (0, 3 * LAYER as u64));
    assert!(first.weights_intact() && second.weights_intact());
    first.finish();
    second.finish();
}

#[test]
fn different_weights_share_nothing() {
    let dir = meeting("different");
    let mut first = Replica::start(&dir, &[1, 2], &[]);
    let mut second = {
        first.marked();
        Replica::start(&dir, &[5, 6], &[])
    };
    let b = second.marked();
    assert_eq!((b.shared, b.offered), (0, 2 * LAYER as u64));
    assert_eq!(b.created, 2 * LAYER as u64);
    assert!(second.weights_intact() && first.weights_intact());
    first.finish();
    second.finish();
}

#[test]
fn a_fine_tune_shares_only_its_unchanged_layers() {
    let dir = meeting("finetune");
    let mut base = Replica::start(&dir, &[1, 2, 3, 4, 5, 6], &[]);
    base.marked();
    // Layers 2 and 5 differ from the base.
    let mut tuned = Replica::start(&dir, &[1, 12, 3, 4, 15, 6], &[]);
    let t = tuned.marked();
    assert_eq!(t.shared, 4 * LAYER as u64);
    assert_eq!(t.offered, 2 * LAYER as u64);
    assert_eq!(t.created, 2 * LAYER as u64);
    assert!(tuned.weights_intact() && base.weights_intact());
    base.finish();
    tuned.finish();
}

#[test]
fn memory_outlives_its_killed_first_owner() {
    let dir = meeting("killed");
    let mut first = Replica::start(&dir, &[7, 8], &[]);
    first.marked();
    let mut second = Replica::start(&dir, &[7, 8], &[]);
    assert_eq!(second.marked().shared, 2 * LAYER as u64);
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    assert!(
        second.weights_intact(),
        "the importer's bytes went with the exporter"
    );
    // A later replica finds the memory through the second one.
    let mut third = Replica::start(&dir, &[7, 8], &[]);
    let c = third.marked();
    assert_eq!((c.shared, c.created), (2 * LAYER as u64, 0));
    // The killed process's records no longer count: two processes map each layer.
    assert_eq!(c.device_saved, 2 * LAYER as u64);
    assert!(third.weights_intact() && second.weights_intact());
    second.finish();
    third.finish();
}

#[test]
fn a_hash_collision_shares_nothing() {
    let dir = meeting("collision");
    let weak = [("GLAKE_DEDUP_WEAK_HASH", "1")];
    let mut first = Replica::start(&dir, &[1, 2], &weak);
    first.marked();
    // Every content hashes alike: only the byte compare keeps these apart.
    let mut second = Replica::start(&dir, &[3, 2], &weak);
    let b = second.marked();
    assert_eq!((b.shared, b.offered), (LAYER as u64, LAYER as u64));
    assert!(second.weights_intact() && first.weights_intact());
    first.finish();
    second.finish();
}

#[test]
fn a_stale_or_garbled_index_shares_nothing_and_loses_nothing() {
    // Stale: records of a process long gone are dropped, and the memory offered anew.
    let dir = meeting("stale");
    let dir_made = glake::dedup::index::directory(Some(&dir)).unwrap();
    let identity = common::device().identity().unwrap();
    let index = glake::dedup::index::Index::open(&dir_made, &identity).unwrap();
    let mut weak = Replica::start(&dir, &[1], &[("GLAKE_DEDUP_WEAK_HASH", "1")]);
    weak.marked();
    weak.finish();
    index
        .publish(glake::dedup::index::Record {
            hash: 0,
            len: LAYER as u64,
            owner: 0xdead,
            export: 1,
            origin: 0xdead,
        })
        .unwrap();
    let mut replica = Replica::start(&dir, &[1], &[("GLAKE_DEDUP_WEAK_HASH", "1")]);
    let r = replica.marked();
    assert_eq!((r.shared, r.offered), (0, LAYER as u64));
    assert!(replica.weights_intact());
    replica.finish();
    assert!(index
        .records()
        .unwrap()
        .iter()
        .all(|rec| rec.owner != 0xdead));

    // Garbled: a clear error, the weights untouched.
    std::fs::write(index.path(), "not an index\n").unwrap();
    let mut replica = Replica::start(&dir, &[1], &[]);
    let text = replica.expect("ERROR");
    assert!(
        text.starts_with("InvalidState") && text.contains("unreadable"),
        "{text}"
    );
    let r = replica.marked();
    assert_eq!((r.shared, r.offered, r.created), (0, 0, LAYER as u64));
    assert!(replica.weights_intact());
    replica.finish();
}

/// A pool on a host device of this process, sharing through a meeting directory of its own.
fn sharing_host_pool(name: &str) -> (Arc<HostDevice>, SharedDevice, Pool) {
    let host = Arc::new(HostDevice::new(0, HostOptions::default()).unwrap());
    let device: SharedDevice = host.clone();
    let config = Config {
        dedup_dir: Some(meeting(name)),
        ..Config::default()
    };
    let pool = Pool::new(device.clone(), config).unwrap();
    (host, device, pool)
}

#[test]
fn shared_memory_is_read_only_and_freed_memory_is_not_reused() {
    let (host, device, pool) = sharing_host_pool("readonly");
    let ptr = pool.malloc(LAYER + 4096, Stream::DEFAULT).unwrap();
    write(&device, ptr, &pattern(9, LAYER + 4096));
    let report = pool.share_read_only(ptr, LAYER + 4096).unwrap();
    // The segment is five 2 MiB handles; the allocation covers four whole, 4096 bytes of
    // the fifth, which stays as it was.
    assert_eq!(
        report.offered_bytes + report.kept_bytes,
        (LAYER + 4096) as u64
    );
    assert!(report.offered_bytes >= LAYER as u64);
    assert_eq!(read(&device, ptr, LAYER), pattern(9, LAYER + 4096)[..LAYER]);
    let err = unsafe { device.copy_to_device(ptr, [1u8; 8].as_ptr(), 8, Stream::DEFAULT) };
    assert!(err.is_err(), "a write to shared memory must be refused");
    // Errors of the call itself.
    assert_eq!(
        pool.share_read_only(ptr + (64 << 20), 8)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidPointer
    );
    assert_eq!(
        pool.share_read_only(ptr, LAYER + 8192).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    // Marking again changes nothing.
    let again = pool.share_read_only(ptr, LAYER + 4096).unwrap();
    assert_eq!((again.shared_bytes, again.offered_bytes), (0, 0));
    pool.free(ptr).unwrap();
    // The freed memory is never handed out again (a write would reach other processes), not
    // even to a request of the very size it was...
    for size in [LAYER + 4096, LAYER] {
        let other = pool.malloc(size, Stream::DEFAULT).unwrap();
        assert!(other < ptr || other >= ptr + (LAYER + 4096) as u64);
        pool.free(other).unwrap();
    }
    pool.check_invariants().unwrap();
    // ...and goes back to the device with the cache.
    pool.empty_cache().unwrap();
    assert_eq!(host.created_bytes(), 0);
    assert_eq!(pool.stats().offered_bytes, 0);
}

#[test]
fn many_ranges_at_once_each_run_once() {
    let (host, device, pool) = sharing_host_pool("many");
    let ptr = pool.malloc(LAYER, Stream::DEFAULT).unwrap();
    let bytes = pattern(4, LAYER);
    write(&device, ptr, &bytes);
    let half = (LAYER / 2) as u64;
    // Two halves of one segment (two runs: the second's chunks move once the first is one
    // chunk), one of them twice, and an overlapping range.
    let ranges = [
        (ptr, LAYER / 2),
        (ptr + half, LAYER / 2),
        (ptr + half, LAYER / 2),
        (ptr, LAYER),
    ];
    let report = pool.share_read_only_many(&ranges).unwrap();
    assert_eq!(report.offered_bytes, LAYER as u64);
    let snapshot = pool.snapshot();
    assert_eq!(snapshot.segments[0].chunk_sizes, vec![LAYER / 2; 2]);
    assert_eq!(snapshot.stats.offered_bytes, LAYER as i64);
    assert!(snapshot
        .to_json()
        .contains(&format!("\"glake.offered_bytes\":{LAYER}")));
    assert_eq!(read(&device, ptr, LAYER), bytes);
    assert_eq!(
        pool.share_read_only_many(&[(ptr, 8), (1, 8)])
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidPointer
    );
    pool.free(ptr).unwrap();
    pool.empty_cache().unwrap();
    assert_eq!(host.created_bytes(), 0);
}

#[test]
fn the_device_comparison_finds_one_differing_byte() {
    let device = common::device();
    let g = device.granularity();
    let pool = Pool::new(device.clone(), Config::default()).unwrap();
    let a = pool.malloc(4 * g, Stream::DEFAULT).unwrap();
    let b = pool.malloc(4 * g, Stream::DEFAULT).unwrap();
    let mut bytes = pattern(3, 4 * g);
    write(&device, a, &bytes);
    write(&device, b, &bytes);
    match device.equal_bytes(a, b, 4 * g, Stream::DEFAULT) {
        Err(err) if err.kind() == ErrorKind::Unsupported => return, // compared through the host
        other => assert!(other.unwrap()),
    }
    for at in [0, 4 * g - 1, 2 * g + 5] {
        bytes[at] ^= 1;
        write(&device, b, &bytes);
        assert!(
            !device.equal_bytes(a, b, 4 * g, Stream::DEFAULT).unwrap(),
            "byte {at}"
        );
        bytes[at] ^= 1;
    }
    write(&device, b, &bytes);
    assert!(device
        .equal_bytes(a + 8, b + 8, 4 * g - 8, Stream::DEFAULT)
        .unwrap());
    assert_eq!(
        device
            .equal_bytes(a, b, 12, Stream::DEFAULT)
            .unwrap_err()
            .kind(),
        ErrorKind::Unsupported
    );
    pool.free(a).unwrap();
    pool.free(b).unwrap();
}

/// One share of two layers, one another process offers (the join path) and one nobody does
/// (the offer path), with call `nth` of `kind` failing (None: no failure). Whatever fails, the
/// bytes stay as written, the books stay sound and nothing is left behind. Returns the calls
/// of each kind the share made.
fn share_with_failure(
    dir: &Path,
    failure: Option<(glake::device::CallKind, u64)>,
    then: Option<u64>,
) -> (Vec<u64>, Arc<glake::device::fault::FaultDevice>) {
    use glake::device::fault::FaultDevice;
    use glake::device::CallKind;
    let options = HostOptions {
        device_count: 2,
        ..HostOptions::default()
    };
    let host = Arc::new(HostDevice::new(0, options).unwrap());
    let bytes: SharedDevice = host.clone();
    let fault = Arc::new(FaultDevice::new(bytes.clone()));
    let device: SharedDevice = fault.clone();
    let config = Config {
        dedup_dir: Some(dir.to_path_buf()),
        ..Config::default()
    };
    let pool = Pool::new(device, config).unwrap();
    let joined = pool.malloc(LAYER, Stream::DEFAULT).unwrap();
    let offered = pool.malloc(LAYER, Stream::DEFAULT).unwrap();
    write(&bytes, joined, &pattern(1, LAYER));
    write(&bytes, offered, &pattern(2, LAYER));
    let before: Vec<u64> = CallKind::ALL.iter().map(|&k| fault.calls(k)).collect();
    if let Some((kind, nth)) = failure {
        fault.fail_nth(kind, nth);
    }
    if let Some(j) = then {
        fault.fail_after_failure(j);
    }
    let result = pool.share_read_only_many(&[(joined, LAYER), (offered, LAYER)]);
    // A peer granted access afterwards sees the shared memory read-only.
    let peer = pool.enable_peer_access(1);
    let calls = CallKind::ALL
        .iter()
        .zip(before)
        .map(|(&k, b)| fault.calls(k) - b)
        .collect();
    fault.clear();
    if failure.is_none() {
        assert!(peer.is_ok(), "{peer:?}");
        let report = result.unwrap();
        assert_eq!(
            (report.shared_bytes, report.offered_bytes),
            (LAYER as u64, LAYER as u64)
        );
    }
    let what = format!("{failure:?}, then call {then:?} after it");
    if peer.is_err() {
        pool.enable_peer_access(1)
            .unwrap_or_else(|e| panic!("{what}: peer access after the fault: {e}"));
    }
    assert_eq!(read(&bytes, joined, LAYER), pattern(1, LAYER), "{what}");
    assert_eq!(read(&bytes, offered, LAYER), pattern(2, LAYER), "{what}");
    pool.check_invariants().expect(&what);
    pool.free(joined).unwrap();
    pool.free(offered).unwrap();
    pool.empty_cache().unwrap();
    drop(pool);
    assert_eq!(host.live_objects(), (0, 0, 0), "{what}");
    assert_eq!(
        (host.created_bytes(), host.imported_bytes()),
        (0, 0),
        "{what}"
    );
    (calls, fault)
}

#[test]
fn every_failed_driver_call_while_sharing_loses_nothing() {
    if common::backend_is_cuda() {
        return; // the sweep needs the host backend's leak counts
    }
    let dir = meeting("faults");
    let mut offerer = Replica::start(&dir, &[1], &[]);
    offerer.marked();
    let (clean, _) = share_with_failure(&dir, None, None);
    let mut swept = common::sites::Swept::new("dedup");
    let mut injected = 0;
    for (&kind, &calls) in glake::device::CallKind::ALL.iter().zip(&clean) {
        for nth in 1..=calls {
            let (_, fault) = share_with_failure(&dir, Some((kind, nth)), None);
            assert_eq!(fault.injected(), 1, "{kind:?} #{nth} did not fire");
            swept.add(&fault);
            injected += 1;
            // The clean-up of the failure failing too: each of the two calls after it.
            for then in 1..=fault.calls_after_failure().len().min(2) as u64 {
                let (_, fault) = share_with_failure(&dir, Some((kind, nth)), Some(then));
                assert_eq!(
                    fault.injected(),
                    2,
                    "{kind:?} #{nth}, then call {then} after it"
                );
                swept.add(&fault);
            }
        }
    }
    assert!(injected > 20, "only {injected} calls were swept");
    swept.assert_covers(None);
    assert!(offerer.weights_intact());
    offerer.finish();
}
