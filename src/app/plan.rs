//! `k3 plan`: print the memory plan for a checkpoint and a budget, before loading anything.

use super::budget_args::{auto_request, BudgetArgs};
use crate::engine::config::ModelConfig;
use crate::engine::weights::model_sizes;
use crate::stream::budget::{self, gb, BudgetRequest};
use crate::stream::trunk::Trunk;
use crate::stream::Checkpoint;
use crate::{Error, Result};
use clap::Args;
use std::path::PathBuf;

/// Arguments of `k3 plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Checkpoint directory; default: the small demo model built into k3.
    pub model_dir: Option<PathBuf>,
    /// The budget (default: 80% of the memory available now).
    #[command(flatten)]
    pub budget: BudgetArgs,
    /// Positions of context to reserve state for [default: 4096; with --chat, the context
    /// `k3 chat` plans for: the config file's `sampling.context`, else 32768].
    #[arg(long)]
    pub context: Option<u64>,
    /// Plan as `k3 chat` does: its context, and room for the snapshots a conversation keeps
    /// beside its live state (`k3 run` and `k3 bench` keep one state).
    #[arg(long)]
    pub chat: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Most sequences [`sequences_fit`] counts up to: the rows whose activations the plan
/// reserves, the most `k3 run --prompts --parallel` takes.
const MAX_SEQUENCES: u64 = budget::MIN_PREFILL_CHUNK;

