//! `k3 verify`: check a checkpoint's files before anything runs on them (every shard read once,
//! per-tensor statistics, optional SHA-256 sums, the tokenizer's ranks, a packed trunk byte for
//! byte), list every problem found and exit 0 only when there is none.

mod ranks;

use super::progress::ByteBar;
use crate::engine::config::ModelConfig;
use crate::session::tokenizer::{self, Tokenizer};
use crate::stream::budget::gb;
use crate::stream::trunk::Trunk;
use crate::stream::verify::{self, Problems, TensorTotals, TrunkTotals};
use crate::stream::{shown, Checkpoint, MAX_LISTED};
use crate::Result;
use clap::Args;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Arguments of `k3 verify`.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// Checkpoint directory to check.
    pub model_dir: PathBuf,
    /// Also compare this packed trunk byte for byte with the checkpoint.
    #[arg(long, value_name = "DIR")]
    pub trunk: Option<PathBuf>,
    /// Check each shard's SHA-256 against FILE, in the format `sha256sum` writes
    /// (`<64 hex digits>  <file name>` per line); other files it names in MODEL_DIR are
    /// checked too.
    #[arg(long, value_name = "FILE")]
    pub sha256: Option<PathBuf>,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    pub json: bool,
}

/// Largest sums file read.
const MAX_SUMS_BYTES: u64 = 16 << 20;

/// A sums file: digest (lower-case hex) and line number by file name.
type Sums = BTreeMap<String, (String, usize)>;

/// Parse `path` in `sha256sum` format (`HEX  NAME`, `HEX *NAME`, a leading `\` for escaped
/// names, or the BSD `SHA256 (NAME) = HEX` of `--tag`); names are reduced to their last
/// path component. Bad lines and repeated names are problems.
fn read_sums(path: &Path, p: &mut Problems) -> Sums {
    let mut sums = Sums::new();
    let shown_path = shown(path);
    let bytes = match crate::stream::read_capped(path, MAX_SUMS_BYTES) {
        Ok(b) => b,
        Err(e) => {
            p.push(format!("{shown_path}: cannot read: {e}"));
            return sums;
        }
    };
    let text = String::from_utf8_lossy(&bytes);
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = raw.trim_end_matches('\r');
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let parsed = parse_sum_line(line);
        let Some((hex, name)) = parsed else {
            p.push(format!(
                "{shown_path}: line {line_no}: expected `<64 hex digits>  <file name>` (as \
                 sha256sum writes), found {:?}",
                line.chars().take(100).collect::<String>()
            ));
            continue;
        };
        let base = match Path::new(&name).file_name() {
            Some(n) => n.to_string_lossy().into_owned(),
            None => name.clone(),
        };
        if let Some((_, first)) = sums.get(&base) {
            p.push(format!(
                "{shown_path}: line {line_no}: {base:?} again (first on line {first})"
            ));
            continue;
        }
        sums.insert(base, (hex.to_ascii_lowercase(), line_no));
    }
    sums
}

/// One sums line as (hex digest, file name).
fn parse_sum_line(line: &str) -> Option<(String, String)> {
    let is_hex = |h: &str| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit());
    if let Some(rest) = line.strip_prefix("SHA256 (") {
        let (name, hex) = rest.rsplit_once(") = ")?;
        return is_hex(hex).then(|| (hex.to_string(), name.to_string()));
    }
    let (escaped, line) = match line.strip_prefix('\\') {
        Some(l) => (true, l),
        None => (false, line),
    };
    let hex = line.get(..64)?;
    let rest = line.get(64..)?;
    let name = rest
        .strip_prefix("  ")
        .or_else(|| rest.strip_prefix(" *"))?;
    if !is_hex(hex) || name.is_empty() {
        return None;
    }
    let name = if escaped {
        name.replace("\\n", "\n").replace("\\\\", "\\")
    } else {
        name.to_string()
    };
    Some((hex.to_string(), name))
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Everything the checks found, for the report.
#[derive(Default)]
struct Report {
    shards: usize,
    shard_bytes: u64,
    tensors: TensorTotals,
    sums_checked: usize,
    sums_matched: usize,
    sums_given: bool,
    tokenizer_entries: usize,
    unmerged: usize,
    trunk: Option<TrunkTotals>,
    warnings: Vec<String>,
}

