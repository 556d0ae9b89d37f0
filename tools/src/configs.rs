//! Named pool configurations to compare in a replay. Every entry starts from
//! [`Config::default`] (not the environment), so that a replay is reproducible; tuning a knob
//! is adding a line to [`TABLE`].

use glake::config::{Config, DefragLevel};

const MIB: usize = 1 << 20;

/// A configuration with the name it is reported under.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedConfig {
    pub name: String,
    pub config: Config,
}

/// One entry of the table: name, what it is, and how it changes the defaults.
pub struct Entry {
    pub name: &'static str,
    pub description: &'static str,
    apply: fn(&mut Config),
}

/// The configurations a replay can pick by name; the first two are the default comparison.
pub const TABLE: &[Entry] = &[
    Entry {
        name: "caching",
        description: "plain caching allocator, stitching off",
        apply: |c| c.stitch = false,
    },
    Entry {
        name: "stitch",
        description: "defaults: stitch before growing, frag_limit 2 MiB, reuse_limit 10, handles up to 32 MiB and 1/2048 of the pool (at most 32 per segment from 512 MiB), small-handle segments gathered, idle stitched ranges grown in place",
        apply: |_| {},
    },
    Entry {
        name: "stitch-handles64",
        description: "stitch, segments of 512 MiB or more cut into up to 64 handles (32 by default)",
        apply: |c| c.segment_handles = 64,
    },
    Entry {
        name: "stitch-nogather",
        description: "stitch, small-handle segments a stitch maps whole are not gathered into large handles",
        apply: |c| c.gather = false,
    },
    Entry {
        name: "stitch-nogrow",
        description: "stitch, a larger request never grows an idle stitched range in place",
        apply: |c| c.grow_stitched = false,
    },
    Entry {
        name: "stitch-fl8m",
        description: "stitch, pieces of at least 8 MiB",
        apply: |c| c.frag_limit = 8 * MIB,
    },
    Entry {
        name: "stitch-fl64m",
        description: "stitch, pieces of at least 64 MiB",
        apply: |c| c.frag_limit = 64 * MIB,
    },
    Entry {
        name: "stitch-level1",
        description: "stitch only when the device (or the cap) is full",
        apply: |c| c.defrag_level = DefragLevel::WhenFull,
    },
    Entry {
        name: "stitch-reuse2",
        description: "stitch, reuse a cached stitched block only up to 2x the request",
        apply: |c| c.reuse_limit = 2.0,
    },
    Entry {
        name: "stitch-chunk2m",
        description: "stitch, segments of 2 MiB handles only (GMLake's layout)",
        apply: |c| c.max_chunk = 2 * MIB,
    },
    Entry {
        name: "stitch-chunk16m",
        description: "stitch, physical handles of at most 16 MiB",
        apply: |c| c.max_chunk = 16 * MIB,
    },
    Entry {
        name: "stitch-chunk64m",
        description: "stitch, physical handles of at most 64 MiB",
        apply: |c| c.max_chunk = 64 * MIB,
    },
    Entry {
        name: "stitch-pieces16",
        description: "stitch, at most 16 pieces per stitched block",
        apply: |c| c.max_stitch_pieces = 16,
    },
];

/// Names of the configurations replayed when none is asked for.
pub const DEFAULT_NAMES: &[&str] = &["caching", "stitch"];

/// The configuration called `name`, if the table has it.
pub fn named(name: &str) -> Option<NamedConfig> {
    let entry = TABLE.iter().find(|e| e.name == name)?;
    let mut config = Config::default();
    (entry.apply)(&mut config);
    Some(NamedConfig {
        name: entry.name.to_string(),
        config,
    })
}

/// Ad-hoc changes to the stitch defaults, reported as the configuration "custom".
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Overrides {
    pub frag_limit: Option<usize>,
    pub reuse_limit: Option<f64>,
    pub defrag_level: Option<DefragLevel>,
}

impl Overrides {
    pub fn is_empty(&self) -> bool {
        *self == Overrides::default()
    }

    /// The "custom" configuration, or None when nothing is overridden.
    pub fn custom(&self) -> Option<NamedConfig> {
        if self.is_empty() {
            return None;
        }
        let mut config = Config::default();
        if let Some(v) = self.frag_limit {
            config.frag_limit = v;
        }
        if let Some(v) = self.reuse_limit {
            config.reuse_limit = v;
        }
        if let Some(v) = self.defrag_level {
            config.defrag_level = v;
        }
        Some(NamedConfig {
            name: "custom".to_string(),
            config,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_unique_and_valid() {
        for (i, e) in TABLE.iter().enumerate() {
            assert!(TABLE[..i].iter().all(|o| o.name != e.name), "{}", e.name);
            named(e.name).unwrap().config.validate().unwrap();
        }
        for name in DEFAULT_NAMES {
            assert!(named(name).is_some());
        }
        assert!(!named("caching").unwrap().config.stitch);
        assert_eq!(named("stitch").unwrap().config, Config::default());
        assert_eq!(named("stitch-fl64m").unwrap().config.frag_limit, 64 * MIB);
        assert!(named("nope").is_none());
    }

    #[test]
    fn overrides_make_custom() {
        assert!(Overrides::default().custom().is_none());
        let o = Overrides {
            frag_limit: Some(4 * MIB),
            defrag_level: Some(DefragLevel::WhenFull),
            ..Overrides::default()
        };
        let c = o.custom().unwrap();
        assert_eq!(c.name, "custom");
        assert_eq!(c.config.frag_limit, 4 * MIB);
        assert_eq!(c.config.defrag_level, DefragLevel::WhenFull);
        assert!(c.config.stitch);
    }
}
