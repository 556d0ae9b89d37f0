//! Command line of `glake-replay`, parsed here so that it can be tested without the binary.

use std::path::PathBuf;

use super::configs::{self, NamedConfig, Overrides};
use super::replay::Backend;
use super::{Result, TraceError};
use glake::config::{parse_bytes, DefragLevel};

pub const USAGE: &str = "\
Replays allocation traces through the glake pool and compares configurations.

usage: glake-replay [options] TRACE...

TRACE: a text trace (`action addr size stream` lines, plain or gzip) or a PyTorch memory
snapshot pickle (torch.cuda.memory._dump_snapshot).

options:
  --config NAME[,NAME]   configurations to replay (repeatable; default: caching,stitch);
                         --list-configs shows the table
  --frag-limit BYTES     ad-hoc configuration \"custom\": the stitch defaults with these
  --reuse-limit F        changes, replayed after the --config ones (alone without
  --defrag-level N       --config); defrag level 0: stitch before growing, 1: when full
  --backend host|cuda    host (default): memfd-backed, no GPU needed; cuda: device 0
  --budget BYTES         memory the pool may create (K/M/G/T suffixes); reports OOMs
  --find-min-budget      bisect the smallest budget with no OOM, per configuration
  --device N             which device's trace to take from a snapshot pickle (default 0)
  --json                 one JSON object per line per trace and configuration
  --plot FILE.svg|.png   memory timeline per trace and configuration (the names are
                         inserted before the extension when there are several)
  --driver-calls         also print the time per kind of driver call
  --waste                where the reserved memory beyond the live bytes sits at the live
                         peak and at the reserved peak (free whole chunks, stranded
                         sub-chunk rests, ...; replays again)
  --check N              check the pool's invariants every N operations and at the end;
                         the first inconsistency fails the replay (parked blocks go back
                         to the free lists at each check, so placements differ)
  --list-configs         list the named configurations and exit
  -h, --help             this text
";

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    pub traces: Vec<PathBuf>,
    pub configs: Vec<NamedConfig>,
    pub backend: Backend,
    pub budget: Option<usize>,
    pub find_min_budget: bool,
    pub device: usize,
    pub json: bool,
    pub plot: Option<PathBuf>,
    pub driver_calls: bool,
    pub waste: bool,
    /// Check the pool's invariants every this many operations (see `ReplayOptions`).
    pub check_every: Option<usize>,
    pub list_configs: bool,
    pub help: bool,
}

fn bytes(option: &str, value: &str) -> Result<usize> {
    parse_bytes(value)
        .filter(|&b| b > 0)
        .ok_or_else(|| TraceError::new(format!("{option}: {value:?} is not a byte count")))
}

