//! Trace replay: drives a real [`Pool`](glake::Pool) with allocation traces recorded from
//! PyTorch, to measure what stitching buys (memory utilisation) and what it costs (allocator
//! CPU time) on real workloads, without needing a GPU.
//!
//! [`parse`] reads traces (text, gzip or PyTorch snapshot pickles) into a [`Trace`];
//! [`replay()`] runs one through a pool; [`TimedDevice`] separates driver time from allocator
//! time; [`configs`] names the configurations to compare; [`report`] prints tables and JSON;
//! [`waste`] sorts the memory reserved at the peak beyond the live bytes by why it is idle.

pub mod budget;
pub mod cli;
pub mod configs;
pub mod parse;
pub mod pickle;
pub mod replay;
pub mod report;
pub mod timed;
pub mod waste;

use std::collections::HashMap;
use std::fmt;

pub use configs::NamedConfig;
pub use parse::{load, read_trace};
pub use replay::{replay, Backend, MarkSample, ReplayOptions, ReplayResult};
pub use timed::{timed, TimedDevice};
pub use waste::{waste_at, Moment, Waste};

/// Why a trace could not be read or replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceError {
    message: String,
}

impl TraceError {
    pub fn new(message: impl Into<String>) -> Self {
        TraceError {
            message: message.into(),
        }
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error with `context: ` put in front.
    pub fn context(self, context: impl fmt::Display) -> Self {
        TraceError::new(format!("{context}: {}", self.message))
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for TraceError {}

impl From<std::io::Error> for TraceError {
    fn from(err: std::io::Error) -> Self {
        TraceError::new(err.to_string())
    }
}

impl From<glake::Error> for TraceError {
    fn from(err: glake::Error) -> Self {
        TraceError::new(err.to_string())
    }
}

pub type Result<T> = std::result::Result<T, TraceError>;

/// PyTorch's trace actions (`torch.cuda.memory._snapshot()['device_traces']`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    /// Expandable segments grow by mapping: counted like a segment allocation.
    SegmentMap,
    SegmentUnmap,
    /// Anything else (`oom`, `snapshot`, ...): ignored.
    Other,
}

impl Action {
    pub fn parse(name: &str) -> Action {
        match name {
            "alloc" => Action::Alloc,
            "free_requested" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            _ => Action::Other,
        }
    }
}

/// One operation to replay. `id` numbers the trace's allocations from 0, so that the replay can
/// keep its pointers in a plain vector; `stream` indexes [`Trace::streams`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Alloc { id: u32, size: u64, stream: u32 },
    Free { id: u32 },
}

/// A named point of a trace (a comment line of the text format, such as `# measured step 3`
/// that `bench/swap_bench.py` writes), `at` operations from its start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    pub at: usize,
    pub label: String,
}

/// A trace ready to replay, with what the trace itself says about memory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    /// File name, for reports.
    pub name: String,
    pub ops: Vec<Op>,
    /// The trace's distinct stream values, in order of first use.
    pub streams: Vec<u64>,
    pub allocs: usize,
    pub frees: usize,
    /// Frees of allocations made before recording started (not replayed).
    pub skipped_frees: usize,
    /// Allocations of 0 bytes (not replayed; PyTorch hands out no memory for them).
    pub zero_size_allocs: usize,
    /// Allocations at an address that was still live: the earlier one is treated as freed.
    pub duplicate_allocs: usize,
    /// Events with other actions (free_requested, oom, snapshot, ...).
    pub ignored_events: usize,
    /// Peak of the sum of requested sizes of live allocations.
    pub peak_live_bytes: u64,
    /// Peak of the running sum of segment allocations minus frees: what the native allocator
    /// reserved beyond what it held when recording started.
    pub native_peak_reserved_bytes: u64,
    /// Whether the trace had any segment events at all.
    pub has_segments: bool,
    /// Native reserved bytes after each change: (number of ops before the change, bytes).
    pub native_steps: Vec<(usize, u64)>,
    /// Named points, in order.
    pub marks: Vec<Mark>,
}

impl Trace {
    /// The name without directories and trace extensions, for file names.
    pub fn stem(&self) -> String {
        let mut stem = self.name.as_str();
        for ext in [".gz", ".txt", ".pickle", ".pkl"] {
            if let Some(s) = stem.strip_suffix(ext) {
                stem = s;
            }
        }
        stem.to_string()
    }
}

/// Turns a stream of trace events into a [`Trace`]: numbers allocations, drops frees of unknown
/// allocations, and keeps the trace's own live and segment accounting.
#[derive(Debug, Default)]
pub struct TraceBuilder {
    trace: Trace,
    live: HashMap<u64, (u32, u64)>,
    streams: HashMap<u64, u32>,
    live_bytes: u64,
    native: i64,
    native_peak: i64,
}

impl TraceBuilder {
    pub fn new(name: impl Into<String>) -> Self {
        TraceBuilder {
            trace: Trace {
                name: name.into(),
                ..Trace::default()
            },
            ..TraceBuilder::default()
        }
    }

