//! The device call sites of the library: found in its source by a scan, listed in the
//! checked-in inventory `tests/device_call_sites.txt`, and mapped back from the source
//! locations a [`FaultDevice`] records, so that each fault sweep can check that it failed every
//! site the inventory gives it.
//!
//! A site is a call of a driver-call method of `Device` (one that `Interposed` runs through its
//! hook with a `CallKind`) in `src/` outside `src/device/`, named by its file, its enclosing
//! function and the method. The scan's rule: a call is `.name(args)` where `name` is such a
//! method and the number of arguments is that method's (besides `self`); so `Iterator::map`
//! (one argument) or `Vec::reserve` (one) are not device calls while `map(va, size, handle,
//! offset)` and `reserve(size, align)` are. Comments, strings and `#[cfg(test)]` items are
//! skipped. The enclosing function is the path of named items around the call: the impl's type
//! (or the trait), then the function, then any function nested in it, e.g.
//! `Inner::release_segment` or `open`; closures and modules add nothing. The method table comes
//! from `src/device/interpose.rs` itself, so a new driver call is scanned for without changing
//! this file.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use glake::device::fault::{CallSite, FaultDevice};
use glake::device::CallKind;

/// The inventory's path, relative to the package root.
pub const INVENTORY: &str = "tests/device_call_sites.txt";

/// The package root: source locations and the inventory are relative to it.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Punct(char),
    Literal,
}

#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    line: u32,
    column: u32,
}

impl Token {
    fn is(&self, c: char) -> bool {
        self.tok == Tok::Punct(c)
    }

    fn ident(&self) -> Option<&str> {
        match &self.tok {
            Tok::Ident(name) => Some(name),
            _ => None,
        }
    }
}

