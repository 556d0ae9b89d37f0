//! A snapshot of a pool: segments with their blocks, and stitched ranges with their pieces.
//! The JSON form follows the shape of PyTorch's `torch.cuda.memory_snapshot()` segments
//! (address, total_size, allocated_size, segment_type, blocks with state) and adds stitching.

use std::collections::HashMap;
use std::fmt::Write;

use super::blocks::{BlockMap, BlockState, PoolKind, Tag};
use super::PrivatePoolId;
use crate::device::DevicePtr;
use crate::stats::MemoryStats;
use crate::stitch::StitchCache;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockUse {
    /// Allocated on its own (PyTorch "active_allocated").
    Allocated,
    /// A piece of a live stitched allocation.
    Stitched,
    /// Freed, waiting for other streams (PyTorch "active_pending_free").
    PendingFree,
    /// Free (PyTorch "inactive").
    Free,
}

impl BlockUse {
    pub fn name(self) -> &'static str {
        match self {
            BlockUse::Allocated => "active_allocated",
            BlockUse::Stitched => "active_stitched",
            BlockUse::PendingFree => "active_pending_free",
            BlockUse::Free => "inactive",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockInfo {
    pub address: DevicePtr,
    pub size: usize,
    /// Bytes the caller asked for (0 when free or a stitched piece).
    pub requested_size: usize,
    pub state: BlockUse,
    /// The stream that may still use it, if any.
    pub stream: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    pub address: DevicePtr,
    pub total_size: usize,
    pub allocated_size: usize,
    pub pool: PoolKind,
    /// The private pool the segment belongs to; None for the shared pool.
    pub private_pool: Option<PrivatePoolId>,
    /// Lengths of the physical handles behind the segment, in address order.
    pub chunk_sizes: Vec<usize>,
    pub blocks: Vec<BlockInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StitchedInfo {
    pub address: DevicePtr,
    pub size: usize,
    pub in_use: bool,
    /// (address in the home segment, length) of each piece, in mapping order.
    pub pieces: Vec<(DevicePtr, usize)>,
    /// Physical handles mapped into the range (one mapping each).
    pub handle_count: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub segments: Vec<SegmentInfo>,
    pub stitched: Vec<StitchedInfo>,
    pub stats: MemoryStats,
    /// Physical bytes the pool may create.
    pub memory_cap: usize,
}

/// Builds a snapshot; `requested` gives the requested bytes of each live plain allocation,
/// `pieces` those of each piece of a live stitched allocation, and `private_of` the private
/// pool of a segment's tag.
pub(super) fn take(
    map: &BlockMap,
    stitch: &StitchCache,
    stats: &MemoryStats,
    cap: usize,
    requested: &HashMap<DevicePtr, usize>,
    pieces: &HashMap<DevicePtr, usize>,
    private_of: impl Fn(Tag) -> Option<PrivatePoolId>,
) -> Snapshot {
    let mut segments: Vec<SegmentInfo> = map
        .segments
        .iter()
        .map(|(id, segment)| {
            let blocks: Vec<BlockInfo> = map
                .segment_blocks(id)
                .map(|b| {
                    let block = &map.blocks[b];
                    let state = match block.state {
                        BlockState::Free => BlockUse::Free,
                        BlockState::Pending => BlockUse::PendingFree,
                        BlockState::Allocated if requested.contains_key(&block.addr) => {
                            BlockUse::Allocated
                        }
                        BlockState::Allocated => BlockUse::Stitched,
                    };
                    BlockInfo {
                        address: block.addr,
                        size: block.size,
                        requested_size: requested
                            .get(&block.addr)
                            .or_else(|| pieces.get(&block.addr))
                            .copied()
                            .unwrap_or(0),
                        state,
                        stream: block.owner.map(|s| s.0),
                    }
                })
                .collect();
            SegmentInfo {
                address: segment.va,
                total_size: segment.size,
                allocated_size: blocks
                    .iter()
                    .filter(|b| b.state != BlockUse::Free)
                    .map(|b| b.size)
                    .sum(),
                pool: segment.pool,
                private_pool: private_of(segment.tag),
                chunk_sizes: segment.chunks().iter().map(|c| c.len).collect(),
                blocks,
            }
        })
        .collect();
    segments.sort_by_key(|s| s.address);
    let mut stitched: Vec<StitchedInfo> = stitch
        .blocks
        .iter()
        .map(|(_, s)| StitchedInfo {
            address: s.va,
            size: s.size,
            in_use: s.in_use,
            pieces: s.pieces.iter().map(|p| (p.addr, p.len)).collect(),
            handle_count: s.pieces.iter().map(|p| p.handles.len()).sum(),
        })
        .collect();
    stitched.sort_by_key(|s| s.address);
    Snapshot {
        segments,
        stitched,
        stats: *stats,
        memory_cap: cap,
    }
}

impl Snapshot {
    /// Bytes in each state, over all segments: (allocated, stitched pieces, pending, free).
    pub fn totals(&self) -> (usize, usize, usize, usize) {
        let mut t = (0, 0, 0, 0);
        for b in self.segments.iter().flat_map(|s| &s.blocks) {
            match b.state {
                BlockUse::Allocated => t.0 += b.size,
                BlockUse::Stitched => t.1 += b.size,
                BlockUse::PendingFree => t.2 += b.size,
                BlockUse::Free => t.3 += b.size,
            }
        }
        t
    }

    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(256 + 128 * self.segments.len());
        out.push_str("{\"segments\":[");
        for (i, s) in self.segments.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let pool = match s.pool {
                PoolKind::Small => "small",
                PoolKind::Large => "large",
            };
            let private = s
                .private_pool
                .map_or("null".to_string(), |(a, b)| format!("[{a},{b}]"));
            let _ = write!(
                out,
                "{{\"address\":{},\"total_size\":{},\"allocated_size\":{},\"segment_type\":\"{pool}\",\"private_pool\":{private},\"chunk_sizes\":{:?},\"blocks\":[",
                s.address, s.total_size, s.allocated_size, s.chunk_sizes
            );
            for (j, b) in s.blocks.iter().enumerate() {
                if j > 0 {
                    out.push(',');
                }
                let stream = b.stream.map_or("null".to_string(), |s| s.to_string());
                let _ = write!(
                    out,
                    "{{\"address\":{},\"size\":{},\"requested_size\":{},\"state\":\"{}\",\"stream\":{stream}}}",
                    b.address,
                    b.size,
                    b.requested_size,
                    b.state.name()
                );
            }
            out.push_str("]}");
        }
        out.push_str("],\"stitched\":[");
        for (i, s) in self.stitched.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let pieces: Vec<String> = s.pieces.iter().map(|(a, l)| format!("[{a},{l}]")).collect();
            let _ = write!(
                out,
                "{{\"address\":{},\"size\":{},\"in_use\":{},\"handles\":{},\"pieces\":[{}]}}",
                s.address,
                s.size,
                s.in_use,
                s.handle_count,
                pieces.join(",")
            );
        }
        let _ = write!(
            out,
            "],\"memory_cap\":{},\"stats\":{}}}",
            self.memory_cap,
            self.stats.to_json()
        );
        out
    }
}
