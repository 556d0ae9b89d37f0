//! The index of shared memory of one device, common to every process of one user: a text file
//! in the user's private directory, read and replaced (a new file renamed over it, so a process
//! killed mid-write leaves the old one whole) under an exclusive `flock` of a lock file beside
//! it. Each record says that the process named `owner` serves, under its number `export`, `len`
//! bytes whose contents hash to `hash`, a copy of the memory first offered as `origin`. A
//! process that dies leaves its records behind: they are dropped by whoever finds its socket
//! gone. Processes are named by a random number, not their pid: pids are reused, and differ
//! between pid namespaces that may share the directory.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};

/// The first line of an index file; another first line means a file this version cannot read.
const HEADER: &str = "glake-dedup-index 2";

/// Memory a process serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub hash: u128,
    pub len: u64,
    /// The serving process's name (see `channel::process_token`).
    pub owner: u64,
    pub export: u64,
    /// The first offer of this memory: every process mapping one physical copy serves it
    /// under the same origin, so copies made independently are told apart.
    pub origin: u64,
}

/// The directory where processes of this user meet: `configured`, else
/// `$XDG_RUNTIME_DIR/glake`, else `/tmp/glake-<uid>`. Made private (0700) when missing; one
/// that another user owns or others may enter is refused, since descriptors of device memory
/// are handed to whoever connects there.
pub fn directory(configured: Option<&Path>) -> Result<PathBuf> {
    // SAFETY: geteuid has no failure mode.
    let uid = unsafe { libc::geteuid() };
    let dir = match configured {
        Some(dir) => dir.to_path_buf(),
        None => match std::env::var_os("XDG_RUNTIME_DIR") {
            Some(runtime) if !runtime.is_empty() => Path::new(&runtime).join("glake"),
            _ => PathBuf::from(format!("/tmp/glake-{uid}")),
        },
    };
    if let Err(err) = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
    {
        return Err(unusable(&dir, &err.to_string()));
    }
    let meta = std::fs::symlink_metadata(&dir).map_err(|e| unusable(&dir, &e.to_string()))?;
    if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
        return Err(unusable(
            &dir,
            &format!(
                "it must be a directory of user {uid} that no one else may enter (mode {:o})",
                meta.mode() & 0o7777
            ),
        ));
    }
    Ok(dir)
}

fn unusable(dir: &Path, why: &str) -> Error {
    Error::new(
        ErrorKind::InvalidState,
        format!("dedup directory {}: {why}", dir.display()),
    )
}

/// One device's index file.
#[derive(Debug)]
pub struct Index {
    path: PathBuf,
    /// Held open for its `flock`, which guards every read and replacement of `path`.
    lock: File,
}

impl Index {
    /// Opens (creating when missing) the index of the device named `identity` in `dir`.
    pub fn open(dir: &Path, identity: &str) -> Result<Index> {
        if identity.is_empty()
            || !identity
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-')
        {
            return Err(Error::invalid_argument(format!(
                "device identity {identity:?} cannot name an index file"
            )));
        }
        let path = dir.join(format!("{identity}.index"));
        let lock_path = dir.join(format!("{identity}.lock"));
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|e| Error::driver(format!("dedup lock {}: {e}", lock_path.display())))?;
        Ok(Index { path, lock })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `change` on the records under the file's lock; writes them back when it says so.
    fn locked<T>(&self, change: impl FnOnce(&mut Vec<Record>) -> (T, bool)) -> Result<T> {
        let _lock = FileLock::exclusive(&self.lock, &self.path)?;
        let mut records = self.read()?;
        let (out, changed) = change(&mut records);
        if changed {
            self.write(&records)?;
        }
        Ok(out)
    }