/// Rust source as identifiers, punctuation and literals, with the line and column (both from
/// 1, columns in characters) of each; comments, whitespace and lifetimes are dropped.
fn lex(src: &str) -> Vec<Token> {
    let chars: Vec<char> = src.chars().collect();
    let mut tokens = Vec::new();
    let (mut i, mut line, mut column) = (0, 1u32, 1u32);
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    // Moves past `n` characters, keeping the position.
    let advance = |i: &mut usize, line: &mut u32, column: &mut u32, n: usize| {
        for _ in 0..n {
            if chars.get(*i) == Some(&'\n') {
                *line += 1;
                *column = 1;
            } else {
                *column += 1;
            }
            *i += 1;
        }
    };
    while i < chars.len() {
        let c = chars[i];
        let start = (line, column);
        let mut push = |tok| {
            tokens.push(Token {
                tok,
                line: start.0,
                column: start.1,
            })
        };
        if c.is_whitespace() {
            advance(&mut i, &mut line, &mut column, 1);
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                advance(&mut i, &mut line, &mut column, 1);
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if at(i) == '/' && at(i + 1) == '*' {
                    depth += 1;
                    advance(&mut i, &mut line, &mut column, 2);
                } else if at(i) == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    advance(&mut i, &mut line, &mut column, 2);
                    if depth == 0 {
                        break;
                    }
                } else if i >= chars.len() {
                    break;
                } else {
                    advance(&mut i, &mut line, &mut column, 1);
                }
            }
        } else if c == '"' {
            advance(&mut i, &mut line, &mut column, 1);
            while i < chars.len() && chars[i] != '"' {
                let n = if chars[i] == '\\' { 2 } else { 1 };
                advance(&mut i, &mut line, &mut column, n);
            }
            advance(&mut i, &mut line, &mut column, 1);
            push(Tok::Literal);
        } else if c == '\'' {
            if at(i + 1) == '\\' {
                // An escaped character: up to the closing quote.
                advance(&mut i, &mut line, &mut column, 2);
                while i < chars.len() && chars[i] != '\'' {
                    advance(&mut i, &mut line, &mut column, 1);
                }
                advance(&mut i, &mut line, &mut column, 1);
                push(Tok::Literal);
            } else if at(i + 2) == '\'' {
                advance(&mut i, &mut line, &mut column, 3);
                push(Tok::Literal);
            } else {
                // A lifetime or label.
                advance(&mut i, &mut line, &mut column, 1);
                while at(i).is_alphanumeric() || at(i) == '_' {
                    advance(&mut i, &mut line, &mut column, 1);
                }
            }
        } else if c.is_alphabetic() || c == '_' {
            let mut word = String::new();
            while at(i).is_alphanumeric() || at(i) == '_' {
                word.push(at(i));
                advance(&mut i, &mut line, &mut column, 1);
            }
            let raw = matches!(word.as_str(), "r" | "br" | "cr");
            if matches!(word.as_str(), "b" | "c" | "r" | "br" | "cr") && at(i) == '"'
                || raw && at(i) == '#' && matches!(at(i + 1), '"' | '#')
            {
                // A raw, byte or C string: `r#"..."#` ends at a quote and as many hashes.
                let mut hashes = 0;
                while at(i) == '#' {
                    hashes += 1;
                    advance(&mut i, &mut line, &mut column, 1);
                }
                advance(&mut i, &mut line, &mut column, 1);
                loop {
                    if i >= chars.len() {
                        break;
                    }
                    if !raw && chars[i] == '\\' {
                        advance(&mut i, &mut line, &mut column, 2);
                    } else if chars[i] == '"' && (1..=hashes).all(|k| at(i + k) == '#') {
                        advance(&mut i, &mut line, &mut column, 1 + hashes);
                        break;
                    } else {
                        advance(&mut i, &mut line, &mut column, 1);
                    }
                }
                push(Tok::Literal);
            } else if word == "b" && at(i) == '\'' {
                // A byte: skip its quotes and any escape.
                advance(&mut i, &mut line, &mut column, 1);
                while i < chars.len() && chars[i] != '\'' {
                    let n = if chars[i] == '\\' { 2 } else { 1 };
                    advance(&mut i, &mut line, &mut column, n);
                }
                advance(&mut i, &mut line, &mut column, 1);
                push(Tok::Literal);
            } else if word == "r" && at(i) == '#' {
                // A raw identifier.
                advance(&mut i, &mut line, &mut column, 1);
                let mut word = String::new();
                while at(i).is_alphanumeric() || at(i) == '_' {
                    word.push(at(i));
                    advance(&mut i, &mut line, &mut column, 1);
                }
                push(Tok::Ident(word));
            } else {
                push(Tok::Ident(word));
            }
        } else if c.is_ascii_digit() {
            while at(i).is_alphanumeric() || at(i) == '_' {
                advance(&mut i, &mut line, &mut column, 1);
            }
            push(Tok::Literal);
        } else {
            advance(&mut i, &mut line, &mut column, 1);
            push(Tok::Punct(c));
        }
    }
    tokens
}

/// The index of the bracket closing the one at `open` (or the end).
fn closing(tokens: &[Token], open: usize) -> usize {
    let mut depth = 0usize;
    for (k, t) in tokens.iter().enumerate().skip(open) {
        match t.tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    tokens.len()
}

/// The number of arguments of the bracketed list opening at `open`: top-level commas, a
/// trailing one not counted, and closure parameters (`|a, b|` where an argument starts)
/// skipped.
fn arguments(tokens: &[Token], open: usize) -> usize {
    let end = closing(tokens, open);
    if end == open + 1 {
        return 0;
    }
    let (mut count, mut depth, mut k) = (1, 0usize, open + 1);
    let mut argument_starts = true;
    while k < end {
        let t = &tokens[k];
        match t.tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => depth = depth.saturating_sub(1),
            Tok::Punct(',') if depth == 0 => {
                if k + 1 < end {
                    count += 1;
                }
                argument_starts = true;
                k += 1;
                continue;
            }
            Tok::Punct('|') if depth == 0 && argument_starts => {
                k += 1;
                while k < end && !tokens[k].is('|') {
                    k += 1;
                }
            }
            _ => {}
        }
        argument_starts = depth == 0 && t.ident() == Some("move");
        k += 1;
    }
    count
}