/// Run `k3 verify`; returns the exit status (0 all checks pass, 3 a check failed).
/// Over 100 lines: the checks of `k3 verify` in order (shards, config, sums, trunk, tensors),
/// each adding to one report.
pub fn run(args: &VerifyArgs) -> Result<i32> {
    let start = Instant::now();
    let dir = &args.model_dir;
    // Shard sizes against the index and every header: refused here like everywhere else.
    let ck = Checkpoint::open(dir)?;
    let mut p = Problems::default();
    let mut r = Report {
        shards: ck.index().shard_names().len(),
        ..Report::default()
    };
    let cfg = match ModelConfig::load(&dir.join("config.json")) {
        Ok(cfg) => {
            if let Err(e) = crate::engine::weights::check_graph(&cfg, &ck) {
                p.push(e.to_string());
            }
            Some(cfg)
        }
        Err(e) => {
            p.push(e.to_string());
            None
        }
    };
    let sums = args.sha256.as_ref().map(|f| read_sums(f, &mut p));
    r.sums_given = sums.is_some();
    let trunk = match (&args.trunk, &cfg) {
        (Some(t), Some(cfg)) => match Trunk::open(t, &ck, cfg.num_hidden_layers) {
            Ok(t) => Some(t),
            Err(e) => {
                p.push(e.to_string());
                None
            }
        },
        (Some(t), None) => {
            p.push(format!(
                "trunk {} not compared: config.json was refused",
                shown(t)
            ));
            None
        }
        _ => None,
    };

    let mut sizes = Vec::with_capacity(r.shards);
    for k in 0..r.shards {
        sizes.push(ck.shard_stat(k).map(|s| s.size).unwrap_or(0));
    }
    r.shard_bytes = sizes.iter().sum();
    let trunk_bytes: u64 = trunk.as_ref().map_or(0, |t| {
        t.manifest()
            .runs()
            .flat_map(|l| l.tensors.values())
            .map(|t| t.stored + t.nbytes)
            .sum()
    });
    let total = r.shard_bytes + trunk_bytes;
    let bar = ByteBar::new("k3 verify".into());
    let mut done = 0u64;
    let mut progress = |n: u64| {
        done += n;
        bar.update(done.min(total), total);
    };

    let mut buf = Vec::new();
    // All zeros is only a problem in a tensor the graph reads.
    let unread: std::collections::HashSet<String> = cfg
        .as_ref()
        .map(crate::engine::bind::names::unread)
        .unwrap_or_default()
        .into_iter()
        .collect();
    let is_unread = |name: &str| unread.contains(name);
    let by_shard = verify::tensors_by_shard(&ck);
    for (k, tensors) in by_shard.into_iter().enumerate() {
        let digest = verify::scan_shard(
            &ck,
            k,
            tensors,
            &is_unread,
            sums.is_some(),
            &mut buf,
            &mut r.tensors,
            &mut p,
            &mut progress,
        );
        let name = &ck.index().shard_names()[k];
        if let (Some(sums), Some(d)) = (&sums, digest) {
            check_sum(sums, name, &hex(&d), &mut r, &mut p);
        }
    }
    if let (Some(sums), Some(file)) = (&sums, &args.sha256) {
        let shard_names = ck.index().shard_names();
        for name in shard_names {
            if !sums.contains_key(name) {
                p.push(format!(
                    "shard {} has no line in {}",
                    shown(Path::new(name)),
                    shown(file)
                ));
            }
        }
        for (name, (_, line)) in sums {
            if shard_names.contains(name) {
                continue;
            }
            let path = dir.join(name);
            if !path.is_file() {
                p.push(format!(
                    "{}: line {line}: names {}, which is not a file in {}",
                    shown(file),
                    shown(Path::new(name)),
                    shown(dir)
                ));
                continue;
            }
            match verify::sha256_file(&path, &mut buf) {
                Ok(d) => check_sum(sums, name, &hex(&d), &mut r, &mut p),
                Err(e) => p.push(format!("{}: {e}", shown(&path))),
            }
        }
    }

    check_tokenizer(dir, cfg.as_ref(), &mut r, &mut p);

    if let Some(t) = &trunk {
        let mut sbuf = Vec::new();
        r.trunk = Some(verify::compare_trunk(
            &ck,
            t,
            (&mut buf, &mut sbuf),
            &mut p,
            &mut progress,
        ));
    }
    bar.finish();
    let secs = start.elapsed().as_secs_f64();
    if args.json {
        print_json(args, &r, &p, secs);
    } else {
        print_text(args, &r, &p, secs);
    }
    Ok(if p.total() == 0 { 0 } else { 3 })
}

/// Compare the digest of `name` with its line in `sums`, if it has one.
fn check_sum(sums: &Sums, name: &str, got: &str, r: &mut Report, p: &mut Problems) {
    let Some((want, line)) = sums.get(name) else {
        return;
    };
    r.sums_checked += 1;
    if want == got {
        r.sums_matched += 1;
    } else {
        p.push(format!(
            "{}: SHA-256 {got}, the sums file (line {line}) says {want} (re-download it)",
            shown(Path::new(name))
        ));
    }
}

