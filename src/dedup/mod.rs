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
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::Result;
use channel::Fetched;
use index::{Index, Record};

/// One pool's way into the index of its device and to the other processes.
#[derive(Debug)]
pub struct Sharing {
    dir: PathBuf,
    index: Index,
    /// This process's name in the index (`channel::process_token`).
    owner: u64,
    /// The device's totals and when they were read (statistics ask often; the index is a file).
    totals: Mutex<Option<(Instant, DeviceTotals)>>,
}

/// What all processes share on one device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceTotals {
    /// Bytes mapped by two or more processes, each counted once.
    pub shared_bytes: u64,
    /// Bytes the device would hold more without sharing.
    pub saved_bytes: u64,
}

/// How long device totals are reused before the index is read again.
const TOTALS_AGE: Duration = Duration::from_secs(1);

impl Sharing {
    /// Opens the index of the device named `identity` in the directory of `configured` (see
    /// [`index::directory`]).
    pub fn open(configured: Option<&Path>, identity: &str) -> Result<Sharing> {
        let dir = index::directory(configured)?;
        let index = Index::open(&dir, identity)?;
        channel::remove_stale_sockets(&dir);
        Ok(Sharing {
            dir,
            index,
            owner: channel::process_token(),
            totals: Mutex::new(None),
        })
    }

    /// What all processes share on this device, from the index (read at most once a second);
    /// zero when it cannot be read.
    pub fn device_totals(&self) -> DeviceTotals {
        let mut cached = crate::sync::lock(&self.totals);
        if let Some((at, totals)) = *cached {
            if at.elapsed() < TOTALS_AGE {
                return totals;
            }
        }
        // Processes mapping each physical copy (one origin), those gone left out: a killed
        // process's records stay until someone finds its socket gone.
        let mut holders: HashMap<(u64, u64), u64> = HashMap::new();
        let mut alive: HashMap<u64, bool> = HashMap::new();
        for record in self.index.records().unwrap_or_default() {
            let serving = *alive
                .entry(record.owner)
                .or_insert_with(|| channel::serves(&self.dir, record.owner));
            if serving {
                *holders.entry((record.origin, record.len)).or_default() += 1;
            }
        }
        let mut totals = DeviceTotals::default();
        for (&(_, len), &n) in holders.iter().filter(|(_, &n)| n > 1) {
            totals.shared_bytes += len;
            totals.saved_bytes += len * (n - 1);
        }
        *cached = Some((Instant::now(), totals));
        totals
    }

    /// Other processes' offers of `len` bytes hashing to `hash`, read from the index now.
    pub fn offers_now(&self, hash: u128, len: usize) -> Result<Vec<Record>> {
        self.index.candidates(hash, len as u64, self.owner)
    }

    /// Every offer of other processes, by (hash, length), oldest first: one read of the
    /// index for a whole batch of lookups.
    pub fn offer_book(&self) -> Result<HashMap<(u128, u64), Vec<Record>>> {
        let mut book: HashMap<(u128, u64), Vec<Record>> = HashMap::new();
        for record in self.index.records()? {
            if record.owner != self.owner {
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
        match channel::fetch(&self.dir, offer.owner, offer.export)? {
            Fetched::Memory(fd, len) if len == offer.len => Ok(Some(fd)),
            Fetched::Memory(..) => Ok(None),
            Fetched::ProcessGone => {
                self.index.withdraw_process(offer.owner)?;
                Ok(None)
            }
            Fetched::ExportGone => {
                self.index.withdraw(offer.owner, offer.export)?;
                Ok(None)
            }
        }
    }

    /// Serves `fd` (`len` bytes hashing to `hash`) to other processes, a copy of the memory
    /// first offered as `origin` (None: a first offer); returns the record for
    /// [`Sharing::publish`], which makes it known.
    pub fn serve(
        &self,
        hash: u128,
        len: usize,
        fd: OwnedFd,
        origin: Option<u64>,
    ) -> Result<Record> {
        let export = channel::serve(&self.dir, fd, len as u64)?;
        Ok(Record {
            hash,
            len: len as u64,
            owner: self.owner,
            export,
            origin: origin.unwrap_or_else(|| channel::new_origin(export)),
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
        if let Err(err) = self.index.withdraw(self.owner, export) {
            log::warn!("glake: dedup: {err}");
        }
    }
}
