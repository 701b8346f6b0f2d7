//! Every knob that changes how fast k3 runs — and never what it computes — in one value.
//!
//! The environment variables below are read here and nowhere else, once per process, layered
//! under `--tune NAME=VALUE` flags and over the config file's `[tuning]` table
//! ([`Tuning::init_layered`], docs/tuning.md); `k3` refuses a malformed value at start with an
//! error naming it (exit 2) instead of falling back to a default, and `k3 run --json` and `k3 bench`
//! print the value in force so a measurement can be reproduced. Tokens and logits are the
//! same under every setting (the tests run the suite with the scalar kernels forced).
//!
//! | variable | values | default | what it changes |
//! |---|---|---|---|
//! | `K3_KERNELS` | `generic` (`scalar`), `avx2`, `avx512`, `auto` | `auto` | the SIMD path of the kernels (clamped to what the CPU has) |
//! | `K3_ROW_ORDER` | `fours` (`4`), `single` (`1`), `auto` | `auto` | how one-token products walk their rows: four at a time with software prefetch, or one after another; `auto` times both once at start |
//! | `K3_IO_THREADS` | 1–256 | 8 | threads that read weights |
//! | `K3_NO_DIRECT` | `0`/`1` | `0` | `1` reads through the page cache instead of `O_DIRECT` |
//! | `K3_MMAP` | `0`/`1` | `1` | `0` reads resident weights into the heap instead of mapping the shards |
//! | `K3_PREFETCH` | 0–4096 | 16 | predicted experts of the next layer read ahead (0: off) |
//! | `K3_PREFETCH_DEPTH` | 0–4096 | 3 | reads in flight under which a predicted read may start |
//! | `K3_PREFETCH_LATE_DEPTH` | 0–4096 | 16 | the same for a prediction from a layer's output |
//! | `K3_PREFETCH_EARLY` | `0`/`off`, `1`/`on`, `auto` | `auto` | the early prediction (`auto`: chosen by timing decoding steps) |
//! | `K3_CACHE_POLICY` | `cycle-queue`, `layer-cycle`, `lru` | `cycle-queue` | the expert cache's replacement policy |
//! | `K3_NOSPEC` | `0`/`1` | `0` | `1` turns speculative decoding off whatever `--spec` says |
//! | `K3_TRUNK_SEGMENT_KB` | 4–1048576 | 32768 | KiB of an encoded trunk layer read ahead of its decoder, and the window a tight budget stages it through |
//! | `K3_KEEP_WARM` | `0`/`1` | `1` | `1` keeps the other compute threads (one per other core at most) looking for work between a forward pass's parallel loops instead of letting them sleep |

use serde::Serialize;
use std::sync::OnceLock;

/// How many of the next layer's predicted experts are queued for reading ahead while decoding,
/// the most likely first (`K3_PREFETCH`; 0 turns prefetching off).
pub const DEFAULT_PREFETCH: usize = 16;

/// A predicted read starts only while fewer reads than this are in flight
/// (`K3_PREFETCH_DEPTH`).
pub const DEFAULT_PREFETCH_DEPTH: usize = 3;

/// Reads of a prediction made from a layer's output (the next layer's input but for its
/// attention), at the ranks that have been right at least half the time, may start while
/// fewer reads than this are in flight (`K3_PREFETCH_LATE_DEPTH`): they are read as if they
/// were the layer's own.
pub const DEFAULT_PREFETCH_LATE_DEPTH: usize = 16;

/// KiB of an encoded trunk layer's stored run read ahead of its decoder
/// (`K3_TRUNK_SEGMENT_KB`): four of the 8 MiB pieces a run is read in.
pub const DEFAULT_TRUNK_SEGMENT_KB: usize = 32 << 10;

/// A kernel path asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelChoice {
    /// The best the CPU has.
    Auto,
    /// Scalar code only.
    Generic,
    /// AVX2 + FMA.
    Avx2,
    /// AVX-512.
    Avx512,
}

/// A row order asked for (`None`: timed at start).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RowOrderChoice {
    /// Time both once and keep the faster.
    Auto,
    /// Four rows at a time, with software prefetch.
    Fours,
    /// One row after another.
    Single,
}

