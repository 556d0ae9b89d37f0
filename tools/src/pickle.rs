//! PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`), read without Python: a pickle
//! of a dict whose `device_traces` holds, per device, the list of trace entries (dicts with
//! `action`, `addr`, `size`, `stream`, and fields this reader does not need).

use std::collections::BTreeMap;
use std::io::Read;

use serde_pickle::{DeOptions, HashableValue, Value};

use super::{Action, Result, Trace, TraceBuilder, TraceError};

/// Reads device `device`'s trace from a snapshot pickle.
pub fn read_snapshot<R: Read>(reader: R, name: &str, device: usize) -> Result<Trace> {
    // Snapshots hold only builtin types; tolerate a stray global rather than fail on it.
    let options = DeOptions::new()
        .replace_unresolved_globals()
        .replace_recursive_structures();
    let value = serde_pickle::value_from_reader(reader, options)
        .map_err(|e| TraceError::new(format!("not a readable pickle: {e}")))?;
    let Value::Dict(top) = value else {
        return Err(TraceError::new(
            "the pickle is not a dict (not a memory snapshot)",
        ));
    };
    let traces = match get(&top, "device_traces") {
        Some(Value::List(traces)) => traces,
        Some(_) => return Err(TraceError::new("`device_traces` is not a list")),
        None => {
            return Err(TraceError::new(
                "the snapshot has no `device_traces`: record with \
                 torch.cuda.memory._record_memory_history() before taking it",
            ))
        }
    };
    let entries = match traces.get(device) {
        Some(Value::List(entries)) => entries,
        Some(_) => {
            return Err(TraceError::new(format!(
                "`device_traces[{device}]` is not a list"
            )))
        }
        None => {
            return Err(TraceError::new(format!(
                "the snapshot has traces of {} device(s); device {device} is not among them",
                traces.len()
            )))
        }
    };
    let mut builder = TraceBuilder::new(name);
    for (index, entry) in entries.iter().enumerate() {
        let Value::Dict(entry) = entry else {
            return Err(TraceError::new(format!(
                "trace entry {index} is not a dict"
            )));
        };
        let action = match get(entry, "action") {
            Some(Value::String(action)) => Action::parse(action),
            _ => {
                return Err(TraceError::new(format!(
                    "trace entry {index} has no action"
                )))
            }
        };
        let field = |key: &str| -> Result<u64> {
            match get(entry, key) {
                Some(value) => as_u64(value).ok_or_else(|| {
                    TraceError::new(format!(
                        "trace entry {index}: `{key}` is not a non-negative integer"
                    ))
                }),
                // Entries such as `snapshot` carry no address or stream.
                None if action == Action::Other => Ok(0),
                None => Err(TraceError::new(format!(
                    "trace entry {index} has no `{key}`"
                ))),
            }
        };
        builder.push(action, field("addr")?, field("size")?, field("stream")?)?;
    }
    Ok(builder.finish())
}

fn get<'a>(dict: &'a BTreeMap<HashableValue, Value>, key: &str) -> Option<&'a Value> {
    dict.get(&HashableValue::String(key.to_string()))
}

fn as_u64(value: &Value) -> Option<u64> {
    match value {
        Value::I64(v) => u64::try_from(*v).ok(),
        // Python ints beyond i64: only addresses could be that large.
        Value::Int(v) => v.to_string().parse().ok(),
        Value::Bool(b) => Some(*b as u64),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{read_trace, Op};
    use serde_pickle::SerOptions;

    fn entry(action: &str, addr: i64, size: i64, stream: i64) -> Value {
        let mut d = BTreeMap::new();
        let key = |k: &str| HashableValue::String(k.to_string());
        d.insert(key("action"), Value::String(action.to_string()));
        d.insert(key("addr"), Value::I64(addr));
        d.insert(key("size"), Value::I64(size));
        d.insert(key("stream"), Value::I64(stream));
        d.insert(key("time_us"), Value::I64(1_700_000_000));
        d.insert(key("frames"), Value::List(vec![]));
        Value::Dict(d)
    }

    fn snapshot(devices: Vec<Vec<Value>>) -> Vec<u8> {
        let mut top = BTreeMap::new();
        top.insert(
            HashableValue::String("segments".to_string()),
            Value::List(vec![]),
        );
        top.insert(
            HashableValue::String("device_traces".to_string()),
            Value::List(devices.into_iter().map(Value::List).collect()),
        );
        serde_pickle::value_to_vec(&Value::Dict(top), SerOptions::new()).unwrap()
    }

    #[test]
    fn reads_a_snapshot_shaped_pickle() {
        let bytes = snapshot(vec![
            vec![entry("alloc", 1, 10, 0)],
            vec![
                entry("segment_alloc", 100, 2 << 20, 0),
                entry("alloc", 100, 4096, 0),
                entry("alloc", 200, 8192, 9),
                entry("free_requested", 100, 4096, 0),
                entry("free_completed", 100, 4096, 0),
                entry("free_completed", 300, 1, 0),
            ],
        ]);
        assert_eq!(bytes[0], 0x80);
        let t = read_trace(&bytes[..], "snap.pickle", 1).unwrap();
        assert_eq!(t.allocs, 2);
        assert_eq!(t.skipped_frees, 1);
        assert_eq!(t.streams, vec![0, 9]);
        assert_eq!(t.peak_live_bytes, 12288);
        assert_eq!(t.native_peak_reserved_bytes, 2 << 20);
        assert_eq!(t.ops[2], Op::Free { id: 0 });
        assert_eq!(t.stem(), "snap");
        let t0 = read_trace(&bytes[..], "snap.pickle", 0).unwrap();
        assert_eq!(t0.allocs, 1);
        let err = read_trace(&bytes[..], "snap.pickle", 2).unwrap_err();
        assert!(err.message().contains("2 device"), "{err}");
    }

    #[test]
    fn rejects_pickles_that_are_not_snapshots() {
        let bytes = serde_pickle::value_to_vec(&Value::List(vec![]), SerOptions::new()).unwrap();
        assert!(read_trace(&bytes[..], "x", 0).is_err());
        let mut top = BTreeMap::new();
        top.insert(
            HashableValue::String("segments".to_string()),
            Value::List(vec![]),
        );
        let bytes = serde_pickle::value_to_vec(&Value::Dict(top), SerOptions::new()).unwrap();
        let err = read_trace(&bytes[..], "x", 0).unwrap_err();
        assert!(err.message().contains("device_traces"), "{err}");
    }
}