/// How many sequences decoded together (docs/batching.md) fit `req` at `context` positions
/// each: the most whose states the plan can hold above its floor (each sequence's state is
/// counted against the budget), at most [`MAX_SEQUENCES`]. None for a request without a budget.
fn sequences_fit(
    sizes: &budget::ModelSizes,
    req: BudgetRequest,
    context: u64,
    limit: Option<u64>,
) -> Option<u64> {
    if matches!(req, BudgetRequest::Resident) && limit.is_none() {
        return None;
    }
    let fits = |n: u64| budget::plan_states(sizes, req, context, n, limit).is_ok();
    if !fits(1) {
        return Some(0);
    }
    // The floor grows with every state: the largest n that fits, by bisection.
    let (mut lo, mut hi) = (1, MAX_SEQUENCES);
    if fits(hi) {
        return Some(hi);
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

/// Run `k3 plan`.
/// Over 100 lines: one plan and its report, as JSON or as the text table, figure by figure.
pub fn run(args: &PlanArgs) -> Result<()> {
    let model_dir = match &args.model_dir {
        Some(d) => d.clone(),
        None => super::demo::materialise()?,
    };
    let cfg = ModelConfig::load(&model_dir.join("config.json"))?;
    let ck = Checkpoint::open(&model_dir)?;
    let mut sizes = model_sizes(&cfg, &ck);
    let trunk = match &args.budget.trunk {
        Some(dir) => Some(Trunk::open(dir, &ck, cfg.num_hidden_layers)?),
        None => None,
    };
    if let Some(t) = &trunk {
        t.manifest()
            .sizes_into(&mut sizes, crate::engine::bind::names::LM_HEAD);
    }
    let req = args.budget.request(auto_request())?;
    let index_bytes = ck.index().memory_bytes();
    let n_tensors = ck.index().len();
    let states = if args.chat {
        1 + crate::session::chat::SNAPSHOTS as u64
    } else {
        1
    };
    let context = match (args.context, args.chat) {
        (Some(c), _) => c,
        (None, false) => 4096,
        (None, true) => {
            let cfg = super::config::Config::load().map_err(|e| Error::Usage(e.to_string()))?;
            cfg.sampling
                .context
                .unwrap_or(crate::session::defaults::built_in().context_limit)
                .max(2) as u64
        }
    };
    let plan = budget::plan_states(&sizes, req, context, states, budget::cgroup_limit());
    let plan = match plan {
        Ok(p) => p,
        Err(e) if args.json => {
            let j = serde_json::json!({
                "model_bytes": sizes.model_bytes(),
                "budget_bytes": e.budget,
                "floor_bytes": e.floor,
                "shortfall_bytes": e.floor - e.budget,
                "fits": false,
            });
            println!("{j}");
            return Err(Error::Usage(e.to_string()));
        }
        Err(e) => return Err(Error::Usage(e.to_string())),
    };
    let seq_fit = sequences_fit(&sizes, req, context, budget::cgroup_limit());
    let seq_state = sizes.state_bytes + sizes.kv_per_position * context;
    if args.json {
        let mut j = serde_json::to_value(&plan).map_err(|e| Error::Usage(e.to_string()))?;
        if let Some(o) = j.as_object_mut() {
            o.insert("sequences_fit".into(), seq_fit.into());
            o.insert("sequence_state_bytes".into(), seq_state.into());
            o.insert("planned_bytes".into(), plan.planned_bytes(&sizes).into());
            o.insert("index_bytes".into(), index_bytes.into());
            o.insert("tensors".into(), n_tensors.into());
            if let Some(t) = &trunk {
                o.insert(
                    "trunk".into(),
                    serde_json::json!({
                        "dir": t.dir().display().to_string(),
                        "bytes": t.manifest().total_bytes,
                        "decoded_bytes": sizes.layer_trunk.iter().sum::<u64>(),
                        "streamed_read_per_token": streamed_per_token(t, &plan.pinned).0,
                        "streamed_decoded_per_token": streamed_per_token(t, &plan.pinned).1,
                        "layers": t.manifest().n_layers,
                    }),
                );
            }
            o.insert(
                "sizes".into(),
                serde_json::to_value(&sizes).unwrap_or_default(),
            );
        }
        println!("{j}");
        return Ok(());
    }
    let budget_text = match (req, plan.budget_bytes) {
        (BudgetRequest::Resident, _) | (_, None) => "resident (no budget)".to_string(),
        (_, Some(b)) => gb(b),
    };
    println!(
        "model        {} of weights, {} tensors (index {:.1} B/tensor)",
        gb(plan.model_bytes),
        n_tensors,
        index_bytes as f64 / n_tensors.max(1) as f64
    );
    println!(
        "budget       {budget_text}; floor {}; fits {} (for a context of {} positions, --context; \
         k3 chat plans for its own, 32768 by default)",
        gb(plan.floor_bytes),
        plan.fits,
        context
    );
    // Pinned layers of an encoded trunk hold their nibble-coded matrices as stored.
    let pinned_decoded: u64 = (0..plan.pinned.len())
        .filter(|&il| plan.pinned[il])
        .map(|il| sizes.layer_trunk[il])
        .sum();
    let held = if pinned_decoded > plan.pinned_bytes {
        format!(
            "{} held coded for {} of weights",
            gb(plan.pinned_bytes),
            gb(pinned_decoded)
        )
    } else {
        gb(plan.pinned_bytes)
    };
    let which = match layer_ranges(&plan.pinned) {
        r if r.is_empty() || plan.n_pinned() == plan.pinned.len() => String::new(),
        r => format!("{r}; "),
    };
    println!(
        "layers       {} of {} pinned ({which}{held}), ring {} slot(s) ({}{})",
        plan.n_pinned(),
        plan.pinned.len(),
        plan.ring_slots,
        gb(plan.ring_bytes),
        if plan.ring_coded {
            ", layers read as stored and multiplied coded"
        } else {
            ""
        }
    );
    println!(
        "experts      {} cache slots ({}){}",
        plan.expert_slots,
        gb(plan.expert_cache_bytes),
        if plan.load_expert_slots < plan.expert_slots {
            format!(
                ", {} while pinned layers load through the staging",
                plan.load_expert_slots
            )
        } else {
            String::new()
        }
    );
    println!(
        "embedding    {}",
        if plan.embed_resident {
            "resident"
        } else {
            "rows read on demand"
        }
    );
    println!(
        "output head  {}",
        if plan.head_resident && sizes.held_head(&plan) < sizes.head {
            format!(
                "resident, held coded as the trunk stores it ({} for {})",
                gb(sizes.held_head(&plan)),
                gb(sizes.head)
            )
        } else if plan.head_resident {
            "resident".to_string()
        } else {
            match sizes.head_rows_encoded(plan.head_chunk_rows) {
                Some(rows) => format!(
                    "streamed from the trunk's encoded head ({} read for {}), decoded {rows} \
                     rows at a time",
                    gb(sizes.head_stored),
                    gb(sizes.head)
                ),
                None => format!("streamed in chunks of {} rows", plan.head_chunk_rows),
            }
        }
    );
    println!(
        "state        {} for {} positions × {} state(s){}; fixed {}",
        gb(plan.state_reserve),
        context,
        plan.states,
        if args.chat { " (chat)" } else { "" },
        gb(plan.fixed_bytes)
    );
    println!(
        "sequences    {} decoded together fit ({} of state each at {} positions; k3 run \
         --prompts --parallel, k3 bench --sequences)",
        seq_fit.map_or("no budget: any number".to_string(), |n| {
            if n >= MAX_SEQUENCES {
                format!("{n} or more")
            } else {
                n.to_string()
            }
        }),
        gb(seq_state),
        context
    );
    if let Some(t) = &trunk {
        let m = t.manifest();
        let (read, decoded) = streamed_per_token(t, &plan.pinned);
        println!(
            "trunk        {} ({} layers, {} in trunk.bin for {} of weights, checked against this \
             checkpoint); streamed per token: {} read for {} decoded",
            crate::stream::shown(t.dir()),
            m.n_layers,
            gb(m.total_bytes),
            gb(sizes.layer_trunk.iter().sum::<u64>()),
            gb(read),
            gb(decoded)
        );
        let run = sizes.layer_staged.iter().copied().max().unwrap_or(0);
        if run > 0 && plan.stage_bytes == 0 {
            println!("staging      none: every encoded layer is read as it is stored");
        } else if run > 0 {
            println!(
                "staging      {} in the ring for encoded runs of up to {}{}",
                gb(plan.stage_bytes),
                gb(run),
                match (plan.stage_only_to_load(), plan.stage_bytes < run) {
                    (true, _) => " (only while pinned layers load: every layer is pinned)",
                    (false, true) => " (longer runs are read through it as a window)",
                    (false, false) => "",
                }
            );
        }
    }
    println!("planned      {}", gb(plan.planned_bytes(&sizes)));
    Ok(())
}

/// Bytes of `trunk.bin` read per token for the layers `pinned` leaves streamed, and the bytes
/// of weights they decode to (docs/trunk-codec.md).
fn streamed_per_token(t: &Trunk, pinned: &[bool]) -> (u64, u64) {
    t.manifest()
        .layers
        .iter()
        .filter(|l| !pinned.get(l.layer).copied().unwrap_or(false))
        .fold((0, 0), |(r, d), l| {
            (
                r + l.nbytes,
                d + l.tensors.values().map(|t| t.nbytes).sum::<u64>(),
            )
        })
}

/// The layers set in `pinned` as ranges: `0-4, 7`.
fn layer_ranges(pinned: &[bool]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut il = 0;
    while il < pinned.len() {
        if !pinned[il] {
            il += 1;
            continue;
        }
        let start = il;
        while il + 1 < pinned.len() && pinned[il + 1] {
            il += 1;
        }
        out.push(if il == start {
            format!("{start}")
        } else {
            format!("{start}-{il}")
        });
        il += 1;
    }
    out.join(", ")
}

#[cfg(test)]
mod tests {
    use super::layer_ranges;

    #[test]
    fn pinned_layers_are_named_as_ranges() {
        let set = |ids: &[usize]| {
            let mut p = vec![false; 12];
            for &i in ids {
                p[i] = true;
            }
            layer_ranges(&p)
        };
        assert_eq!(set(&[0, 1, 2, 3, 4, 7]), "0-4, 7");
        assert_eq!(set(&[3, 5, 6, 11]), "3, 5-6, 11");
        assert_eq!(set(&[]), "");
        assert_eq!(set(&(0..12).collect::<Vec<_>>()), "0-11");
    }
}