/// Parses the arguments after the program name.
pub fn parse_args<I: IntoIterator<Item = String>>(args: I) -> Result<Args> {
    let mut parsed = Args {
        traces: Vec::new(),
        configs: Vec::new(),
        backend: Backend::Host,
        budget: None,
        find_min_budget: false,
        device: 0,
        json: false,
        plot: None,
        driver_calls: false,
        waste: false,
        check_every: None,
        list_configs: false,
        help: false,
    };
    let mut names: Vec<String> = Vec::new();
    let mut overrides = Overrides::default();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if !arg.starts_with('-') || arg == "-" {
            parsed.traces.push(PathBuf::from(arg));
            continue;
        }
        let (option, inline) = match arg.split_once('=') {
            Some((o, v)) => (o.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        let mut value = || -> Result<String> {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| TraceError::new(format!("{option} needs a value")))
        };
        match option.as_str() {
            "-h" | "--help" => parsed.help = true,
            "--json" => parsed.json = true,
            "--find-min-budget" => parsed.find_min_budget = true,
            "--driver-calls" => parsed.driver_calls = true,
            "--waste" => parsed.waste = true,
            "--list-configs" => parsed.list_configs = true,
            "--config" => names.extend(
                value()?
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(String::from),
            ),
            "--frag-limit" => {
                let v = value()?;
                overrides.frag_limit = Some(
                    parse_bytes(&v)
                        .ok_or_else(|| TraceError::new(format!("--frag-limit: {v:?}")))?,
                );
            }
            "--reuse-limit" => {
                let v = value()?;
                match v.trim().parse::<f64>() {
                    Ok(f) if f.is_finite() && f >= 1.0 => overrides.reuse_limit = Some(f),
                    _ => {
                        return Err(TraceError::new(format!(
                            "--reuse-limit: {v:?} is not a number >= 1"
                        )))
                    }
                }
            }
            "--defrag-level" => {
                let v = value()?;
                overrides.defrag_level = Some(match v.trim() {
                    "0" => DefragLevel::BeforeGrow,
                    "1" => DefragLevel::WhenFull,
                    _ => {
                        return Err(TraceError::new(format!(
                            "--defrag-level: {v:?} is not 0 or 1"
                        )))
                    }
                });
            }
            "--backend" => {
                let v = value()?;
                parsed.backend = Backend::parse(v.trim()).ok_or_else(|| {
                    TraceError::new(format!("--backend: {v:?} is not host or cuda"))
                })?;
            }
            "--budget" => parsed.budget = Some(bytes("--budget", &value()?)?),
            "--check" => {
                let v = value()?;
                parsed.check_every = match v.trim().parse::<usize>() {
                    Ok(n) if n > 0 => Some(n),
                    _ => {
                        return Err(TraceError::new(format!(
                            "--check: {v:?} is not a positive operation count"
                        )))
                    }
                };
            }
            "--device" => {
                let v = value()?;
                parsed.device = v
                    .trim()
                    .parse()
                    .map_err(|_| TraceError::new(format!("--device: {v:?} is not an index")))?;
            }
            "--plot" => {
                let v = PathBuf::from(value()?);
                match v.extension().and_then(|e| e.to_str()) {
                    Some("svg" | "png") => parsed.plot = Some(v),
                    _ => {
                        return Err(TraceError::new(format!(
                            "--plot: {} must end in .svg or .png",
                            v.display()
                        )))
                    }
                }
            }
            _ => return Err(TraceError::new(format!("unknown option {arg}"))),
        }
    }
    if names.is_empty() && (overrides.is_empty() || parsed.list_configs) {
        names = configs::DEFAULT_NAMES
            .iter()
            .map(|s| s.to_string())
            .collect();
    }
    for name in &names {
        let config = configs::named(name).ok_or_else(|| {
            let known: Vec<&str> = configs::TABLE.iter().map(|e| e.name).collect();
            TraceError::new(format!(
                "unknown config {name:?}; known: {}",
                known.join(", ")
            ))
        })?;
        if !parsed.configs.contains(&config) {
            parsed.configs.push(config);
        }
    }
    parsed.configs.extend(overrides.custom());
    if parsed.find_min_budget && parsed.budget.is_some() {
        return Err(TraceError::new(
            "--find-min-budget searches the budget; leave out --budget",
        ));
    }
    if parsed.traces.is_empty() && !parsed.help && !parsed.list_configs {
        return Err(TraceError::new("no trace given (see --help)"));
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args> {
        parse_args(args.iter().map(|s| s.to_string()))
    }

    fn names(a: &Args) -> Vec<&str> {
        a.configs.iter().map(|c| c.name.as_str()).collect()
    }

    #[test]
    fn defaults_compare_caching_and_stitch() {
        let a = parse(&["t.txt.gz"]).unwrap();
        assert_eq!(names(&a), vec!["caching", "stitch"]);
        assert_eq!(a.backend, Backend::Host);
        assert_eq!(a.traces, vec![PathBuf::from("t.txt.gz")]);
        assert!(!a.json && a.budget.is_none() && a.plot.is_none());
    }

    #[test]
    fn options_with_values() {
        let a = parse(&[
            "--config",
            "stitch,stitch-fl64m",
            "--config=caching",
            "--budget=30G",
            "--json",
            "--plot",
            "out.png",
            "--device",
            "1",
            "a",
            "b",
        ])
        .unwrap();
        assert_eq!(names(&a), vec!["stitch", "stitch-fl64m", "caching"]);
        assert_eq!(a.budget, Some(30 << 30));
        assert_eq!(a.plot, Some(PathBuf::from("out.png")));
        assert_eq!((a.device, a.json, a.traces.len()), (1, true, 2));
    }

    #[test]
    fn overrides_add_custom() {
        let a = parse(&["--frag-limit", "64M", "--defrag-level", "1", "t"]).unwrap();
        assert_eq!(names(&a), vec!["custom"]);
        assert_eq!(a.configs[0].config.frag_limit, 64 << 20);
        let a = parse(&["--config", "stitch", "--reuse-limit", "2", "t"]).unwrap();
        assert_eq!(names(&a), vec!["stitch", "custom"]);
        assert_eq!(a.configs[1].config.reuse_limit, 2.0);
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(parse(&[]).is_err());
        assert!(parse(&["--config", "nope", "t"]).is_err());
        assert!(parse(&["--budget", "lots", "t"]).is_err());
        assert_eq!(
            parse(&["--check", "500", "t"]).unwrap().check_every,
            Some(500)
        );
        assert!(parse(&["--check", "0", "t"]).is_err());
        assert!(parse(&["--budget"]).is_err());
        assert!(parse(&["--plot", "x.pdf", "t"]).is_err());
        assert!(parse(&["--backend", "tpu", "t"]).is_err());
        assert!(parse(&["--reuse-limit", "0.5", "t"]).is_err());
        assert!(parse(&["--find-min-budget", "--budget", "1G", "t"]).is_err());
        assert!(parse(&["--frobnicate", "t"]).is_err());
        assert!(parse(&["--help"]).unwrap().help);
    }
}
