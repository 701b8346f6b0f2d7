//! The memory budget planner: from one total budget (or a preset, or separate trunk and cache
//! budgets) and the model's byte sizes, decide which layers stay pinned, how many layers the
//! read-ahead ring holds, how many routed experts the cache holds, and whether the output head
//! stays resident. A budget below the smallest one that can run is refused with the floor, the
//! budget and the shortfall. A budget only changes where bytes come from, never the arithmetic.

use serde::Serialize;

/// Byte sizes of a model, as the planner needs them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelSizes {
    /// Non-expert bytes of each layer.
    pub layer_trunk: Vec<u64>,
    /// Bytes of each layer's stored run when a packed trunk holds it encoded, else 0 (empty:
    /// none encoded).
    pub layer_staged: Vec<u64>,
    /// Bytes a read of each encoded layer stages before decoding it (into its ring slot, or a
    /// pinned layer's allocation): the window of its run the decoder needs
    /// (`stream::trunk::Manifest::window_lens`), at most the run; 0 for a layer read as it
    /// lies (empty: as `layer_staged`). The ring keeps one staging buffer, of the largest of
    /// these.
    pub layer_window: Vec<u64>,
    /// Bytes each layer holds when pinned, where that differs from `layer_trunk`: a layer of
    /// an encoded trunk keeps its nibble-coded matrices as stored
    /// (`stream::trunk::Manifest::held_lens`); 0 (or empty) for a layer held as
    /// `layer_trunk` says.
    pub layer_pinned: Vec<u64>,
    /// Bytes of each layer's stored run where it can be read in place, as it lies, and
    /// multiplied coded there (`stream::trunk::Manifest::in_place_lens`: every encoded tensor
    /// nibble-coded, every encoded matrix held coded); 0 (or empty) for a layer that cannot. Where the plan
    /// holds layers coded, such a layer streams through a ring slot of its run's size with
    /// no staging and no decoding, and is pinned the same way.
    pub layer_in_place: Vec<u64>,
    /// Bytes of one routed expert (its six MXFP4 tensors).
    pub expert_bytes: u64,
    /// Routed experts per MoE layer.
    pub experts_per_layer: u64,
    /// MoE layers.
    pub moe_layers: u64,
    /// Experts per token.
    pub top_k: u64,
    /// Embedding bytes.
    pub embed: u64,
    /// Output head bytes.
    pub head: u64,
    /// Bytes the output head is stored in where the packed trunk holds it encoded
    /// (`stream::trunk::Manifest::head`); 0 where it is read from the checkpoint as it is.
    pub head_stored: u64,
    /// Bytes the output head holds when resident, where that differs from `head`: a head
    /// stored nibble-coded is held coded beside pinned layers held coded
    /// (`stream::trunk::Manifest::head_held`); 0 for a head held as `head` says.
    pub head_pinned: u64,
    /// Final norm and aggregator vectors.
    pub small: u64,
    /// Bytes of one embedding (or head) row.
    pub row_bytes: u64,
    /// Carried state of a sequence that does not grow with positions (KDA).
    pub state_bytes: u64,
    /// Carried state per position (MLA latent cache).
    pub kv_per_position: u64,
    /// What a speculative verification pass records per position to roll back (KDA layers),
    /// and what its rollback computes in per position.
    pub kda_record_per_position: u64,
    /// Carried state of one KDA layer (the scratch copy a verification pass computes on) and
    /// the rollback's fixed scratch.
    pub kda_layer_state: u64,
    /// Hidden width.
    pub hidden: u64,
    /// Vocabulary.
    pub vocab: u64,
    /// What the buffers of a forward call hold at most, beyond the logits: these bytes, plus
    /// `activation_per_token` per token of the call and `activation_per_position` per
    /// position its sequence reserves (the engine's `activation_sizes`).
    pub activation_fixed: u64,
    pub activation_per_token: u64,
    pub activation_per_position: u64,
    /// Whether the kernels multiply nibble-coded weights faster than BF16 ones read from
    /// memory (`kernels::coded_outruns_bf16`: the SIMD paths). Where holding the trunk's
    /// pinned layers and head coded leaves as few trunk bytes to read a token as holding them
    /// decoded, they are then held coded (fewer bytes touched, faster products, more expert
    /// slots), else decoded.
    pub coded_first: bool,
}

impl ModelSizes {
    /// Bytes of the packed trunk a token reads with the layers `pinned` and the head resident
    /// or not: the streamed layers' runs and, where the head streams, its stored bytes.
    #[must_use]
    pub fn read_bytes(&self, pinned: &[bool], head_resident: bool) -> u64 {
        let layers: u64 = (0..pinned.len())
            .filter(|&il| !pinned[il])
            .map(|il| match self.layer_staged.get(il) {
                Some(&b) if b > 0 => b,
                _ => self.layer_trunk[il],
            })
            .sum();
        let head = match (head_resident, self.head_stored) {
            (true, _) => 0,
            (false, 0) => self.head,
            (false, b) => b,
        };
        layers + head
    }

    /// Bytes layer `il` holds when pinned.
    #[must_use]
    pub fn pinned_layer(&self, il: usize) -> u64 {
        match self.layer_pinned.get(il) {
            Some(&b) if b > 0 => b,
            _ => self.layer_trunk[il],
        }
    }

    /// Bytes the output head holds when resident: coded (`head_pinned`) where there is
    /// such a size, else `head`.
    #[must_use]
    pub fn pinned_head(&self) -> u64 {
        match self.head_pinned {
            0 => self.head,
            b => b,
        }
    }

    /// Bytes a resident output head holds under `plan`: coded where the plan holds it so.
    #[must_use]
    pub fn held_head(&self, plan: &Plan) -> u64 {
        if plan.head_coded {
            self.pinned_head()
        } else {
            self.head
        }
    }

    /// Rows at a time a head stored encoded is streamed in (decoded from its stored bytes)
    /// where that fits in the bytes `rows` rows read raw take: its decoded rows, the block that
    /// completes them and the stored bytes read ahead (`stream::trunk::head_scratch`). None
    /// where it does not fit (a head smaller than a few codec blocks) or the head is not
    /// stored encoded: it is then read raw from the checkpoint.
    #[must_use]
    pub fn head_rows_encoded(&self, rows: u64) -> Option<u64> {
        if self.head_stored == 0 || self.row_bytes == 0 {
            return None;
        }
        let (cols, values) = (self.row_bytes / 2, self.head / 2);
        let room = rows * self.row_bytes;
        let (_, enc) = super::trunk::head_scratch(1, cols, values, self.head_stored);
        let block = 2 * super::codec::BLOCK_ELEMS as u64;
        let fit = room.checked_sub(enc + block)? / self.row_bytes;
        let fit = fit.min(self.vocab);
        let (dec, enc) = super::trunk::head_scratch(fit, cols, values, self.head_stored);
        (fit > 0 && 2 * dec + enc <= room).then_some(fit)
    }

    /// Bytes every layer pinned holds.
    #[must_use]
    pub fn pinned_trunk(&self) -> u64 {
        (0..self.layer_trunk.len())
            .map(|il| self.pinned_layer(il))
            .sum()
    }

    /// Bytes of every weight in the checkpoint.
    #[must_use]
    pub fn model_bytes(&self) -> u64 {
        self.layer_trunk.iter().sum::<u64>()
            + self.expert_bytes * self.experts_per_layer * self.moe_layers
            + self.embed
            + self.head
            + self.small
    }
}