/// The type an `impl` header starting at `at` (the `impl` keyword) is for: the last path
/// segment after `for` (or after the generics), without its own generics.
fn impl_type(tokens: &[Token], at: usize) -> String {
    let mut k = at + 1;
    let mut angle = 0i32;
    if tokens.get(k).is_some_and(|t| t.is('<')) {
        loop {
            match tokens.get(k).map(|t| &t.tok) {
                Some(Tok::Punct('<')) => angle += 1,
                Some(Tok::Punct('>')) => {
                    angle -= 1;
                    if angle == 0 {
                        k += 1;
                        break;
                    }
                }
                None => break,
                _ => {}
            }
            k += 1;
        }
    }
    let mut name = String::new();
    while let Some(t) = tokens.get(k) {
        match &t.tok {
            Tok::Punct('{') => break,
            Tok::Ident(word) if word == "where" && angle == 0 => break,
            Tok::Ident(word) if word == "for" && angle == 0 => name.clear(),
            Tok::Punct('<') => angle += 1,
            Tok::Punct('>') => angle -= 1,
            Tok::Ident(word) if angle == 0 && !matches!(word.as_str(), "dyn" | "mut") => {
                name = word.clone()
            }
            _ => {}
        }
        k += 1;
    }
    name
}

/// A device call found in source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub method: String,
    /// The enclosing function, e.g. `Inner::release_segment`.
    pub function: String,
    /// Line and column of the method's name.
    pub line: u32,
    pub column: u32,
}

/// The calls of `methods` (name and number of arguments) in `src`, in order.
pub fn scan(src: &str, methods: &[(String, usize)]) -> Vec<Call> {
    let tokens = lex(src);
    let mut calls = Vec::new();
    // Named scopes (impl types, traits, functions) and unnamed ones (blocks, closures,
    // modules), innermost last.
    let mut scopes: Vec<Option<String>> = Vec::new();
    // The item whose body the next `{` opens, with the bracket nesting it was named at.
    let mut pending: Option<(String, usize)> = None;
    let mut nesting = 0usize;
    let mut k = 0;
    while k < tokens.len() {
        let t = &tokens[k];
        let next = |n: usize| tokens.get(k + n);
        match &t.tok {
            Tok::Punct('#') if is_cfg_test(&tokens, k) => {
                k = skip_item(&tokens, k);
                continue;
            }
            Tok::Ident(word) if word == "fn" || word == "trait" => {
                if let Some(name) = next(1).and_then(Token::ident) {
                    pending = Some((name.to_string(), nesting));
                }
            }
            Tok::Ident(word) if word == "impl" => {
                let starts_item = k == 0
                    || matches!(&tokens[k - 1].tok, Tok::Punct('}' | ';' | '{' | ']'))
                    || tokens[k - 1].ident() == Some("unsafe");
                if starts_item {
                    pending = Some((impl_type(&tokens, k), nesting));
                }
            }
            Tok::Punct('(' | '[') => nesting += 1,
            Tok::Punct(')' | ']') => nesting = nesting.saturating_sub(1),
            Tok::Punct(';') if pending.as_ref().is_some_and(|p| p.1 == nesting) => pending = None,
            Tok::Punct('{') => scopes.push(pending.take().map(|p| p.0)),
            Tok::Punct('}') => {
                scopes.pop();
            }
            Tok::Punct('.') => {
                if let (Some(name), Some(true)) =
                    (next(1).and_then(Token::ident), next(2).map(|t| t.is('(')))
                {
                    let wanted = methods.iter().find(|(m, _)| m == name).map(|m| m.1);
                    if wanted == Some(arguments(&tokens, k + 2)) {
                        let function: Vec<&str> =
                            scopes.iter().flatten().map(|s| s.as_str()).collect();
                        calls.push(Call {
                            method: name.to_string(),
                            function: function.join("::"),
                            line: tokens[k + 1].line,
                            column: tokens[k + 1].column,
                        });
                    }
                }
            }
            _ => {}
        }
        k += 1;
    }
    calls
}

