//! Cross-process deduplication of read-only device memory: processes of one user that hold the
//! same bytes (replicas of a model's weights) hold them once.
//!
//! A process marks memory read-only; the pool (`pool::dedup`) hashes each run of whole physical
//! handles in it and looks the hash up in the device's [`index`]. A process that serves memory
//! with that hash hands over a descriptor ([`channel`]); the memory is imported, compared byte
//! by byte with the run ([`content`]), and only when equal mapped in the run's place, read-only,
//! the run's own memory released. With no match the run is copied into shareable memory and
//! offered to later processes. The driver counts references to imported memory, so a process
//! that exits or is killed never takes away memory another still maps.

pub mod channel;
pub mod content;
pub mod index;

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use crate::error::Result;
use channel::Fetched;
use index::{Index, Record};

/// One pool's way into the index of its device and to the other processes.
#[derive(Debug)]
pub struct Sharing {
    dir: PathBuf,
    index: Index,
    pid: u32,
}

impl Sharing {
    /// Opens the index of the device named `identity` in the directory of `configured` (see
    /// [`index::directory`]).
    pub fn open(configured: Option<&Path>, identity: &str) -> Result<Sharing> {
        let dir = index::directory(configured)?;
        let index = Index::open(&dir, identity)?;
        Ok(Sharing {
            dir,
            index,
            pid: std::process::id(),
        })
    }

    /// Other processes' offers of `len` bytes hashing to `hash`, oldest first.
    pub fn offers(&self, hash: u128, len: usize) -> Result<Vec<Record>> {
        self.index.candidates(hash, len as u64, self.pid)
    }

    /// The descriptor of `offer`, when its process still serves it; offers found stale leave
    /// the index.
    pub fn fetch(&self, offer: &Record) -> Result<Option<OwnedFd>> {
        match channel::fetch(&self.dir, offer.pid, offer.export)? {
            Fetched::Memory(fd, len) if len == offer.len => Ok(Some(fd)),
            Fetched::Memory(..) => Ok(None),
            Fetched::ProcessGone => {
                self.index.withdraw_process(offer.pid)?;
                Ok(None)
            }
            Fetched::ExportGone => {
                self.index.withdraw(offer.pid, offer.export)?;
                Ok(None)
            }
        }
    }

    /// Serves `fd` (`len` bytes hashing to `hash`) to other processes; returns its export
    /// number.
    pub fn offer(&self, hash: u128, len: usize, fd: OwnedFd) -> Result<u64> {
        let export = channel::serve(&self.dir, fd, len as u64)?;
        let record = Record {
            hash,
            len: len as u64,
            pid: self.pid,
            export,
        };
        if let Err(err) = self.index.publish(record) {
            channel::unserve(export);
            return Err(err);
        }
        Ok(export)
    }

    /// Stops serving `export` (its memory is released here).
    pub fn withdraw(&self, export: u64) {
        channel::unserve(export);
        if let Err(err) = self.index.withdraw(self.pid, export) {
            log::warn!("glake: dedup: {err}");
        }
    }
}