/// What the user asked for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BudgetRequest {
    /// Hold everything in memory.
    Resident,
    /// One total budget in bytes.
    Total(u64),
    /// Separate trunk and expert-cache budgets in bytes; together they are the budget (the
    /// fixed costs come out of the cache's share first).
    Split {
        /// Trunk budget (`None`: the whole trunk resident, the peers' `--trunk-gb 0`).
        trunk: Option<u64>,
        /// Expert-cache budget.
        cache: u64,
    },
}

/// Named presets: (trunk GB, cache GB), as the reference defines them.
pub const PRESETS: [(&str, f64, f64); 6] = [
    ("ultra", 2.5, 0.31),
    ("laptop", 3.0, 1.0),
    ("desktop", 16.0, 10.0),
    ("workstation", 60.0, 30.0),
    ("server", 110.0, 13.0),
    ("max", 110.0, 109.0),
];

/// The request for a preset name, if it is one.
#[must_use]
pub fn preset(name: &str) -> Option<BudgetRequest> {
    PRESETS
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|&(_, t, c)| BudgetRequest::Split {
            trunk: Some((t * 1e9) as u64),
            cache: (c * 1e9) as u64,
        })
}

/// A memory plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// Bytes of weights in the checkpoint.
    pub model_bytes: u64,
    /// The budget the plan was made for (`None`: everything resident).
    pub budget_bytes: Option<u64>,
    /// The smallest total budget that runs.
    pub floor_bytes: u64,
    /// Whether the budget covers the plan.
    pub fits: bool,
    /// Per layer: pinned (held) or streamed through the ring.
    pub pinned: Vec<bool>,
    /// Layers the ring holds at once (0 when every layer is pinned).
    pub ring_slots: u64,
    /// Bytes of the ring: its slots, and the staging buffer of encoded layers where layers
    /// stream (0 when every layer is pinned: the staging is then held only while they load).
    pub ring_bytes: u64,
    /// Bytes of the staging buffer encoded layers are read through (0: none stored encoded):
    /// their largest run, or a window of it where the budget is tight. Where every layer is
    /// pinned it is held only while pinned layers load, and its bytes then go to the expert
    /// cache ([`Plan::load_expert_slots`]).
    pub stage_bytes: u64,
    /// Routed experts the cache holds.
    pub expert_slots: u64,
    /// Routed experts the cache holds while pinned layers load: fewer than `expert_slots`
    /// where the staging is held only to load them (every layer pinned) and the budget has
    /// no room for both.
    pub load_expert_slots: u64,
    /// Bytes of the expert cache.
    pub expert_cache_bytes: u64,
    /// Whether the embedding is held (else rows are read on demand).
    pub embed_resident: bool,
    /// Whether the output head is held (else it is streamed in chunks).
    pub head_resident: bool,
    /// Rows of the output head per streamed chunk.
    pub head_chunk_rows: u64,
    /// Bytes reserved for the carried state at the context limit, for every state the plan
    /// holds (the live one and the snapshots a chat keeps).
    pub state_reserve: u64,
    /// Sequence states the reserve covers (1 + snapshots).
    pub states: u64,
    /// Fixed overheads (activations, logits, index, allocator slack).
    pub fixed_bytes: u64,
    /// Prompt tokens per prefill chunk the activation reserve is sized for: a longer chunk
    /// reads each routed expert once for more tokens.
    pub prefill_chunk: u64,
    /// Bytes of pinned layers.
    pub pinned_bytes: u64,
    /// Whether pinned layers of an encoded trunk keep their nibble-coded matrices coded
    /// (`ModelSizes::layer_pinned`): chosen where that leaves fewer trunk bytes to read a
    /// token than holding them decoded, or as many and the coded products are the faster
    /// ones (`ModelSizes::coded_first`, `plan_states`). False where no layer is pinned.
    pub pin_coded: bool,
    /// Whether a resident output head is held coded as the trunk stores it
    /// (`ModelSizes::head_pinned`).
    pub head_coded: bool,
    /// Whether the ring holds the layers that can be read in place
    /// (`ModelSizes::layer_in_place`) as they lie, multiplied coded, in slots of their
    /// runs' size; those not read in place are decoded into slots as before. Chosen with
    /// holding pinned layers coded (the same products on the same bytes).
    pub ring_coded: bool,
}

impl Plan {
    /// Number of pinned layers.
    #[must_use]
    pub fn n_pinned(&self) -> usize {
        self.pinned.iter().filter(|&&p| p).count()
    }

    /// Bytes of the packed trunk a token reads: its streamed layers' runs and, where the head
    /// streams, its stored bytes.
    #[must_use]
    pub fn trunk_read_bytes(&self, s: &ModelSizes) -> u64 {
        s.read_bytes(&self.pinned, self.head_resident)
    }

    /// Whether the staging is held only while pinned layers load (every layer is pinned, so
    /// no layer streams through it after).
    #[must_use]
    pub fn stage_only_to_load(&self) -> bool {
        self.stage_bytes > 0 && self.pinned.iter().all(|&p| p)
    }

    /// Planned resident bytes in total: the larger of what loading the pinned layers holds
    /// (with the staging, where it is held only to load them, and the expert slots of
    /// [`Plan::load_expert_slots`]) and what the plan holds after.
    #[must_use]
    pub fn planned_bytes(&self, sizes: &ModelSizes) -> u64 {
        let slot = expert_slot_bytes(sizes);
        let after = self.held_bytes(sizes, self.expert_cache_bytes);
        if self.stage_only_to_load() {
            let fewer = self.expert_slots.saturating_sub(self.load_expert_slots) * slot;
            let loading = self.held_bytes(sizes, self.expert_cache_bytes.saturating_sub(fewer))
                + self.stage_bytes;
            after.max(loading)
        } else {
            after
        }
    }

    /// Resident bytes with `experts` bytes of expert cache and no staging beyond `ring_bytes`.
    fn held_bytes(&self, sizes: &ModelSizes, experts: u64) -> u64 {
        self.fixed_bytes
            + self.state_reserve
            + self.pinned_bytes
            + self.ring_bytes
            + experts
            + if self.embed_resident {
                sizes.embed
            } else {
                sizes.row_bytes * 64
            }
            + if self.head_resident {
                sizes.held_head(self)
            } else {
                self.head_chunk_rows * sizes.row_bytes
            }
            + sizes.small
    }
}

/// A budget that cannot run.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error(
    "a budget of {} is below the floor of {} for this model (short by {}); \
     give at least {}",
    gb(*.budget), gb(*.floor), gb(.floor - .budget), gb(*.floor)
)]
pub struct BelowFloor {
    /// The budget asked for.
    pub budget: u64,
    /// The floor.
    pub floor: u64,
}

/// Bytes as decimal GB text.
#[must_use]
pub fn gb(b: u64) -> String {
    if b >= 1_000_000_000 {
        format!("{:.2} GB", b as f64 / 1e9)
    } else {
        format!("{:.1} MB", b as f64 / 1e6)
    }
}

/// The smallest prefill chunk (tokens), the one the floor is computed for.
pub const MIN_PREFILL_CHUNK: u64 = 64;

/// The longest prefill chunk whose extra activations (beyond the floor's 64 tokens) fit in
/// `spare` and take at most 1/16 of `budget`: (chunk, extra bytes). Where layers stream, each
/// chunk reads them once, so doubling the chunk halves a long prompt's trunk reads for a
/// few percent of the budget (`k3mini-2048` at `--mem 1`: 128 tokens for 36 MB).
fn prefill_chunk(s: &ModelSizes, budget: Option<u64>, spare: u64) -> (u64, u64) {
    for c in [512u64, 256, 128] {
        let extra = (c - MIN_PREFILL_CHUNK) * s.activation_per_token;
        if extra <= spare && budget.is_none_or(|b| extra <= b / 16) {
            return (c, extra);
        }
    }
    (MIN_PREFILL_CHUNK, 0)
}