/// Whether an attribute `#[cfg(test)]` starts at `k`.
fn is_cfg_test(tokens: &[Token], k: usize) -> bool {
    let want = ["#", "[", "cfg", "(", "test", ")", "]"];
    want.iter().enumerate().all(|(n, w)| {
        tokens.get(k + n).is_some_and(|t| match &t.tok {
            Tok::Ident(word) => word == w,
            Tok::Punct(c) => w.len() == 1 && w.starts_with(*c),
            Tok::Literal => false,
        })
    })
}

/// Past the item whose attributes start at `k`: its body, or up to its `;`.
fn skip_item(tokens: &[Token], mut k: usize) -> usize {
    while tokens.get(k).is_some_and(|t| t.is('#')) {
        k = closing(tokens, k + 1) + 1;
    }
    while let Some(t) = tokens.get(k) {
        match t.tok {
            Tok::Punct(';') => return k + 1,
            Tok::Punct('{') => return closing(tokens, k) + 1,
            Tok::Punct('(' | '[') => k = closing(tokens, k) + 1,
            _ => k += 1,
        }
    }
    k
}

/// A driver-call method of `Device`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Method {
    pub name: String,
    /// Arguments besides `self`.
    pub arity: usize,
    pub kind: CallKind,
}

/// The driver-call methods in the source of `Interposed`'s `Device` impl: the methods whose
/// body names a `CallKind`, with their number of parameters besides `self`.
pub fn methods_in(src: &str) -> Vec<Method> {
    let tokens = lex(src);
    let mut methods = Vec::new();
    let mut k = 0;
    while k < tokens.len() {
        let name = match (tokens[k].ident(), tokens.get(k + 1).and_then(Token::ident)) {
            (Some("fn"), Some(name)) if tokens.get(k + 2).is_some_and(|t| t.is('(')) => name,
            _ => {
                k += 1;
                continue;
            }
        };
        let params = arguments(&tokens, k + 2);
        let Some(open) = (k..tokens.len()).find(|&b| tokens[b].is('{')) else {
            break;
        };
        let end = closing(&tokens, open);
        let kind = (open..end).find_map(|b| {
            let is_kind = tokens[b].ident() == Some("CallKind")
                && tokens.get(b + 1).is_some_and(|t| t.is(':'))
                && tokens.get(b + 2).is_some_and(|t| t.is(':'));
            let name = tokens.get(b + 3).and_then(Token::ident)?;
            is_kind
                .then(|| CallKind::ALL.into_iter().find(|k| format!("{k:?}") == name))
                .flatten()
        });
        if let Some(kind) = kind {
            methods.push(Method {
                name: name.to_string(),
                arity: params.saturating_sub(1),
                kind,
            });
        }
        k = end;
    }
    methods
}

/// The driver-call methods of `Device`, read from `src/device/interpose.rs`.
pub fn methods() -> &'static [Method] {
    static METHODS: OnceLock<Vec<Method>> = OnceLock::new();
    METHODS.get_or_init(|| {
        let path = root().join("src/device/interpose.rs");
        let src = std::fs::read_to_string(&path).expect("src/device/interpose.rs");
        methods_in(&src)
    })
}

/// The kind of the driver-call method `name`.
pub fn kind_of(name: &str) -> Option<CallKind> {
    methods().iter().find(|m| m.name == name).map(|m| m.kind)
}

/// The device calls of the source file at `path` (relative to the package root), cached.
pub fn calls_in(path: &str) -> Vec<Call> {
    static FILES: OnceLock<Mutex<HashMap<String, Vec<Call>>>> = OnceLock::new();
    let files = FILES.get_or_init(Default::default);
    if let Some(calls) = files.lock().expect("cache").get(path) {
        return calls.clone();
    }
    let src = std::fs::read_to_string(root().join(path))
        .unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let table: Vec<(String, usize)> = methods()
        .iter()
        .map(|m| (m.name.clone(), m.arity))
        .collect();
    let calls = scan(&src, &table);
    files
        .lock()
        .expect("cache")
        .insert(path.to_string(), calls.clone());
    calls
}

