//! The inventory of the library's device call sites (`tests/device_call_sites.txt`) against its
//! source, and the scan that finds them.
//!
//! A device call site is a call of a driver-call method of `Device` (one that `Interposed` runs
//! through its hook with a `CallKind`: `map`, `create_event`, `copy_to_host`, ...) in `src/`
//! outside `src/device/` (the driver module is what is being called). The inventory lists each
//! call once, by file, enclosing function and method (not by line: lines shift), with the test
//! binary whose fault sweep fails it, or `unswept:` and why no sweep can reach it on the host
//! backend. Each sweep checks at its end that it failed every call the inventory gives it (see
//! `common::sites::Swept`); this test checks that the inventory and the source agree, so a
//! new call site cannot go unswept without a line saying so.
//!
//! The scan's rule (exact for this code base, and tested below on small inputs): comments,
//! strings and `#[cfg(test)]` items are skipped; a call is a method call `.name(args)` of a
//! driver-call method `name` with as many arguments as that method takes besides `self`. Names
//! that are unique to `Device` match on any receiver (`device.`, `self.device.`, `peer.`,
//! `pool.device().`, ...); the argument count tells the ambiguous ones apart: `map` takes 4
//! (`Iterator::map`, `Option::map` take 1), `reserve` 2 (`Vec::reserve` 1), `copy_to_device`
//! and `copy_to_host` 4 (the transfer engine's take 5). Closure parameters do not count as
//! arguments; a turbofish with a comma at the top level of an argument would (the code has
//! none). The method table itself is read from `src/device/interpose.rs`. Calls through a path
//! (`Device::map(&*d, ...)`) are not seen: the scan refuses them, so that none is written.

mod common;

use std::collections::BTreeMap;

use common::sites::{self, Call, Entry, Key, Sweep, INVENTORY};
use glake::device::CallKind;

fn table(methods: &[(&str, usize)]) -> Vec<(String, usize)> {
    methods.iter().map(|&(m, n)| (m.to_string(), n)).collect()
}

/// (function, method, line) of each call `scan` finds.
fn found(src: &str, methods: &[(&str, usize)]) -> Vec<(String, String, u32)> {
    sites::scan(src, &table(methods))
        .into_iter()
        .map(|c| (c.function, c.method, c.line))
        .collect()
}

fn call(function: &str, method: &str, line: u32) -> (String, String, u32) {
    (function.to_string(), method.to_string(), line)
}

