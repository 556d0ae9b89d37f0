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

use std::collections::HashMap;
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

    /// Every offer of other processes, by (hash, length), oldest first: one read of the
    /// index for a whole batch of lookups.
    pub fn offer_book(&self) -> Result<HashMap<(u128, u64), Vec<Record>>> {
        let mut book: HashMap<(u128, u64), Vec<Record>> = HashMap::new();
        for record in self.index.records()? {
            if record.pid != self.pid {
                book.entry((record.hash, record.len))
                    .or_default()
                    .push(record);
            }
        }
        Ok(book)
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

    /// Serves `fd` (`len` bytes hashing to `hash`) to other processes; returns the record
    /// for [`Sharing::publish`], which makes it known.
    pub fn serve(&self, hash: u128, len: usize, fd: OwnedFd) -> Result<Record> {
        let export = channel::serve(&self.dir, fd, len as u64)?;
        Ok(Record {
            hash,
            len: len as u64,
            pid: self.pid,
            export,
        })
    }

    /// Makes `records` (from [`Sharing::serve`]) known to other processes, in one write of the
    /// index; on failure they stop being served.
    pub fn publish(&self, records: &[Record]) -> Result<()> {
        let published = self.index.publish_all(records);
        if published.is_err() {
            for record in records {
                channel::unserve(record.export);
            }
        }
        published
    }

    /// Stops serving `export` (its memory is released here).
    pub fn withdraw(&self, export: u64) {
        channel::unserve(export);
        if let Err(err) = self.index.withdraw(self.pid, export) {
            log::warn!("glake: dedup: {err}");
        }
    }
}