/// Whether source at `path` is the library's outside the driver module: where the inventory's
/// sites are.
pub fn in_scope(path: &str) -> bool {
    path.starts_with("src/") && !path.starts_with("src/device/") && path.ends_with(".rs")
}

/// The library's source files outside `src/device/`, relative to the package root, sorted.
pub fn library_files() -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read_dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else {
                out.push(path);
            }
        }
    }
    let root = root();
    let mut files = Vec::new();
    walk(&root.join("src"), &mut files);
    let mut files: Vec<String> = files
        .iter()
        .filter_map(|p| p.strip_prefix(&root).ok())
        .map(|p| p.to_string_lossy().replace('\\', "/"))
        .filter(|p| in_scope(p))
        .collect();
    files.sort();
    files
}

/// A site as the inventory names it: file, enclosing function, method.
pub type Key = (String, String, String);

/// Every device call site of the library, by key, with its calls (several when a function
/// calls a method more than once).
pub fn library_sites() -> BTreeMap<Key, Vec<Call>> {
    let mut sites: BTreeMap<Key, Vec<Call>> = BTreeMap::new();
    for path in library_files() {
        for call in calls_in(&path) {
            let key = (path.clone(), call.function.clone(), call.method.clone());
            sites.entry(key).or_default().push(call);
        }
    }
    sites
}

/// Who fails a site of the inventory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sweep {
    /// The sweep of this test binary.
    By(String),
    /// No sweep reaches it on the host backend, for this reason.
    Unswept(String),
}

/// One line of the inventory: one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub line: usize,
    pub key: Key,
    pub sweep: Sweep,
}

/// Parses the inventory: per line, path, function, method and the sweep (a test binary's name,
/// or `unswept: ` and the reason), separated by white space; `#` starts a comment line.
pub fn parse_inventory(text: &str) -> Result<Vec<Entry>, String> {
    let mut entries = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line_no = n + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(path), Some(function), Some(method)) = (words.next(), words.next(), words.next())
        else {
            return Err(format!("{INVENTORY}:{line_no}: too few fields: {line}"));
        };
        let rest: Vec<&str> = words.collect();
        let sweep = match rest.as_slice() {
            [] => return Err(format!("{INVENTORY}:{line_no}: no sweep: {line}")),
            ["unswept:", reason @ ..] if !reason.is_empty() => Sweep::Unswept(reason.join(" ")),
            [first, ..] if first.starts_with("unswept") => {
                return Err(format!(
                    "{INVENTORY}:{line_no}: write `unswept: <why>`: {line}"
                ))
            }
            [binary] => Sweep::By(binary.to_string()),
            _ => return Err(format!("{INVENTORY}:{line_no}: one sweep per line: {line}")),
        };
        entries.push(Entry {
            line: line_no,
            key: (path.to_string(), function.to_string(), method.to_string()),
            sweep,
        });
    }
    Ok(entries)
}

/// The checked-in inventory.
pub fn inventory() -> Vec<Entry> {
    let text = std::fs::read_to_string(root().join(INVENTORY)).expect("the inventory");
    parse_inventory(&text).unwrap_or_else(|e| panic!("{e}"))
}

/// The site of the library that a recorded call came from; None for calls from elsewhere (the
/// tests themselves, the driver module). Panics when the scan finds no call at that place: the
/// scan then misses calls, and the inventory is incomplete.
pub fn site_of(site: &CallSite) -> Option<Key> {
    if !in_scope(site.file) {
        return None;
    }
    let calls = calls_in(site.file);
    let Some(call) = calls
        .iter()
        .find(|c| c.line == site.line && c.column == site.column)
    else {
        panic!("{site}: a device call the scan of the source does not find");
    };
    Some((
        site.file.to_string(),
        call.function.clone(),
        call.method.clone(),
    ))
}

/// The sites a sweep failed, gathered over its runs, to check against the inventory's share of
/// its test binary.
pub struct Swept {
    binary: &'static str,
    failed: HashSet<CallSite>,
    called: HashSet<CallSite>,
}