/// The expert cache's replacement policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CachePolicy {
    /// The layer-cycle estimate kept in a bucket queue (bounded-time eviction).
    CycleQueue,
    /// The same estimate found by a scan.
    LayerCycle,
    /// Least recently used.
    Lru,
}

/// The speed knobs in force.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Tuning {
    /// `K3_KERNELS`.
    pub kernels: KernelChoice,
    /// `K3_ROW_ORDER`.
    pub row_order: RowOrderChoice,
    /// `K3_IO_THREADS`.
    pub io_threads: usize,
    /// Not `K3_NO_DIRECT`.
    pub direct_io: bool,
    /// `K3_MMAP`.
    pub mmap: bool,
    /// `K3_PREFETCH`.
    pub prefetch: usize,
    /// `K3_PREFETCH_DEPTH`.
    pub prefetch_depth: usize,
    /// `K3_PREFETCH_LATE_DEPTH`.
    pub prefetch_late_depth: usize,
    /// `K3_PREFETCH_EARLY` (None: timed).
    pub prefetch_early: Option<bool>,
    /// `K3_CACHE_POLICY`.
    pub cache_policy: CachePolicy,
    /// `K3_NOSPEC`.
    pub no_spec: bool,
    /// `K3_TRUNK_SEGMENT_KB`.
    pub trunk_segment_kb: usize,
    /// `K3_KEEP_WARM`.
    pub keep_warm: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            kernels: KernelChoice::Auto,
            row_order: RowOrderChoice::Auto,
            io_threads: 8,
            direct_io: true,
            mmap: true,
            prefetch: DEFAULT_PREFETCH,
            prefetch_depth: DEFAULT_PREFETCH_DEPTH,
            prefetch_late_depth: DEFAULT_PREFETCH_LATE_DEPTH,
            prefetch_early: None,
            cache_policy: CachePolicy::CycleQueue,
            no_spec: false,
            trunk_segment_kb: DEFAULT_TRUNK_SEGMENT_KB,
            keep_warm: true,
        }
    }
}

/// A tuning variable with a value it does not take.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?} is not valid: expected {expected}")]
pub struct TuningError {
    /// The variable.
    pub var: &'static str,
    /// What it held.
    pub value: String,
    /// What it takes.
    pub expected: &'static str,
}

/// Every variable [`Tuning`] reads.
pub const VARIABLES: [&str; 13] = [
    "K3_KERNELS",
    "K3_ROW_ORDER",
    "K3_IO_THREADS",
    "K3_NO_DIRECT",
    "K3_MMAP",
    "K3_PREFETCH",
    "K3_PREFETCH_DEPTH",
    "K3_PREFETCH_LATE_DEPTH",
    "K3_PREFETCH_EARLY",
    "K3_CACHE_POLICY",
    "K3_NOSPEC",
    "K3_TRUNK_SEGMENT_KB",
    "K3_KEEP_WARM",
];