/// Rows of the output head read per chunk when it is streamed.
const HEAD_CHUNK_BYTES: u64 = 64 << 20;

/// Bytes one routed expert takes in memory: a slot of the expert arena (its aligned read
/// window; `stream::arena`). The expert cache is that many bytes per expert slot.
#[must_use]
pub fn expert_slot_bytes(s: &ModelSizes) -> u64 {
    super::arena::slot_bytes(s.expert_bytes)
}

/// Arena slots beyond the cache's expert slots: a layer's reads that are not cached (at most
/// top-k at once) and experts a pass still holds after the cache evicted them (top-k more).
#[must_use]
pub fn in_flight_slots(s: &ModelSizes) -> u64 {
    2 * s.top_k
}

/// Fixed overhead: the buffers of a 64-token prefill chunk at a context of `context`
/// positions, two logits rows, the arena slots of expert reads in flight
/// ([`in_flight_slots`]), the piece buffer of a trunk read (8 MiB), and allocator slack.
fn fixed_overhead(s: &ModelSizes, context: u64) -> u64 {
    s.activation_fixed
        + MIN_PREFILL_CHUNK * s.activation_per_token
        + context * s.activation_per_position
        + 2 * s.vocab * 4
        + in_flight_slots(s) * expert_slot_bytes(s)
        + spec_reserve(s)
        + (40 << 20)
}

/// Longest draft a speculative pass verifies (so a pass is at most `1 + SPEC_MAX_DRAFT` tokens,
/// well inside the activations of a prefill chunk).
pub const SPEC_MAX_DRAFT: usize = 8;

/// Memory of one speculative verification pass beyond a prefill chunk's: the scratch copy of a
/// KDA layer's state it computes on, what each of its positions records for the rollback and
/// what the rollback computes in, and its logits (counted twice: the chunk's rows, which the
/// speculator hands out in place, and the copy a caller may take of the row in use).
#[must_use]
pub fn spec_reserve(s: &ModelSizes) -> u64 {
    let tokens = SPEC_MAX_DRAFT as u64 + 1;
    s.kda_layer_state + tokens * (s.kda_record_per_position + 2 * s.vocab * 4)
}

/// How the ring holds each layer: the bytes of its slot, the bytes a slot keeps for it once
/// it has held it (a layer read in place keeps its kernels' index with each slot it has been
/// in), and what a read of it stages (its run, and the least window of it; 0 for a layer read
/// as it lies).
struct RingSizes {
    slot: Vec<u64>,
    kept: Vec<u64>,
    staged: Vec<u64>,
    window: Vec<u64>,
}

impl RingSizes {
    /// The ring of `s`, its layers read in place where `in_place` and `s` say they can be.
    fn of(s: &ModelSizes, in_place: bool) -> RingSizes {
        let n = s.layer_trunk.len();
        let place = |i: usize| {
            let b = s.layer_in_place.get(i).copied().unwrap_or(0);
            (in_place && b > 0).then_some(b)
        };
        let staged = |i: usize| match place(i) {
            Some(_) => 0,
            None => s.layer_staged.get(i).copied().unwrap_or(0),
        };
        RingSizes {
            slot: (0..n)
                .map(|i| place(i).unwrap_or(s.layer_trunk[i]))
                .collect(),
            kept: (0..n)
                .map(|i| place(i).map_or(0, |b| s.pinned_layer(i).saturating_sub(b)))
                .collect(),
            staged: (0..n).map(staged).collect(),
            window: (0..n)
                .map(|i| match s.layer_window.get(i) {
                    Some(&w) if s.layer_window.len() == n => w.min(staged(i)),
                    _ => staged(i),
                })
                .collect(),
        }
    }

    /// Bytes of the ring when the layers not `pinned` stream: its two largest slots, what
    /// each slot keeps of every layer it may hold, and the staging buffer encoded runs are
    /// read through (`stage` bytes), streamed or pinned (a pinned layer stored encoded is
    /// read through it and decoded from there when it is loaded).
    fn need(&self, pinned: &[bool], stage: u64) -> u64 {
        let streamed = || (0..self.slot.len()).filter(|&i| !pinned[i]);
        let mut rest: Vec<u64> = streamed().map(|i| self.slot[i]).collect();
        rest.sort_unstable_by(|a, b| b.cmp(a));
        let slots = rest.len().min(2) as u64;
        let kept: u64 = streamed().map(|i| self.kept[i]).sum();
        rest.iter().take(2).sum::<u64>() + slots * kept + stage
    }

    /// The staging encoded runs can be read through: the least (the largest window a
    /// layer's run needs, `ModelSizes::layer_window`), and the largest run, which holds
    /// every run whole.
    fn stagings(&self) -> (u64, u64) {
        let most = |v: &[u64]| v.iter().copied().max().unwrap_or(0);
        let full = most(&self.staged);
        (most(&self.window).min(full), full)
    }

    /// The staging that reads every streamed layer's run whole when the layers `pinned` are
    /// pinned: the largest streamed run, and for a pinned layer (read through it once, when
    /// it is loaded) its window. A large pinned layer (the dense first one) then no longer
    /// sets the staging every other layer streams through.
    fn whole(&self, pinned: &[bool]) -> u64 {
        let (window, full) = self.stagings();
        (0..self.staged.len())
            .map(|i| {
                if pinned[i] {
                    self.window[i]
                } else {
                    self.staged[i]
                }
            })
            .max()
            .unwrap_or(0)
            .max(window)
            .min(full)
    }
}

/// Make a plan for `req`, with room for one sequence state of `context` positions. A memory
/// limit from the environment (a cgroup) caps a total budget.
pub fn plan(
    s: &ModelSizes,
    req: BudgetRequest,
    context: u64,
    env_limit: Option<u64>,
) -> Result<Plan, BelowFloor> {
    plan_states(s, req, context, 1, env_limit)
}

/// [`plan`] with room for `states` sequence states of `context` positions each (a chat's live
/// state and the snapshots it keeps to reuse a prompt's prefix).
///
/// Pinned layers and the output head of an encoded trunk are held coded
/// (`ModelSizes::layer_pinned`, `ModelSizes::head_pinned`) where that leaves fewer trunk bytes
/// to read a token than holding them decoded, and where it leaves as many and the kernels
/// multiply coded weights faster than decoded ones (`ModelSizes::coded_first`): a coded matrix
/// takes less memory, and on the SIMD paths its product is faster when the weights come from
/// memory; on the scalar path a decoded one multiplies faster (docs/trunk-codec.md).
pub fn plan_states(
    s: &ModelSizes,
    req: BudgetRequest,
    context: u64,
    states: u64,
    env_limit: Option<u64>,
) -> Result<Plan, BelowFloor> {
    // Candidates, in order of preference where they read as many bytes a token: everything
    // decoded (unless the coded products are the faster ones), everything coded, layers coded
    // with the head decoded (a head held coded first may leave no room for a large layer it
    // would have pinned).
    let decoded = ModelSizes {
        layer_pinned: Vec::new(),
        layer_in_place: Vec::new(),
        head_pinned: 0,
        ..s.clone()
    };
    // The floor is the least budget any of them runs in: held coded, layers read in place may
    // need less than decoded ones (no staging, smaller slots), or more (what each slot keeps).
    let floor_of =
        |s: &ModelSizes| match plan_held(s, BudgetRequest::Total(0), context, states, None) {
            Ok(p) => p.floor_bytes,
            Err(e) => e.floor,
        };
    let lowest = floor_of(s).min(floor_of(&decoded));
    let at_lowest = |mut p: Plan| {
        p.floor_bytes = p.floor_bytes.min(lowest);
        p
    };
    // Below the coded plan's floor, the decoded one's may still fit.
    let coded = match plan_held(s, req, context, states, env_limit) {
        Ok(p) => p,
        Err(e) => {
            let d = plan_held(&decoded, req, context, states, env_limit);
            return d
                .map(at_lowest)
                .map_err(|d| if d.floor < e.floor { d } else { e });
        }
    };
    if !coded.pin_coded && !coded.head_coded && !coded.ring_coded {
        return Ok(at_lowest(coded));
    }
    let head_decoded = ModelSizes {
        head_pinned: 0,
        ..s.clone()
    };
    let reads = |p: &Plan| p.trunk_read_bytes(s);
    let mut best = coded;
    if let Ok(p) = plan_held(&decoded, req, context, states, env_limit) {
        if reads(&p) < reads(&best) || (reads(&p) == reads(&best) && !s.coded_first) {
            best = p;
        }
    }
    if let Ok(p) = plan_held(&head_decoded, req, context, states, env_limit) {
        if reads(&p) < reads(&best) {
            best = p;
        }
    }
    Ok(at_lowest(best))
}

