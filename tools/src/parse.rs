//! Reading traces. The format is found from the bytes, not the file name: gzip by its magic
//! number, a pickle by its protocol opcode (0x80, protocol 2 and later), text otherwise.
//!
//! Text: one event per line, `action addr size stream`, oldest first; `#` starts a comment line,
//! which names the point it stands at (a [`Mark`](crate::Mark)) unless it is that column header.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use flate2::bufread::MultiGzDecoder;

use super::{pickle, Action, Result, Trace, TraceBuilder, TraceError};

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
const PICKLE_PROTO: u8 = 0x80;

/// The column header of the text format (a comment, not a mark).
const HEADER: &str = "action addr size stream";

/// Reads the trace at `path`; for a snapshot pickle, the trace of device `device`.
pub fn load(path: &Path, device: usize) -> Result<Trace> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let file = File::open(path).map_err(|e| TraceError::new(format!("{}: {e}", path.display())))?;
    read_trace(BufReader::new(file), &name, device)
        .map_err(|e| e.context(path.display().to_string()))
}

/// Reads a trace from any reader (gzip, pickle and text detected from the first bytes).
pub fn read_trace<R: BufRead>(mut reader: R, name: &str, device: usize) -> Result<Trace> {
    if reader.fill_buf()?.starts_with(&GZIP_MAGIC) {
        return read_decoded(BufReader::new(MultiGzDecoder::new(reader)), name, device);
    }
    read_decoded(reader, name, device)
}

fn read_decoded<R: BufRead>(mut reader: R, name: &str, device: usize) -> Result<Trace> {
    if reader.fill_buf()?.first() == Some(&PICKLE_PROTO) {
        return pickle::read_snapshot(reader, name, device);
    }
    read_text(reader, name)
}

/// Reads the text format.
pub fn read_text<R: BufRead>(reader: R, name: &str) -> Result<Trace> {
    let mut builder = TraceBuilder::new(name);
    for (index, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| TraceError::new(format!("line {}: {e}", index + 1)))?;
        let line = line.trim();
        if let Some(comment) = line.strip_prefix('#') {
            // Every comment but the column header names a point of the trace.
            let label = comment.trim();
            if !label.is_empty() && label != HEADER {
                builder.mark(label);
            }
            continue;
        }
        if line.is_empty() {
            continue;
        }
        let bad = |what: &str| TraceError::new(format!("line {}: {what}: {line:?}", index + 1));
        let mut fields = line.split_ascii_whitespace();
        let (Some(action), Some(addr), Some(size), Some(stream), None) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            return Err(bad("expected `action addr size stream`"));
        };
        let number = |text: &str, what: &str| -> Result<u64> {
            text.parse::<u64>()
                .map_err(|_| bad(&format!("{what} is not a non-negative integer")))
        };
        builder.push(
            Action::parse(action),
            number(addr, "addr")?,
            number(size, "size")?,
            number(stream, "stream")?,
        )?;
    }
    Ok(builder.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Op;
    use std::io::Write;

    const TEXT: &str = "# action addr size stream\n\
        alloc 4096 1000 0\n\
        \n\
        segment_alloc 8192 2097152 0\n\
        alloc 8192 3000000 5\n\
        free_requested 4096 1000 0\n\
        free_completed 4096 1000 0\n\
        free_completed 123 77 0\n\
        segment_free 8192 2097152 0\n\
        free_completed 8192 3000000 5\n";

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    }

    fn check(t: &Trace) {
        assert_eq!(t.allocs, 2);
        assert_eq!(t.frees, 2);
        assert_eq!(t.skipped_frees, 1);
        assert_eq!(t.ignored_events, 1);
        assert_eq!(t.streams, vec![0, 5]);
        assert_eq!(t.peak_live_bytes, 3_001_000);
        assert_eq!(t.native_peak_reserved_bytes, 2_097_152);
        assert_eq!(t.ops.len(), 4);
        assert_eq!(t.ops[2], Op::Free { id: 0 });
    }

    #[test]
    fn comments_but_the_header_are_marks_where_they_stand() {
        let text = "# action addr size stream\n# before anything\nalloc 1 1000 0\n\
                    #   measured step 0  \nalloc 2 1000 0\nfree_completed 1 1000 0\n#\n";
        let t = read_trace(text.as_bytes(), "m", 0).unwrap();
        let marks: Vec<(usize, &str)> = t.marks.iter().map(|m| (m.at, m.label.as_str())).collect();
        assert_eq!(marks, [(0, "before anything"), (1, "measured step 0")]);
        assert_eq!(t.ops.len(), 3);
    }

    #[test]
    fn plain_text() {
        let t = read_trace(TEXT.as_bytes(), "x.txt", 0).unwrap();
        check(&t);
    }

    #[test]
    fn gzip_text_is_detected_by_magic() {
        let t = read_trace(&gzip(TEXT.as_bytes())[..], "x.txt.gz", 0).unwrap();
        check(&t);
    }

    #[test]
    fn bad_lines_name_the_line() {
        let err = read_trace("alloc 1 2\n".as_bytes(), "x", 0).unwrap_err();
        assert!(err.message().contains("line 1"), "{err}");
        let err = read_trace("# c\nalloc 1 -2 0\n".as_bytes(), "x", 0).unwrap_err();
        assert!(err.message().contains("line 2"), "{err}");
        let err = read_trace("alloc 1 2 0 9\n".as_bytes(), "x", 0).unwrap_err();
        assert!(err.message().contains("expected"), "{err}");
    }

    #[test]
    fn unknown_actions_are_ignored() {
        let t = read_trace("oom 0 10 0\nsnapshot 0 0 0\n".as_bytes(), "x", 0).unwrap();
        assert_eq!(t.ignored_events, 2);
        assert!(t.ops.is_empty());
    }
}