impl Swept {
    /// For the sweep of test binary `binary` (the name of its file in `tests/`).
    pub fn new(binary: &'static str) -> Swept {
        Swept {
            binary,
            failed: HashSet::new(),
            called: HashSet::new(),
        }
    }

    /// Adds the sites `fault` saw called and failed.
    pub fn add(&mut self, fault: &FaultDevice) {
        self.failed.extend(fault.sites_failed());
        self.called
            .extend(fault.sites_called().into_iter().map(|(s, _)| s));
    }

    /// Adds the site an injected failure names in its message (`... at file:line:column`),
    /// for sweeps that see only the error (through the C API).
    pub fn add_reported(&mut self, message: &str) {
        let site = (|| {
            let rest = &message[message.find("injected failure of ")? + 20..];
            let kind_name = rest.split_whitespace().next()?;
            let kind = CallKind::ALL
                .into_iter()
                .find(|k| format!("{k:?}") == kind_name)?;
            let place = rest[rest.find(" at ")? + 4..].split_whitespace().next()?;
            let mut parts = place.rsplitn(3, ':');
            let column = parts
                .next()?
                .trim_end_matches(|c: char| !c.is_ascii_digit());
            let line = parts.next()?;
            let file: &'static str = Box::leak(parts.next()?.to_string().into_boxed_str());
            Some(CallSite {
                kind,
                file,
                line: line.parse().ok()?,
                column: column.parse().ok()?,
            })
        })();
        let site = site.unwrap_or_else(|| panic!("no injected failure's site in {message:?}"));
        self.failed.insert(site);
        self.called.insert(site);
    }

    /// The library's sites this sweep failed, with the number of distinct calls of each.
    pub fn failed(&self) -> BTreeMap<Key, usize> {
        let mut failed: BTreeMap<Key, HashSet<(u32, u32)>> = BTreeMap::new();
        for site in &self.failed {
            if let Some(key) = site_of(site) {
                failed
                    .entry(key)
                    .or_default()
                    .insert((site.line, site.column));
            }
        }
        failed.into_iter().map(|(k, v)| (k, v.len())).collect()
    }

    /// Checks that every call the sweep saw is in the inventory, and that it failed every call
    /// the inventory gives its binary (those of `kind` only, for a sweep of one kind of call).
    pub fn assert_covers(&self, kind: Option<CallKind>) {
        let inventory = inventory();
        let mut listed: BTreeMap<&Key, usize> = BTreeMap::new();
        for entry in &inventory {
            *listed.entry(&entry.key).or_default() += 1;
        }
        for site in &self.called {
            if let Some(key) = site_of(site) {
                assert!(
                    listed.contains_key(&key),
                    "{site}: {key:?} is not in {INVENTORY}"
                );
            }
        }
        let failed = self.failed();
        let mut ours: BTreeMap<&Key, usize> = BTreeMap::new();
        for entry in &inventory {
            let of_kind = kind.is_none_or(|k| kind_of(&entry.key.2) == Some(k));
            if entry.sweep == Sweep::By(self.binary.to_string()) && of_kind {
                *ours.entry(&entry.key).or_default() += 1;
            }
        }
        let missed: Vec<String> = ours
            .iter()
            .filter(|&(key, &n)| failed.get(*key).copied().unwrap_or(0) < n)
            .map(|(key, n)| {
                format!(
                    "{} {} {} (listed {n}, failed {})",
                    key.0,
                    key.1,
                    key.2,
                    failed.get(*key).copied().unwrap_or(0)
                )
            })
            .collect();
        assert!(
            missed.is_empty(),
            "the {} sweep{} failed no call at these sites of {INVENTORY}:\n{}",
            self.binary,
            kind.map(|k| format!(" of {k:?}")).unwrap_or_default(),
            missed.join("\n")
        );
        println!(
            "{} sweep{}: {} listed sites failed; failed sites of the library: {}",
            self.binary,
            kind.map(|k| format!(" of {k:?}")).unwrap_or_default(),
            ours.values().sum::<usize>(),
            failed
                .iter()
                .map(|(k, n)| format!("{} {} {} x{n}", k.0, k.1, k.2))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
}