/// [`plan_states`] with pinned layers held as `s.layer_pinned` says.
/// Over 100 lines: one derivation of the plan from the sizes; each kind of budget is a branch
/// over the same floor and reserves.
fn plan_held(
    s: &ModelSizes,
    req: BudgetRequest,
    context: u64,
    states: u64,
    env_limit: Option<u64>,
) -> Result<Plan, BelowFloor> {
    let n = s.layer_trunk.len();
    let pin_coded = s.layer_pinned.iter().any(|&b| b > 0);
    let states = states.max(1);
    let state_reserve = states * (s.state_bytes + s.kv_per_position * context);
    let fixed = fixed_overhead(s, context);
    let head_chunk_rows = (HEAD_CHUNK_BYTES / s.row_bytes.max(1)).clamp(1, s.vocab.max(1));
    // The floor stages encoded runs through a window; a budget with room for it stages them
    // whole (a window costs a copy of part of a run now and then).
    // Held coded, the layers that can be are read in place and stream the same way.
    let ring = RingSizes::of(s, pin_coded);
    let ring_coded = pin_coded && s.layer_in_place.iter().any(|&b| b > 0);
    let (window, full_stage) = ring.stagings();
    let ring_min = ring.need(&vec![false; n], window);
    let slot = expert_slot_bytes(s);
    let floor = fixed
        + state_reserve
        + ring_min
        + s.top_k * slot
        + head_chunk_rows * s.row_bytes
        + 64 * s.row_bytes
        + s.small;
    let model_bytes = s.model_bytes();
    // What holding everything takes: the trunk's layers and the head as pinned they are held.
    let held_bytes = model_bytes - s.layer_trunk.iter().sum::<u64>() - s.head
        + s.pinned_trunk()
        + s.pinned_head();
    let all_experts = s.experts_per_layer * s.moe_layers;
    // A budget that holds everything still reads experts into arena slots, each a little
    // larger than its expert.
    let slot_slack = all_experts * (slot - s.expert_bytes);
    let resident = Plan {
        model_bytes,
        budget_bytes: None,
        floor_bytes: floor,
        fits: true,
        pinned: vec![true; n],
        ring_slots: 0,
        ring_bytes: 0,
        stage_bytes: full_stage,
        expert_slots: all_experts,
        load_expert_slots: all_experts,
        expert_cache_bytes: all_experts * s.expert_bytes,
        embed_resident: true,
        head_resident: true,
        head_chunk_rows,
        state_reserve,
        states,
        fixed_bytes: fixed,
        prefill_chunk: MIN_PREFILL_CHUNK,
        pinned_bytes: s.pinned_trunk(),
        pin_coded,
        head_coded: s.head_pinned > 0,
        ring_coded: false,
    };
    // A resident plan: whatever the budget leaves beyond everything may lengthen the chunk.
    let resident_in = |budget: Option<u64>| {
        let spare = budget.map_or(u64::MAX, |b| {
            b.saturating_sub(fixed + state_reserve + held_bytes + slot_slack)
        });
        let (chunk, extra) = prefill_chunk(s, budget, spare);
        // The staging pinned layers load through takes expert slots while they load, where
        // the budget has no room for both (the slots come back once it is released).
        let short = full_stage.saturating_sub(spare - extra);
        Plan {
            budget_bytes: budget,
            fixed_bytes: fixed + extra,
            prefill_chunk: chunk,
            load_expert_slots: all_experts
                .saturating_sub(short.div_ceil(slot))
                .max(s.top_k),
            // Under a budget the experts are read into the arena (one slot each).
            expert_cache_bytes: if budget.is_some() {
                all_experts * slot
            } else {
                resident.expert_cache_bytes
            },
            ..resident.clone()
        }
    };
    let (trunk_budget, cache_budget, total, chunk, extra) = match req {
        BudgetRequest::Resident => return Ok(resident_in(None)),
        BudgetRequest::Total(b) => {
            let b = env_limit.map_or(b, |l| b.min(l));
            if b < floor {
                return Err(BelowFloor { budget: b, floor });
            }
            let everything = fixed + state_reserve + held_bytes + slot_slack;
            if b >= everything {
                return Ok(resident_in(Some(b)));
            }
            // Trunk first (every pinned gigabyte removes a gigabyte of reads per token), then
            // the cache; see docs/runtime.md#memory-budgets.
            let (chunk, extra) = prefill_chunk(s, Some(b), b - floor);
            let spare = b - floor - extra;
            let reserve_cache = s.top_k * slot;
            let trunk = spare + ring_min;
            (trunk, reserve_cache, b, chunk, extra)
        }
        BudgetRequest::Split { trunk, cache } => {
            let trunk = trunk.unwrap_or(s.pinned_trunk() + s.pinned_head());
            let total = trunk.saturating_add(cache);
            if total < floor {
                return Err(BelowFloor {
                    budget: total,
                    floor,
                });
            }
            if total >= fixed + state_reserve + held_bytes + slot_slack {
                return Ok(resident_in(Some(total)));
            }
            // Everything but the ring and the cache comes out of the cache's share first (a
            // trunk share that holds the trunk keeps holding it), then out of the trunk's.
            let overhead = floor - ring_min - s.top_k * slot;
            let avail = total - overhead;
            let trunk_share = trunk.clamp(ring_min, avail - s.top_k * slot);
            // A longer prefill chunk, paid from the cache's share.
            let cache_share = avail - trunk_share;
            let (chunk, extra) =
                prefill_chunk(s, Some(total), cache_share.saturating_sub(s.top_k * slot));
            (trunk_share, cache_share - extra, total, chunk, extra)
        }
    };
    let fixed = fixed + extra;
    // The floor counts a chunk of streamed head rows; a resident head needs none, so once the
    // head is pinned those bytes go back where they came from: to the trunk under a total
    // budget, to the cache's share under a split one (which paid for the floor's overheads).
    let head_chunk = head_chunk_rows * s.row_bytes;
    let (trunk_credit, cache_credit) = match req {
        BudgetRequest::Split { .. } => (0, head_chunk),
        _ => (head_chunk, 0),
    };
    // Pin the output head (it is read every token like a layer), then every layer that fits,
    // from the first one up, keeping room for the ring of the layers left unpinned: a layer
    // too large for what is left is skipped and a smaller one after it may still fit (every
    // pinned byte is a byte fewer read per token, whichever layer it holds). A head held in
    // more bytes than it reads (decoded, where the trunk stores it coded) can save fewer reads
    // than layers in the same bytes, so the plan without it is made too, and the one that
    // reads less is taken.
    // Runs are staged whole where the budget has room for it with nothing pinned (a window
    // costs a copy of part of a run now and then); then only as much as the layers left
    // streaming need.
    let whole = trunk_budget >= ring_min + (full_stage - window);
    let stage_of = |pinned: &[bool]| {
        if whole {
            ring.whole(pinned)
        } else {
            window
        }
    };
    let ring_min = ring_min + (stage_of(&vec![false; n]) - window);
    let ring_of = |pinned: &[bool]| ring.need(pinned, stage_of(pinned));
    let pin = |with_head: bool| {
        let mut pinned = vec![false; n];
        let mut left = trunk_budget;
        let head = with_head && left + trunk_credit >= s.pinned_head() + ring_min;
        if head {
            left = left + trunk_credit - s.pinned_head();
        }
        let mut used = 0;
        for il in 0..n {
            let mut trial = pinned.clone();
            trial[il] = true;
            let need = s.pinned_layer(il) + ring_of(&trial);
            if used + need <= left {
                pinned = trial;
                used += s.pinned_layer(il);
            }
        }
        (head, pinned)
    };
    let (head_resident, pinned) = {
        let with = pin(true);
        let without = pin(false);
        if s.read_bytes(&without.1, without.0) < s.read_bytes(&with.1, with.0) {
            without
        } else {
            with
        }
    };
    let pinned_bytes: u64 = (0..n)
        .filter(|&i| pinned[i])
        .map(|i| s.pinned_layer(i))
        .sum();
    let ring_slots = (0..n).filter(|&i| !pinned[i]).count().min(2) as u64;
    // Where every layer is pinned the staging serves only to load them: it is released once
    // they are loaded, and its bytes go to expert slots then.
    let all_pinned = ring_slots == 0;
    let ring_bytes = if all_pinned { 0 } else { ring_of(&pinned) };
    // Whatever the trunk did not use goes to the cache.
    let trunk_used = pinned_bytes + ring_bytes + if head_resident { s.pinned_head() } else { 0 };
    let credit = if head_resident { trunk_credit } else { 0 };
    let cache_bytes = cache_budget
        + if head_resident { cache_credit } else { 0 }
        + (trunk_budget + credit).saturating_sub(trunk_used);
    let slots_of = |bytes: u64| (bytes / slot).clamp(s.top_k, all_experts.max(s.top_k));
    let expert_slots = slots_of(cache_bytes);
    let stage = stage_of(&pinned);
    let load_expert_slots = if all_pinned {
        slots_of(cache_bytes.saturating_sub(stage))
    } else {
        expert_slots
    };
    Ok(Plan {
        model_bytes,
        budget_bytes: Some(total),
        floor_bytes: floor,
        fits: total >= floor,
        pinned,
        ring_slots,
        ring_bytes,
        stage_bytes: stage,
        expert_slots,
        load_expert_slots,
        expert_cache_bytes: expert_slots * slot,
        embed_resident: false,
        head_resident,
        head_chunk_rows,
        state_reserve,
        states,
        fixed_bytes: fixed,
        prefill_chunk: chunk,
        pinned_bytes,
        pin_coded: pin_coded && pinned_bytes > 0,
        head_coded: head_resident && s.head_pinned > 0,
        ring_coded: ring_coded && ring_slots > 0,
    })
}