impl Tuning {
    /// The settings `lookup` gives (a variable's value, or None when unset; an empty value
    /// counts as unset).
    ///
    /// # Errors
    /// A variable holds a value it does not take; the error names it.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Tuning, TuningError> {
        let get = |var: &str| lookup(var).filter(|v| !v.trim().is_empty());
        let bad = |var: &'static str, value: &str, expected: &'static str| TuningError {
            var,
            value: value.to_string(),
            expected,
        };
        let flag = |var: &'static str, default: bool| -> Result<bool, TuningError> {
            match get(var).as_deref().map(str::trim) {
                None => Ok(default),
                Some("0") => Ok(false),
                Some("1") => Ok(true),
                Some(v) => Err(bad(var, v, "0 or 1")),
            }
        };
        let count =
            |var: &'static str, default: usize, lo: usize, hi: usize, expected| match get(var) {
                None => Ok(default),
                Some(v) => v
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (lo..=hi).contains(n))
                    .ok_or_else(|| bad(var, &v, expected)),
            };
        let d = Tuning::default();
        let kernels = match get("K3_KERNELS").as_deref().map(str::trim) {
            None | Some("auto") => KernelChoice::Auto,
            Some("generic" | "scalar") => KernelChoice::Generic,
            Some("avx2") => KernelChoice::Avx2,
            Some("avx512") => KernelChoice::Avx512,
            Some(v) => return Err(bad("K3_KERNELS", v, "generic, avx2, avx512 or auto")),
        };
        let row_order = match get("K3_ROW_ORDER").as_deref().map(str::trim) {
            None | Some("auto") => RowOrderChoice::Auto,
            Some("fours" | "4") => RowOrderChoice::Fours,
            Some("single" | "1") => RowOrderChoice::Single,
            Some(v) => return Err(bad("K3_ROW_ORDER", v, "fours, single or auto")),
        };
        let prefetch_early = match get("K3_PREFETCH_EARLY").as_deref().map(str::trim) {
            None | Some("auto") => None,
            Some("1" | "on") => Some(true),
            Some("0" | "off") => Some(false),
            Some(v) => return Err(bad("K3_PREFETCH_EARLY", v, "0, 1, on, off or auto")),
        };
        let cache_policy = match get("K3_CACHE_POLICY").as_deref().map(str::trim) {
            None | Some("cycle-queue") => CachePolicy::CycleQueue,
            Some("layer-cycle") => CachePolicy::LayerCycle,
            Some("lru") => CachePolicy::Lru,
            Some(v) => return Err(bad("K3_CACHE_POLICY", v, "cycle-queue, layer-cycle or lru")),
        };
        const UPTO: &str = "a whole number from 0 to 4096";
        Ok(Tuning {
            kernels,
            row_order,
            io_threads: count(
                "K3_IO_THREADS",
                d.io_threads,
                1,
                256,
                "a whole number from 1 to 256",
            )?,
            direct_io: !flag("K3_NO_DIRECT", !d.direct_io)?,
            mmap: flag("K3_MMAP", d.mmap)?,
            prefetch: count("K3_PREFETCH", d.prefetch, 0, 4096, UPTO)?,
            prefetch_depth: count("K3_PREFETCH_DEPTH", d.prefetch_depth, 0, 4096, UPTO)?,
            prefetch_late_depth: count(
                "K3_PREFETCH_LATE_DEPTH",
                d.prefetch_late_depth,
                0,
                4096,
                UPTO,
            )?,
            prefetch_early,
            cache_policy,
            no_spec: flag("K3_NOSPEC", d.no_spec)?,
            trunk_segment_kb: count(
                "K3_TRUNK_SEGMENT_KB",
                d.trunk_segment_kb,
                4,
                1 << 20,
                "a whole number from 4 to 1048576",
            )?,
            keep_warm: flag("K3_KEEP_WARM", d.keep_warm)?,
        })
    }

    /// The settings of this process's environment.
    ///
    /// # Errors
    /// A variable holds a value it does not take; the error names it.
    pub fn from_env() -> Result<Tuning, TuningError> {
        Self::from_lookup(|var| std::env::var(var).ok())
    }

    /// The settings in force, read from the environment the first time they are asked for.
    /// A program checks them first with [`Tuning::init`]; where it has not (a test, a
    /// library user), a malformed variable leaves the defaults in force.
    pub fn get() -> &'static Tuning {
        TUNING.get_or_init(|| Self::from_env().unwrap_or_default())
    }

    /// Read the settings from the environment now, refusing a malformed variable: what a
    /// program calls before anything else reads them.
    ///
    /// # Errors
    /// A variable holds a value it does not take; the error names it.
    pub fn init() -> Result<&'static Tuning, TuningError> {
        Self::init_layered(&[], |_| None)
    }

    /// Settle the settings now from three layers, the first that sets a knob winning: `flags`
    /// (`(variable, value)` pairs from the command line), the environment, then `file` (the
    /// config file's value for a variable). What a program calls before anything else reads
    /// them.
    ///
    /// # Errors
    /// A layer holds a value a knob does not take; the error names the variable.
    pub fn init_layered(
        flags: &[(&'static str, String)],
        file: impl Fn(&str) -> Option<String>,
    ) -> Result<&'static Tuning, TuningError> {
        let t = Self::from_lookup(|var| {
            let set = |v: &Option<String>| v.as_ref().is_some_and(|v| !v.trim().is_empty());
            let flag = flags
                .iter()
                .rev()
                .find(|(f, _)| *f == var)
                .map(|(_, v)| v.clone());
            let env = std::env::var(var).ok();
            [flag, env, file(var)].into_iter().find(set).flatten()
        })?;
        Ok(TUNING.get_or_init(|| t))
    }

    /// The variable a `--tune` name stands for: `io_threads`, `io-threads` or `K3_IO_THREADS`
    /// all name `K3_IO_THREADS`; None for a name that is no knob.
    #[must_use]
    pub fn variable(name: &str) -> Option<&'static str> {
        let upper = name.trim().replace('-', "_").to_ascii_uppercase();
        let var = if upper.starts_with("K3_") {
            upper
        } else if upper == "NO_SPEC" {
            "K3_NOSPEC".to_string()
        } else {
            format!("K3_{upper}")
        };
        VARIABLES.iter().copied().find(|v| *v == var)
    }
}