    fn read(&self) -> Result<Vec<Record>> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(err) => return Err(self.unreadable(&err.to_string())),
        };
        parse(&text).map_err(|why| self.unreadable(&why))
    }

    fn write(&self, records: &[Record]) -> Result<()> {
        let mut text = String::with_capacity(64 * (records.len() + 1));
        text.push_str(HEADER);
        text.push('\n');
        for r in records {
            text.push_str(&format!(
                "{:032x} {} {:016x} {} {:016x}\n",
                r.hash, r.len, r.owner, r.export, r.origin
            ));
        }
        // A new file renamed over the old: readers never see half of one.
        let fresh = self
            .path
            .with_extension(format!("index.{}", std::process::id()));
        let written = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&fresh)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .and_then(|()| std::fs::rename(&fresh, &self.path));
        if let Err(err) = written {
            let _ = std::fs::remove_file(&fresh);
            return Err(Error::driver(format!(
                "dedup index {}: {err}",
                self.path.display()
            )));
        }
        Ok(())
    }

    fn unreadable(&self, why: &str) -> Error {
        Error::new(
            ErrorKind::InvalidState,
            format!(
                "dedup index {} is unreadable ({why}); nothing is shared until it is removed",
                self.path.display()
            ),
        )
    }

    /// Records of memory of `len` bytes hashing to `hash`, served by processes other than
    /// `owner`, oldest first.
    pub fn candidates(&self, hash: u128, len: u64, owner: u64) -> Result<Vec<Record>> {
        self.locked(|records| {
            let found = records
                .iter()
                .filter(|r| r.hash == hash && r.len == len && r.owner != owner)
                .copied()
                .collect();
            (found, false)
        })
    }

    pub fn publish(&self, record: Record) -> Result<()> {
        self.publish_all(&[record])
    }

    /// Adds `new` in one rewrite of the file.
    pub fn publish_all(&self, new: &[Record]) -> Result<()> {
        if new.is_empty() {
            return Ok(());
        }
        self.locked(|records| {
            records.extend_from_slice(new);
            ((), true)
        })
    }

    /// Drops the record of `owner`'s export `export`.
    pub fn withdraw(&self, owner: u64, export: u64) -> Result<()> {
        self.withdraw_where(|r| r.owner == owner && r.export == export)
    }

    /// Drops every record of `owner` (a process found gone).
    pub fn withdraw_process(&self, owner: u64) -> Result<()> {
        self.withdraw_where(|r| r.owner == owner)
    }

    fn withdraw_where(&self, gone: impl Fn(&Record) -> bool) -> Result<()> {
        self.locked(|records| {
            let before = records.len();
            records.retain(|r| !gone(r));
            ((), records.len() != before)
        })
    }

    /// Every record (statistics and tests).
    pub fn records(&self) -> Result<Vec<Record>> {
        self.locked(|records| (records.clone(), false))
    }
}

fn parse(text: &str) -> std::result::Result<Vec<Record>, String> {
    let mut lines = text.lines();
    match lines.next() {
        None => return Ok(Vec::new()),
        Some(HEADER) => {}
        Some(other) => return Err(format!("first line {other:?} is not {HEADER:?}")),
    }
    lines
        .enumerate()
        .map(|(n, line)| {
            let bad = || format!("line {} is malformed: {line:?}", n + 2);
            let mut fields = line.split(' ');
            let mut next = || fields.next().ok_or_else(bad);
            let hash = u128::from_str_radix(next()?, 16).map_err(|_| bad())?;
            let len = next()?.parse().map_err(|_| bad())?;
            let owner = u64::from_str_radix(next()?, 16).map_err(|_| bad())?;
            let export = next()?.parse().map_err(|_| bad())?;
            let origin = u64::from_str_radix(next()?, 16).map_err(|_| bad())?;
            if fields.next().is_some() {
                return Err(bad());
            }
            Ok(Record {
                hash,
                len,
                owner,
                export,
                origin,
            })
        })
        .collect()
}

/// An exclusive `flock` of a file, released on drop.
struct FileLock<'a> {
    file: &'a File,
}

impl<'a> FileLock<'a> {
    fn exclusive(file: &'a File, path: &Path) -> Result<Self> {
        loop {
            // SAFETY: flock on a descriptor the File keeps open.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(FileLock { file });
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::driver(format!(
                    "dedup index {}: flock: {err}",
                    path.display()
                )));
            }
        }
    }
}

impl Drop for FileLock<'_> {
    fn drop(&mut self) {
        // SAFETY: unlocking the descriptor locked in `exclusive`.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "glake-index-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn records_round_trip_and_withdraw() {
        let dir = directory(Some(&scratch())).unwrap();
        let index = Index::open(&dir, "host-0").unwrap();
        let a = Record {
            hash: u128::MAX - 5,
            len: 1 << 21,
            owner: 7,
            export: 1,
            origin: 9,
        };
        let b = Record { owner: 8, ..a };
        index.publish(a).unwrap();
        index.publish(b).unwrap();
        assert_eq!(index.candidates(a.hash, a.len, 7).unwrap(), vec![b]);
        assert_eq!(index.candidates(a.hash, a.len, 9).unwrap(), vec![a, b]);
        assert!(index.candidates(a.hash, 4096, 9).unwrap().is_empty());
        let again = Index::open(&dir, "host-0").unwrap();
        again.withdraw_process(8).unwrap();
        assert_eq!(index.records().unwrap(), vec![a]);
        index.withdraw(7, 1).unwrap();
        assert!(index.records().unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_garbled_index_is_a_clear_error() {
        let dir = directory(Some(&scratch())).unwrap();
        let index = Index::open(&dir, "host-1").unwrap();
        std::fs::write(index.path(), "glake-dedup-index 2\nzz 1 2 3 4\n").unwrap();
        let err = index.candidates(1, 2, 3).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidState);
        assert!(err.message().contains("unreadable"), "{err}");
        std::fs::write(index.path(), "something else\n").unwrap();
        assert!(index
            .publish(Record {
                hash: 1,
                len: 2,
                owner: 3,
                export: 4,
                origin: 3,
            })
            .is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_open_directory_is_refused() {
        let dir = scratch();
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
        let err = directory(Some(&dir)).unwrap_err();
        assert!(err.message().contains("no one else"), "{err}");
        assert!(Index::open(&dir, "../x").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