/// The memory limit of this process's cgroup (v2 `memory.max` or v1 `limit_in_bytes`), if set.
#[must_use]
pub fn cgroup_limit() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    if let Some(v) = read("/sys/fs/cgroup/memory.max") {
        return v.trim().parse::<u64>().ok();
    }
    read("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&v| v < (1 << 60))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The released model's sizes (docs/model.md#sizes-of-the-released-model).
    fn k3_sizes() -> ModelSizes {
        let mut layer_trunk = vec![2_341_213_184];
        for il in 1..93u64 {
            let mla = il % 4 == 3 || il == 92;
            layer_trunk.push(if mla { 844_335_616 } else { 1_267_744_256 });
        }
        ModelSizes {
            layer_trunk,
            layer_staged: Vec::new(),
            layer_window: Vec::new(),
            layer_pinned: Vec::new(),
            layer_in_place: Vec::new(),
            expert_bytes: 17_547_264,
            experts_per_layer: 896,
            moe_layers: 92,
            top_k: 16,
            embed: 2_348_810_240,
            head: 2_348_810_240,
            head_stored: 0,
            head_pinned: 0,
            small: 43_008,
            row_bytes: 14_336,
            state_bytes: 464_633_856,
            kv_per_position: 24 * 576 * 4,
            kda_record_per_position: (69 * (7 * 12_288 + 96) + 12_288) * 4,
            kda_layer_state: 464_633_856 / 69 + 2 * 12_288 * 4,
            hidden: 7168,
            vocab: 163_840,
            // `engine::activation_sizes` of the released config.
            activation_fixed: 141_705 * 4,
            activation_per_token: 489_814 * 4,
            activation_per_position: 96 * 4,
            coded_first: false,
        }
    }

    /// The released shape with its trunk and head nibble-coded: runs at 0.75x, windows of
    /// 0.43 GB at most, pinned layers at 0.75x and their index, the head stored at 0.75x (and
    /// held decoded: no `head_pinned`).
    fn k3_coded_sizes() -> ModelSizes {
        let raw = k3_sizes();
        let layer_staged: Vec<u64> = raw.layer_trunk.iter().map(|&b| b * 3 / 4).collect();
        ModelSizes {
            layer_window: (layer_staged.iter()).map(|&b| b.min(430_000_000)).collect(),
            layer_staged,
            layer_pinned: (raw.layer_trunk.iter())
                .map(|&b| b * 3 / 4 + (1 << 20))
                .collect(),
            head_stored: raw.head * 3 / 4,
            ..raw
        }
    }

    #[test]
    fn the_real_shape_fits_in_six_gb_and_the_floor_is_reported() {
        let s = k3_sizes();
        assert_eq!(s.model_bytes(), 1_559_965_606_912);
        let p = plan(&s, BudgetRequest::Total(6_000_000_000), 4096, None).unwrap();
        assert!(p.fits);
        assert!(
            p.planned_bytes(&s) <= 6_000_000_000,
            "{}",
            p.planned_bytes(&s)
        );
        println!(
            "k3 at 6 GB: floor {}, {} pinned, {} expert slots",
            gb(p.floor_bytes),
            p.n_pinned(),
            p.expert_slots
        );
        let e = plan(&s, BudgetRequest::Total(3_000_000_000), 4096, None).unwrap_err();
        assert_eq!(e.floor, p.floor_bytes);
        assert!(e.to_string().contains("short by"));
    }

    #[test]
    fn more_budget_pins_more_and_never_less() {
        let s = k3_sizes();
        let mut last = (0, 0);
        for gb10 in (60..=2400).step_by(60) {
            let p = plan(
                &s,
                BudgetRequest::Total(gb10 as u64 * 100_000_000),
                4096,
                None,
            )
            .unwrap();
            assert!(p.planned_bytes(&s) <= gb10 as u64 * 100_000_000);
            assert!(p.n_pinned() >= last.0, "pinned layers fell at {gb10} dGB");
            last = (p.n_pinned(), p.expert_slots as usize);
        }
        let p = plan(&s, BudgetRequest::Total(2_000_000_000_000), 4096, None).unwrap();
        assert_eq!(p.n_pinned(), 93);
        assert!(p.head_resident && p.embed_resident);
    }

    /// Layers stored encoded stage their stored run before decoding (into a slot, or into a
    /// pinned layer's allocation): the ring counts one staging buffer, of the largest encoded
    /// run, in the floor and in every plan, and a budget still covers what it plans.
    #[test]
    fn the_staging_of_encoded_layers_is_counted() {
        let raw = k3_sizes();
        let mut enc = raw.clone();
        enc.layer_staged = raw.layer_trunk.iter().map(|&b| b * 7 / 10).collect();
        let biggest = enc.layer_staged.iter().copied().max().unwrap();
        let p0 = plan(&raw, BudgetRequest::Total(8_000_000_000), 4096, None).unwrap();
        let p1 = plan(&enc, BudgetRequest::Total(8_000_000_000), 4096, None).unwrap();
        assert_eq!(p1.floor_bytes, p0.floor_bytes + biggest);
        for gb in [8u64, 32, 100] {
            let p = plan(&enc, BudgetRequest::Total(gb * 1_000_000_000), 4096, None).unwrap();
            // Pinned layers stored encoded are staged when they are loaded: the largest run
            // of all, whatever the plan pins.
            let streamed_staging = biggest;
            assert!(p.pinned.iter().any(|&x| !x), "{gb} GB streams layers");
            let mut sorted: Vec<u64> = (0..enc.layer_trunk.len())
                .filter(|&i| !p.pinned[i])
                .map(|i| enc.layer_trunk[i])
                .collect();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            let slots: u64 = sorted.iter().take(2).sum();
            assert_eq!(p.ring_bytes, slots + streamed_staging, "{gb} GB");
            assert!(p.planned_bytes(&enc) <= gb * 1_000_000_000, "{gb} GB");
        }
        // Staged through a window of each run (smaller than the run): the window counts.
        let mut win = enc.clone();
        win.layer_window = enc.layer_staged.iter().map(|&b| b / 4).collect();
        let p2 = plan(&win, BudgetRequest::Total(8_000_000_000), 4096, None).unwrap();
        assert_eq!(p2.floor_bytes, p0.floor_bytes + biggest / 4);
        assert!(p2.n_pinned() >= p1.n_pinned());
        // Raw layers (or no trunk) stage nothing.
        assert_eq!(p0.ring_bytes, {
            let mut sorted: Vec<u64> = (0..raw.layer_trunk.len())
                .filter(|&i| !p0.pinned[i])
                .map(|i| raw.layer_trunk[i])
                .collect();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            sorted.iter().take(2).sum::<u64>()
        });
    }

    /// A budget with room to stage runs whole stages only the runs of the layers it streams
    /// whole: a pinned layer larger than all of them (the released shape's dense first layer,
    /// 1.76 GB against 0.95 GB stored) is loaded through a window of the staging instead of
    /// setting its size. The bytes that frees pin more layers, never fewer, inside the budget.
    #[test]
    fn a_large_pinned_layer_does_not_set_the_staging() {
        let coded = k3_coded_sizes();
        let whole_only = ModelSizes {
            layer_window: Vec::new(),
            ..coded.clone()
        };
        let biggest = coded.layer_staged.iter().copied().max().unwrap();
        let mut smaller = 0;
        for gb in [8u64, 16, 32, 64, 100] {
            let b = gb * 1_000_000_000;
            let req = BudgetRequest::Total(b);
            let (p, q) = (
                plan(&coded, req, 4096, None).unwrap(),
                plan(&whole_only, req, 4096, None).unwrap(),
            );
            assert!(p.planned_bytes(&coded) <= b, "{gb} GB");
            assert!(p.n_pinned() >= q.n_pinned(), "{gb} GB");
            assert!(
                p.trunk_read_bytes(&coded) <= q.trunk_read_bytes(&coded),
                "{gb} GB"
            );
            if p.stage_bytes == biggest
                || p.stage_bytes == *coded.layer_window.iter().max().unwrap()
            {
                continue;
            }
            // Staged whole: every streamed run fits, and every pinned layer's window.
            for i in 0..coded.layer_trunk.len() {
                let need = if p.pinned[i] {
                    coded.layer_window[i]
                } else {
                    coded.layer_staged[i]
                };
                assert!(p.stage_bytes >= need, "{gb} GB, layer {i}");
            }
            assert!(p.pinned[0], "{gb} GB: the dense layer is pinned");
            assert!(p.stage_bytes < biggest, "{gb} GB");
            smaller += 1;
        }
        assert!(smaller > 0, "some budget stages less than the largest run");
    }

    /// Layers whose runs can be read in place (`ModelSizes::layer_in_place`), where pinned
    /// layers are held coded: the ring's slots are the runs' size, each slot keeps every
    /// streamed layer's index, nothing is staged, and the bytes that frees leave fewer trunk
    /// bytes to read a token (never more) inside the budget, at a lower floor. A plan holding
    /// layers decoded (the `decoded` sizes) reads nothing in place.
    #[test]
    fn layers_read_in_place_need_no_staging_and_pin_more() {
        let staged = k3_coded_sizes();
        // On kernels that multiply coded as fast (where a tie in bytes read holds coded).
        let staged = ModelSizes {
            coded_first: true,
            ..staged
        };
        let in_place = ModelSizes {
            layer_in_place: staged.layer_staged.clone(),
            ..staged.clone()
        };
        let (p0, q0) = (
            plan(&in_place, BudgetRequest::Total(8_000_000_000), 4096, None).unwrap(),
            plan(&staged, BudgetRequest::Total(8_000_000_000), 4096, None).unwrap(),
        );
        assert!(p0.floor_bytes < q0.floor_bytes);
        let mut more = 0;
        for gb in [8u64, 16, 32, 64, 100] {
            let b = gb * 1_000_000_000;
            let req = BudgetRequest::Total(b);
            let (p, q) = (
                plan(&in_place, req, 4096, None).unwrap(),
                plan(&staged, req, 4096, None).unwrap(),
            );
            assert_eq!(p.ring_coded, p.ring_slots > 0, "{gb} GB");
            assert!(!q.ring_coded, "{gb} GB");
            assert_eq!(p.stage_bytes, 0, "{gb} GB");
            assert!(p.planned_bytes(&in_place) <= b, "{gb} GB");
            let reads = |x: &Plan| x.trunk_read_bytes(&in_place);
            assert!(reads(&p) <= reads(&q), "{gb} GB");
            more += usize::from(reads(&p) < reads(&q));
            let streamed: Vec<usize> = (0..93).filter(|&i| !p.pinned[i]).collect();
            let mut slots: Vec<u64> = streamed
                .iter()
                .map(|&i| in_place.layer_in_place[i])
                .collect();
            slots.sort_unstable_by(|a, b| b.cmp(a));
            let kept: u64 = (streamed.iter())
                .map(|&i| in_place.layer_pinned[i] - in_place.layer_in_place[i])
                .sum();
            assert_eq!(
                p.ring_bytes,
                slots.iter().take(2).sum::<u64>() + p.ring_slots * kept,
                "{gb} GB"
            );
            println!(
                "released shape at {gb} GB: {} layers pinned and {:.1} GB read a token where \
                 layers are read in place, {} and {:.1} GB where they are staged",
                p.n_pinned(),
                reads(&p) as f64 / 1e9,
                q.n_pinned(),
                reads(&q) as f64 / 1e9
            );
        }
        assert!(more > 0, "reading in place pins more at some budget");
        // Held decoded, nothing is read in place.
        let decoded = ModelSizes {
            layer_pinned: Vec::new(),
            ..in_place.clone()
        };
        let d = plan(&decoded, BudgetRequest::Total(16_000_000_000), 4096, None).unwrap();
        assert!(!d.ring_coded && d.stage_bytes > 0);
        // Where a tie holds layers decoded (the scalar kernels) the plan without a budget
        // holds them decoded, and its floor is still the least budget any plan runs in.
        let generic = ModelSizes {
            coded_first: false,
            ..in_place.clone()
        };
        let r = plan(&generic, BudgetRequest::Resident, 4096, None).unwrap();
        assert!(!r.pin_coded);
        assert_eq!(r.floor_bytes, p0.floor_bytes);
        let at = |b: u64| plan(&generic, BudgetRequest::Total(b), 4096, None);
        assert!(at(r.floor_bytes).is_ok_and(|p| p.ring_coded));
        assert_eq!(at(r.floor_bytes - 1).unwrap_err().floor, r.floor_bytes);
    }

    /// Under a total budget nothing a layer or an expert slot could use is left over: once the
    /// head is pinned, the chunk of streamed head rows the floor counts is given back, and a
    /// layer too large for what is left is skipped for a smaller one after it. What goes to
    /// the cache beyond its least share is then less than any streamed layer, and what is
    /// left of the budget is less than an expert slot. More budget never reads more.
    #[test]
    fn a_budget_is_spent_on_every_layer_that_fits_then_expert_slots() {
        let raw = k3_sizes();
        let coded = k3_coded_sizes();
        let in_place = ModelSizes {
            layer_in_place: coded.layer_staged.clone(),
            coded_first: true,
            ..coded.clone()
        };
        for (name, s) in [("raw", raw), ("coded", coded), ("in place", in_place)] {
            let slot = expert_slot_bytes(&s);
            let all = s.experts_per_layer * s.moe_layers;
            let (mut skipped, mut last) = (0, u64::MAX);
            for gb in 7..=160u64 {
                let b = gb * 1_000_000_000;
                let p = plan(&s, BudgetRequest::Total(b), 4096, None).unwrap();
                let planned = p.planned_bytes(&s);
                assert!(planned <= b, "{name} {gb} GB: {planned}");
                let reads = p.trunk_read_bytes(&s);
                assert!(
                    reads <= last,
                    "{name}: {gb} GB reads more than {} GB",
                    gb - 1
                );
                last = reads;
                if p.n_pinned() == 93 || p.expert_slots >= all {
                    continue;
                }
                assert!(b - planned < slot, "{name} {gb} GB: {} left", b - planned);
                let to_cache = (p.expert_slots - s.top_k) * slot;
                for il in (0..93).filter(|&i| !p.pinned[i]) {
                    assert!(
                        s.pinned_layer(il) > to_cache,
                        "{name} {gb} GB: layer {il} fits in the {to_cache} bytes the cache got"
                    );
                }
                let first_streamed = p.pinned.iter().position(|&x| !x).unwrap_or(93);
                skipped += usize::from(p.pinned[first_streamed..].iter().any(|&x| x));
            }
            assert!(
                skipped > 0,
                "{name}: some budget pins a layer after one it streams"
            );
        }
    }

    /// A plan that pins every layer of an encoded trunk holds the staging only while they
    /// load: after, its bytes are expert slots (as many as the raw trunk's plan has), and both
    /// the loading and the loaded plan fit the budget.
    #[test]
    fn pinning_every_encoded_layer_gives_the_staging_to_expert_slots() {
        let raw = k3_sizes();
        let mut enc = raw.clone();
        enc.layer_staged = raw.layer_trunk.iter().map(|&b| b * 3 / 4).collect();
        let stage = enc.layer_staged.iter().copied().max().unwrap();
        let slot = expert_slot_bytes(&enc);
        let mut seen = 0;
        for gb in (120..=260).step_by(5) {
            let b = gb * 1_000_000_000;
            let p = plan(&enc, BudgetRequest::Total(b), 4096, None).unwrap();
            let r = plan(&raw, BudgetRequest::Total(b), 4096, None).unwrap();
            if p.n_pinned() < enc.layer_trunk.len() {
                assert!(!p.stage_only_to_load(), "{gb} GB");
                assert_eq!(p.load_expert_slots, p.expert_slots, "{gb} GB");
                continue;
            }
            assert!(p.stage_only_to_load(), "{gb} GB");
            assert_eq!(p.stage_bytes, stage, "{gb} GB");
            assert_eq!(p.ring_bytes, 0, "{gb} GB: no layer streams");
            assert!(p.planned_bytes(&enc) <= b, "{gb} GB");
            // While loading: the staging and the fewer slots fit too.
            let loading = p.fixed_bytes
                + p.state_reserve
                + p.pinned_bytes
                + p.stage_bytes
                + p.load_expert_slots * slot
                + if p.embed_resident {
                    enc.embed
                } else {
                    64 * enc.row_bytes
                }
                + if p.head_resident {
                    enc.head
                } else {
                    p.head_chunk_rows * enc.row_bytes
                }
                + enc.small;
            assert!(loading <= b, "{gb} GB: {loading} while loading");
            if p.budget_bytes.is_some() && p.expert_slots < enc.experts_per_layer * enc.moe_layers {
                seen += 1;
                assert_eq!(p.expert_slots, r.expert_slots, "{gb} GB: as many as raw");
                assert!(p.load_expert_slots < p.expert_slots, "{gb} GB");
                assert!(
                    (p.expert_slots - p.load_expert_slots + 1) * slot > stage,
                    "{gb} GB: the staging's bytes are slots after loading"
                );
            }
        }
        assert!(seen > 0, "some budget pins every layer short of everything");
    }

    /// The released shape with its trunk nibble-coded (runs at 0.75x, windows of 0.43 GB at
    /// most, pinned layers at 0.75x and their index): a budget that cannot hold every layer
    /// decoded pins more layers coded, never fewer, inside the budget; one that holds them all
    /// decoded keeps them decoded.
    #[test]
    fn pinned_layers_are_held_coded_where_that_pins_more() {
        let raw = k3_sizes();
        let coded = ModelSizes {
            head_stored: 0,
            ..k3_coded_sizes()
        };
        let enc = ModelSizes {
            layer_pinned: Vec::new(),
            ..coded.clone()
        };
        let mut gained = 0;
        for gb in [8u64, 16, 32, 64, 100, 128, 256] {
            let req = BudgetRequest::Total(gb * 1_000_000_000);
            let (d, c) = (
                plan(&enc, req, 4096, None).unwrap(),
                plan(&coded, req, 4096, None).unwrap(),
            );
            assert!(!d.pin_coded);
            assert!(c.n_pinned() >= d.n_pinned(), "{gb} GB");
            assert_eq!(c.pin_coded, c.n_pinned() > d.n_pinned(), "{gb} GB");
            assert!(c.planned_bytes(&coded) <= gb * 1_000_000_000, "{gb} GB");
            gained += usize::from(c.n_pinned() > d.n_pinned());
            println!(
                "released shape at {gb} GB: {} layers pinned decoded, {} coded",
                d.n_pinned(),
                c.n_pinned()
            );
        }
        assert!(
            gained >= 4,
            "coded pinned layers gained at {gained} budgets"
        );
        let all = plan(&coded, BudgetRequest::Total(2_000_000_000_000), 4096, None).unwrap();
        assert_eq!((all.n_pinned(), all.pin_coded), (93, false));
        assert_eq!(all.pinned_bytes, raw.layer_trunk.iter().sum::<u64>());
    }

    /// The released shape with its trunk and head nibble-coded: where pinned layers are held
    /// coded the head is held coded too (its run and index, about 0.75x), and the room it
    /// frees pins more layers or holds a head that would otherwise stream, never fewer layers,
    /// inside the budget. Where the plan holds pinned weights decoded the head is counted
    /// decoded.
    #[test]
    fn a_coded_head_is_held_where_pinned_layers_are() {
        let raw = k3_sizes();
        let layers = k3_coded_sizes();
        let mut head = layers.clone();
        let index = super::super::codec::NibbleIndex::bytes_for(163_840, 7168) as u64;
        head.head_pinned = (raw.head * 3 / 4).next_multiple_of(4096) + index;
        assert!(head.pinned_head() < raw.head);
        let mut gained = 0;
        for gb in [7u64, 8, 9, 10, 16, 32, 64, 100, 128] {
            let req = BudgetRequest::Total(gb * 1_000_000_000);
            let (l, h) = (
                plan(&layers, req, 4096, None).unwrap(),
                plan(&head, req, 4096, None).unwrap(),
            );
            assert!(h.planned_bytes(&head) <= gb * 1_000_000_000, "{gb} GB");
            assert!(!h.head_coded || h.head_resident, "{gb} GB");
            let held = if h.head_coded {
                head.pinned_head()
            } else {
                raw.head
            };
            assert_eq!(head.held_head(&h), held, "{gb} GB");
            let reads = |p: &Plan| p.trunk_read_bytes(&head);
            println!(
                "released shape at {gb} GB: head resident {} / {}, layers pinned {} / {}, \
                 trunk read per token {:.2} / {:.2} GB (head decoded / coded)",
                l.head_resident,
                h.head_resident,
                l.n_pinned(),
                h.n_pinned(),
                reads(&l) as f64 / 1e9,
                reads(&h) as f64 / 1e9,
            );
            assert!(reads(&h) <= reads(&l), "{gb} GB");
            gained += usize::from(reads(&h) < reads(&l));
        }
        assert!(gained >= 2, "a coded head gained at {gained} budgets");
        // Holding everything: decoded, the head too.
        let all = plan(&head, BudgetRequest::Total(2_000_000_000_000), 4096, None).unwrap();
        assert!(!all.pin_coded && !all.head_coded && all.head_resident);
        assert_eq!(head.held_head(&all), raw.head);
    }

    /// Where the kernels multiply coded weights faster (`coded_first`), a budget whose plan
    /// pins as many layers either way holds them and the head coded, and the bytes that frees
    /// become expert slots; where it pins more coded the plan is the same as without.
    #[test]
    fn coded_first_holds_pinned_weights_coded_where_that_reads_as_many() {
        let mut s = k3_coded_sizes();
        s.head_pinned = s.head * 3 / 4 + (1 << 20);
        let first = ModelSizes {
            coded_first: true,
            ..s.clone()
        };
        let mut more_slots = 0;
        for gb in [8u64, 32, 64, 150, 256, 2000] {
            let req = BudgetRequest::Total(gb * 1_000_000_000);
            let (d, c) = (
                plan(&s, req, 4096, None).unwrap(),
                plan(&first, req, 4096, None).unwrap(),
            );
            assert!(c.planned_bytes(&first) <= gb * 1_000_000_000, "{gb} GB");
            assert_eq!(
                c.trunk_read_bytes(&first),
                d.trunk_read_bytes(&s),
                "{gb} GB"
            );
            println!(
                "released shape at {gb} GB: {} layers pinned, coded {} / {}, {} / {} expert slots \
                 (coded_first off / on)",
                c.n_pinned(),
                d.pin_coded,
                c.pin_coded,
                d.expert_slots,
                c.expert_slots
            );
            if d.pin_coded || c.n_pinned() == 0 {
                // Coded already (or nothing pinned): the same plan.
                assert_eq!(c, d, "{gb} GB");
            } else {
                assert!(c.pin_coded && c.head_coded, "{gb} GB");
                assert_eq!(c.n_pinned(), d.n_pinned(), "{gb} GB");
                assert!(c.expert_slots >= d.expert_slots, "{gb} GB");
                more_slots += usize::from(c.expert_slots > d.expert_slots);
            }
        }
        assert!(more_slots >= 2, "more expert slots at {more_slots} budgets");
        // Everything held: coded.
        let all = plan(&first, BudgetRequest::Total(2_000_000_000_000), 4096, None).unwrap();
        assert!(all.pin_coded && all.head_coded && all.head_resident);
        assert_eq!(all.pinned_bytes, first.pinned_trunk());
    }

    #[test]
    fn presets_and_cgroup_cap() {
        let s = k3_sizes();
        let p = plan(&s, preset("server").unwrap(), 4096, None).unwrap();
        assert!(p.n_pinned() >= 85, "{}", p.n_pinned());
        assert!(preset("medium").is_none());
        let capped = plan(
            &s,
            BudgetRequest::Total(200_000_000_000),
            4096,
            Some(8_000_000_000),
        )
        .unwrap();
        assert!(capped.budget_bytes.unwrap() <= 8_000_000_000);
    }

    #[test]
    fn a_split_budget_is_the_sum_of_its_two_numbers() {
        let s = k3_sizes();
        for (t, c) in [(4e9, 2e9), (16e9, 10e9), (60e9, 30e9), (1e9, 8e9)] {
            let req = BudgetRequest::Split {
                trunk: Some(t as u64),
                cache: c as u64,
            };
            let p = plan(&s, req, 4096, None).unwrap();
            assert_eq!(p.budget_bytes, Some((t + c) as u64));
            assert!(p.planned_bytes(&s) <= (t + c) as u64, "{t} + {c}");
        }
        // `--trunk-gb 0`: the whole trunk resident, the cache on top of it.
        let req = BudgetRequest::Split {
            trunk: None,
            cache: 16_000_000_000,
        };
        let p = plan(&s, req, 4096, None).unwrap();
        let trunk: u64 = s.layer_trunk.iter().sum::<u64>() + s.head;
        assert_eq!(p.budget_bytes, Some(trunk + 16_000_000_000));
        assert_eq!(p.n_pinned(), 93);
        assert!(p.head_resident);
        assert!(p.planned_bytes(&s) <= trunk + 16_000_000_000);
        assert!(
            p.expert_cache_bytes > 13_000_000_000,
            "{}",
            p.expert_cache_bytes
        );
        // Below the floor is refused with the sum.
        let tiny = BudgetRequest::Split {
            trunk: Some(1_000_000_000),
            cache: 1_000_000_000,
        };
        assert_eq!(
            plan(&s, tiny, 4096, None).unwrap_err().budget,
            2_000_000_000
        );
    }

    #[test]
    fn an_encoded_head_streams_in_the_bytes_of_its_raw_rows() {
        let mut s = k3_sizes();
        let rows = HEAD_CHUNK_BYTES / s.row_bytes;
        let room = rows * s.row_bytes;
        assert_eq!(s.head_rows_encoded(rows), None, "read raw");
        s.head_stored = s.head * 3 / 4;
        let (cols, values) = (s.row_bytes / 2, s.head / 2);
        let fit = s
            .head_rows_encoded(rows)
            .expect("the released head streams encoded");
        let bytes = |r| {
            let (dec, enc) = super::super::trunk::head_scratch(r, cols, values, s.head_stored);
            2 * dec + enc
        };
        assert!(bytes(fit) <= room && bytes(fit + 1) > room, "{fit} rows");
        assert!(fit > rows * 3 / 4 && fit < rows, "{fit} of {rows}");
        // A head of a few blocks takes more to stream decoded than read raw: read raw.
        s.vocab = 64;
        s.head = 64 * s.row_bytes;
        s.head_stored = s.head * 3 / 4;
        assert_eq!(s.head_rows_encoded(64), None);
    }
}