#[test]
fn the_inventory_lists_every_device_call_site_of_the_library() {
    let source = sites::library_sites();
    let inventory = sites::inventory();
    let mut listed: BTreeMap<&Key, Vec<&Entry>> = BTreeMap::new();
    for entry in &inventory {
        listed.entry(&entry.key).or_default().push(entry);
    }
    let mut problems = Vec::new();
    for (key, calls) in &source {
        let n = listed.get(key).map_or(0, Vec::len);
        if n < calls.len() {
            let lines: Vec<String> = calls.iter().map(|c: &Call| c.line.to_string()).collect();
            problems.push(format!(
                "{} calls {} in {} {} time(s) (lines {}), {INVENTORY} lists it {n} time(s): add \
                 `{} {} {} <test binary of the sweep that fails it>`",
                key.0,
                key.2,
                key.1,
                calls.len(),
                lines.join(", "),
                key.0,
                key.1,
                key.2
            ));
        }
    }
    for (key, entries) in &listed {
        let n = source.get(*key).map_or(0, Vec::len);
        if entries.len() > n {
            let lines: Vec<String> = entries.iter().map(|e| e.line.to_string()).collect();
            problems.push(format!(
                "{INVENTORY} lines {} list {} {} {} {} time(s); the source has {n} such call(s)",
                lines.join(", "),
                key.0,
                key.1,
                key.2,
                entries.len()
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let calls: usize = source.values().map(Vec::len).sum();
    assert_eq!(calls, inventory.len());
    println!("{} device call sites in {} files", calls, {
        let mut files: Vec<&String> = source.keys().map(|k| &k.0).collect();
        files.dedup();
        files.len()
    });
}

/// Every sweep the inventory names is a test binary that checks its share; reasons are given.
#[test]
fn every_sweep_named_checks_its_share_and_every_unswept_site_says_why() {
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    for entry in sites::inventory() {
        match &entry.sweep {
            Sweep::By(binary) => *by.entry(binary.clone()).or_default() += 1,
            Sweep::Unswept(reason) => assert!(
                reason.split_whitespace().count() >= 3,
                "{INVENTORY}:{}: say why no sweep reaches it",
                entry.line
            ),
        }
    }
    for (binary, n) in &by {
        let path = sites::root().join(format!("tests/{binary}.rs"));
        let src = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{INVENTORY} names sweep {binary:?}: {e}"));
        assert!(
            src.contains(&format!("Swept::new(\"{binary}\")")),
            "tests/{binary}.rs is given {n} sites but does not check them (sites::Swept::new)"
        );
    }
    println!("sites per sweep: {by:?}");
}

/// The table of driver-call methods read from `Interposed` is the `Device` trait's
/// `#[track_caller]` methods, and covers every kind.
#[test]
fn the_method_table_is_the_device_traits_driver_calls() {
    let methods = sites::methods();
    let trait_src = std::fs::read_to_string(sites::root().join("src/device/mod.rs")).unwrap();
    let lines: Vec<&str> = trait_src.lines().map(str::trim).collect();
    let mut tracked: Vec<String> = lines
        .windows(2)
        .filter(|w| w[0] == "#[track_caller]")
        .filter_map(|w| {
            let rest = w[1].strip_prefix("unsafe ").unwrap_or(w[1]);
            let rest = rest.strip_prefix("fn ")?;
            Some(rest.split(['(', '<']).next()?.to_string())
        })
        .collect();
    tracked.sort();
    let mut names: Vec<String> = methods.iter().map(|m| m.name.clone()).collect();
    names.sort();
    assert_eq!(names, tracked);
    let get = |name: &str| {
        methods
            .iter()
            .find(|m| m.name == name)
            .map(|m| (m.arity, m.kind))
    };
    assert_eq!(get("map"), Some((4, CallKind::Map)));
    assert_eq!(get("reserve"), Some((2, CallKind::Reserve)));
    assert_eq!(get("copy_to_device"), Some((4, CallKind::Copy)));
    assert_eq!(get("import_handle"), Some((2, CallKind::Share)));
    assert_eq!(
        get("synchronize_device"),
        Some((0, CallKind::SynchronizeDevice))
    );
    for getter in [
        "granularity",
        "ordinal",
        "device_count",
        "knows_stream",
        "identity",
    ] {
        assert_eq!(get(getter), None, "{getter} is no driver call");
    }
    for kind in CallKind::ALL {
        assert!(methods.iter().any(|m| m.kind == kind), "{kind:?}");
    }
}

/// No driver call through a path (`Device::map(&*d, ...)`), which the scan would not see.
#[test]
fn the_library_calls_the_device_by_method_calls_only() {
    let names: Vec<&str> = sites::methods().iter().map(|m| m.name.as_str()).collect();
    for path in sites::library_files() {
        let src = std::fs::read_to_string(sites::root().join(&path)).unwrap();
        for name in &names {
            for form in [
                format!("::{name}("),
                format!("::{name})"),
                format!("::{name},"),
            ] {
                let hit = src.lines().enumerate().find(|(_, l)| {
                    let code = l.split("//").next().unwrap_or("");
                    code.contains(&form)
                });
                assert!(
                    hit.is_none(),
                    "{path}:{}: a driver call through a path; call it as a method",
                    hit.map_or(0, |h| h.0 + 1)
                );
            }
        }
    }
}

#[test]
fn scan_tells_device_calls_from_iterator_and_vec_methods_by_their_arguments() {
    let src = r#"
fn f(device: &SharedDevice, v: &mut Vec<u8>) -> Result<()> {
    let sizes: Vec<usize> = chunks.iter().map(|c| c.len).collect();
    v.reserve(16);
    let va = device.reserve(size, align)?;
    device.map(va, size, handle, 0)?;
    let x = opt.map(|(a, b)| a + b);
    let y = pairs.map(|a, b| (a, b, c, d));
    device.unmap(va, size)
}
"#;
    let methods = [("map", 4), ("reserve", 2), ("unmap", 2)];
    assert_eq!(
        found(src, &methods),
        vec![
            call("f", "reserve", 5),
            call("f", "map", 6),
            call("f", "unmap", 9)
        ]
    );
}

#[test]
fn scan_names_the_enclosing_impl_and_functions() {
    let src = r#"
impl<I: Interposer> Device for Interposed<I> {
    fn a(&self) { self.inner.synchronize_device() }
}
impl Inner {
    pub(crate) fn release(&mut self, device: &dyn Device) -> [u8; 4] {
        fn helper(d: &dyn Device) { d.synchronize_device(); }
        let f = |d: &dyn Device| d.synchronize_device();
        device.synchronize_device();
    }
    fn declared(&self);
}
trait Tidy {
    fn tidy(&self, d: &dyn Device) { d.synchronize_device(); }
}
unsafe impl<'a> Send for Holder<'a> where Self: Sized {}
pub fn free(d: &dyn Device, f: fn(u32) -> u32, g: impl Fn(u8)) {
    d.synchronize_device();
}
"#;
    assert_eq!(
        found(src, &[("synchronize_device", 0)]),
        vec![
            call("Interposed::a", "synchronize_device", 3),
            call("Inner::release::helper", "synchronize_device", 7),
            call("Inner::release", "synchronize_device", 8),
            call("Inner::release", "synchronize_device", 9),
            call("Tidy::tidy", "synchronize_device", 14),
            call("free", "synchronize_device", 18),
        ]
    );
}

#[test]
fn scan_skips_comments_strings_and_test_modules() {
    let src = r##"
fn f(device: &dyn Device) {
    // device.synchronize_device();
    /* device.synchronize_device(); /* nested */ device.synchronize_device(); */
    let s = "device.synchronize_device()";
    let r = r#"device.synchronize_device() " still"#;
    let c = '"'; let e = '\''; let b = b'"';
    let l: &'static str = "x";
    device.synchronize_device();
}
#[cfg(test)]
mod tests {
    fn t(device: &dyn Device) { device.synchronize_device(); }
}
#[cfg(test)]
fn helper(device: &dyn Device) { device.synchronize_device(); }
fn g(device: &dyn Device) { device.synchronize_device(); }
"##;
    assert_eq!(
        found(src, &[("synchronize_device", 0)]),
        vec![
            call("f", "synchronize_device", 9),
            call("g", "synchronize_device", 17)
        ]
    );
}

#[test]
fn scan_places_a_call_at_its_methods_name() {
    let src = "fn f(d: &dyn Device) {\n    d\n        .record_event(\n            e,\n            s,\n        )\n        .and_then(|()| d.query_event(e));\n}\n";
    let calls = sites::scan(src, &table(&[("record_event", 2), ("query_event", 1)]));
    let places: Vec<(&str, u32, u32)> = calls
        .iter()
        .map(|c| (c.method.as_str(), c.line, c.column))
        .collect();
    assert_eq!(
        places,
        vec![("record_event", 3, 10), ("query_event", 7, 26)]
    );
}

#[test]
fn the_inventory_format_is_parsed_and_checked() {
    let text = "# comment\n\nsrc/a.rs  Inner::f  map  faults\nsrc/b.rs g unmap unswept: CUDA only, no host path\n";
    let entries = sites::parse_inventory(text).unwrap();
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[0].line, 3);
    assert_eq!(
        entries[0].key,
        ("src/a.rs".into(), "Inner::f".into(), "map".into())
    );
    assert_eq!(entries[0].sweep, Sweep::By("faults".into()));
    assert_eq!(
        entries[1].sweep,
        Sweep::Unswept("CUDA only, no host path".into())
    );
    for bad in [
        "src/a.rs f map",
        "src/a.rs f map unswept",
        "src/a.rs f map unswept:",
        "src/a.rs f map faults sleep",
    ] {
        assert!(sites::parse_inventory(bad).is_err(), "{bad}");
    }
}