static TUNING: OnceLock<Tuning> = OnceLock::new();

#[cfg(test)]
mod tests {
    use super::*;

    fn with(pairs: &[(&str, &str)]) -> Result<Tuning, TuningError> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect();
        Tuning::from_lookup(|var| pairs.iter().find(|(k, _)| k == var).map(|(_, v)| v.clone()))
    }

    #[test]
    fn nothing_set_is_the_defaults() {
        assert_eq!(with(&[]), Ok(Tuning::default()));
        assert_eq!(with(&[("K3_PREFETCH", " ")]), Ok(Tuning::default()));
    }

    #[test]
    fn every_variable_is_read() {
        let t = with(&[
            ("K3_KERNELS", "scalar"),
            ("K3_ROW_ORDER", "1"),
            ("K3_IO_THREADS", "12"),
            ("K3_NO_DIRECT", "1"),
            ("K3_MMAP", "0"),
            ("K3_PREFETCH", "0"),
            ("K3_PREFETCH_DEPTH", "5"),
            ("K3_PREFETCH_LATE_DEPTH", "7"),
            ("K3_PREFETCH_EARLY", "on"),
            ("K3_CACHE_POLICY", "lru"),
            ("K3_NOSPEC", "1"),
            ("K3_TRUNK_SEGMENT_KB", "64"),
            ("K3_KEEP_WARM", "0"),
        ])
        .expect("valid");
        assert_eq!(
            t,
            Tuning {
                kernels: KernelChoice::Generic,
                row_order: RowOrderChoice::Single,
                io_threads: 12,
                direct_io: false,
                mmap: false,
                prefetch: 0,
                prefetch_depth: 5,
                prefetch_late_depth: 7,
                prefetch_early: Some(true),
                cache_policy: CachePolicy::Lru,
                no_spec: true,
                trunk_segment_kb: 64,
                keep_warm: false,
            }
        );
    }

    #[test]
    fn a_malformed_value_is_refused_by_name() {
        for (var, value) in [
            ("K3_KERNELS", "avx3"),
            ("K3_ROW_ORDER", "two"),
            ("K3_IO_THREADS", "0"),
            ("K3_IO_THREADS", "eight"),
            ("K3_NO_DIRECT", "yes"),
            ("K3_MMAP", "2"),
            ("K3_PREFETCH", "-1"),
            ("K3_PREFETCH_DEPTH", "1e3"),
            ("K3_PREFETCH_LATE_DEPTH", "99999"),
            ("K3_PREFETCH_EARLY", "maybe"),
            ("K3_CACHE_POLICY", "belady"),
            ("K3_NOSPEC", "true"),
            ("K3_TRUNK_SEGMENT_KB", "2"),
            ("K3_KEEP_WARM", "on"),
        ] {
            let e = with(&[(var, value)]).expect_err(var);
            assert_eq!(e.var, var);
            assert!(e.to_string().starts_with(var), "{e}");
            assert!(VARIABLES.contains(&var));
        }
    }
}