/// The rank file's every problem; when it has none, the full loader (special tokens, the
/// vocabulary size `config.json` declares).
fn check_tokenizer(dir: &Path, cfg: Option<&ModelConfig>, r: &mut Report, p: &mut Problems) {
    let before = p.total();
    let check = ranks::check_rank_file(&dir.join(tokenizer::RANK_FILE), &mut |s: String| p.push(s));
    r.tokenizer_entries = check.entries;
    r.unmerged = check.unmerged;
    if check.unmerged > 0 {
        r.warnings.push(format!(
            "{}: {} token(s) of two or more bytes cannot be made from two lower-ranked tokens \
             (ranks swapped, or tokens added outside the merges?), e.g. {}",
            shown(&dir.join(tokenizer::RANK_FILE)),
            check.unmerged,
            check.unmerged_examples.join(", ")
        ));
    }
    if p.total() > before {
        return;
    }
    let loaded = match cfg.map(|c| u32::try_from(c.vocab_size)) {
        Some(Ok(v)) => Tokenizer::load_expecting(dir, v),
        _ => Tokenizer::load(dir),
    };
    if let Err(e) = loaded {
        p.push(e.to_string());
    }
}

fn print_text(args: &VerifyArgs, r: &Report, p: &Problems, secs: f64) {
    let t = &r.tensors;
    println!("k3 verify {}", shown(&args.model_dir));
    println!(
        "  shards     {} ({}), sizes agree with the index and every header",
        r.shards,
        gb(r.shard_bytes)
    );
    println!(
        "  tensors    {} read ({}): {} all-zero{}, {} with NaN/Inf ({} values), {} with NaN \
         scales ({} bytes)",
        t.tensors,
        gb(t.tensor_bytes),
        t.all_zero,
        if t.all_zero_unread > 0 {
            format!(
                " (and {} the graph never reads, which may be)",
                t.all_zero_unread
            )
        } else {
            String::new()
        },
        t.non_finite,
        t.non_finite_values,
        t.nan_scale_tensors,
        t.nan_scales
    );
    if r.sums_given {
        println!(
            "  sha256     {} of {} listed files match",
            r.sums_matched, r.sums_checked
        );
    } else {
        println!("  sha256     not checked (no --sha256 FILE)");
    }
    println!("  tokenizer  {} ranks", r.tokenizer_entries);
    if let Some(tt) = &r.trunk {
        println!(
            "  trunk      {} layers{} compared ({} of trunk.bin): {} tensor(s) differ, {} bad \
             checksum(s)",
            tt.layers,
            if tt.head { " and the output head" } else { "" },
            gb(tt.trunk_bytes),
            tt.differing_tensors,
            tt.bad_checksums
        );
    }
    println!(
        "  read       {} in {secs:.1} s ({:.0} MB/s)",
        gb(r.shard_bytes),
        r.shard_bytes as f64 / 1e6 / secs.max(1e-9)
    );
    for w in &r.warnings {
        println!("warning: {w}");
    }
    if p.total() == 0 {
        println!("k3 verify: all checks passed");
        return;
    }
    println!("k3 verify: FAILED, {} problem(s):", p.total());
    for line in p.kept().iter().take(MAX_LISTED) {
        println!("  - {line}");
    }
    if p.total() > MAX_LISTED {
        println!("  … and {} more", p.total() - MAX_LISTED);
    }
}

fn print_json(args: &VerifyArgs, r: &Report, p: &Problems, secs: f64) {
    let t = &r.tensors;
    let v = json!({
        "ok": p.total() == 0,
        "model_dir": args.model_dir.display().to_string(),
        "shards": r.shards,
        "shard_bytes": r.shard_bytes,
        "tensors": t.tensors,
        "tensor_bytes": t.tensor_bytes,
        "all_zero_tensors": t.all_zero,
        "all_zero_unread_tensors": t.all_zero_unread,
        "non_finite_tensors": t.non_finite,
        "non_finite_values": t.non_finite_values,
        "nan_scale_tensors": t.nan_scale_tensors,
        "nan_scales": t.nan_scales,
        "sha256": r.sums_given.then(|| json!({
            "checked": r.sums_checked,
            "matched": r.sums_matched,
        })),
        "tokenizer_ranks": r.tokenizer_entries,
        "tokenizer_unmerged": r.unmerged,
        "trunk": r.trunk.as_ref().map(|tt| json!({
            "layers": tt.layers,
            "head": tt.head,
            "trunk_bytes": tt.trunk_bytes,
            "differing_tensors": tt.differing_tensors,
            "bad_checksums": tt.bad_checksums,
        })),
        "seconds": secs,
        "peak_rss_bytes": crate::stream::stats::rss_bytes().1,
        "problem_count": p.total(),
        "problems": p.kept(),
        "warnings": r.warnings,
    });
    println!("{v}");
}