    pub fn push(&mut self, action: Action, addr: u64, size: u64, stream: u64) -> Result<()> {
        match action {
            Action::Alloc => self.alloc(addr, size, stream)?,
            Action::FreeCompleted => self.free(addr),
            Action::SegmentAlloc | Action::SegmentMap => self.segment(size as i64),
            Action::SegmentFree | Action::SegmentUnmap => self.segment(-(size as i64)),
            Action::FreeRequested | Action::Other => self.trace.ignored_events += 1,
        }
        Ok(())
    }

    fn alloc(&mut self, addr: u64, size: u64, stream: u64) -> Result<()> {
        if size == 0 {
            self.trace.zero_size_allocs += 1;
            return Ok(());
        }
        if self.live.contains_key(&addr) {
            self.trace.duplicate_allocs += 1;
            self.free(addr);
        }
        let id = u32::try_from(self.trace.allocs)
            .map_err(|_| TraceError::new("more than 2^32 allocations in one trace"))?;
        let next_stream = self.streams.len() as u32;
        let stream_index = *self.streams.entry(stream).or_insert_with(|| {
            self.trace.streams.push(stream);
            next_stream
        });
        self.trace.allocs += 1;
        self.trace.ops.push(Op::Alloc {
            id,
            size,
            stream: stream_index,
        });
        self.live.insert(addr, (id, size));
        self.live_bytes += size;
        self.trace.peak_live_bytes = self.trace.peak_live_bytes.max(self.live_bytes);
        Ok(())
    }

    fn free(&mut self, addr: u64) {
        match self.live.remove(&addr) {
            Some((id, size)) => {
                self.trace.frees += 1;
                self.trace.ops.push(Op::Free { id });
                self.live_bytes -= size;
            }
            None => self.trace.skipped_frees += 1,
        }
    }

    fn segment(&mut self, delta: i64) {
        self.trace.has_segments = true;
        // A segment freed that was made before recording can take the sum below zero; the
        // figure is relative to the start of the recording either way.
        self.native += delta;
        self.native_peak = self.native_peak.max(self.native);
        self.trace
            .native_steps
            .push((self.trace.ops.len(), self.native.max(0) as u64));
    }

    /// Names the point after the operations pushed so far.
    pub fn mark(&mut self, label: impl Into<String>) {
        let at = self.trace.ops.len();
        self.trace.marks.push(Mark {
            at,
            label: label.into(),
        });
    }

    pub fn finish(mut self) -> Trace {
        self.trace.native_peak_reserved_bytes = self.native_peak.max(0) as u64;
        self.trace
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_numbers_allocations_and_tracks_live_bytes() {
        let mut b = TraceBuilder::new("t.txt.gz");
        b.push(Action::Alloc, 10, 100, 0).unwrap();
        b.push(Action::Alloc, 20, 50, 7).unwrap();
        b.push(Action::FreeRequested, 10, 100, 0).unwrap();
        b.push(Action::FreeCompleted, 10, 100, 0).unwrap();
        b.push(Action::FreeCompleted, 99, 8, 0).unwrap();
        b.push(Action::Alloc, 10, 30, 7).unwrap();
        b.push(Action::Alloc, 30, 0, 0).unwrap();
        let t = b.finish();
        assert_eq!(
            t.ops,
            vec![
                Op::Alloc {
                    id: 0,
                    size: 100,
                    stream: 0
                },
                Op::Alloc {
                    id: 1,
                    size: 50,
                    stream: 1
                },
                Op::Free { id: 0 },
                Op::Alloc {
                    id: 2,
                    size: 30,
                    stream: 1
                },
            ]
        );
        assert_eq!(t.streams, vec![0, 7]);
        assert_eq!((t.allocs, t.frees, t.skipped_frees), (3, 1, 1));
        assert_eq!((t.zero_size_allocs, t.ignored_events), (1, 1));
        assert_eq!(t.peak_live_bytes, 150);
        assert_eq!(t.stem(), "t");
    }

    #[test]
    fn duplicate_alloc_frees_the_earlier_one() {
        let mut b = TraceBuilder::new("t");
        b.push(Action::Alloc, 10, 100, 0).unwrap();
        b.push(Action::Alloc, 10, 40, 0).unwrap();
        let t = b.finish();
        assert_eq!(t.duplicate_allocs, 1);
        assert_eq!(t.ops[1], Op::Free { id: 0 });
        assert_eq!(t.peak_live_bytes, 100);
    }

    #[test]
    fn segments_give_the_native_peak() {
        let mut b = TraceBuilder::new("t");
        b.push(Action::SegmentAlloc, 1, 20, 0).unwrap();
        b.push(Action::Alloc, 1, 4, 0).unwrap();
        b.push(Action::SegmentAlloc, 2, 10, 0).unwrap();
        b.push(Action::SegmentFree, 1, 20, 0).unwrap();
        b.push(Action::SegmentMap, 3, 5, 0).unwrap();
        let t = b.finish();
        assert!(t.has_segments);
        assert_eq!(t.native_peak_reserved_bytes, 30);
        assert_eq!(t.native_steps, vec![(0, 20), (1, 30), (1, 10), (1, 15)]);
    }
}
