//! Streamed layers: where each layer's non-expert tensors lie, found once when the model
//! opens, and the read-ahead ring that reads them into its slots ahead of the forward pass.
//!
//! A slot is memory for one layer ([`RingSlot`]): a layer is read into it and multiplied in
//! place, and the `Layer` bound to its bytes the first time is kept with the slot and handed
//! out again the next time the same layer comes to it. One reader thread fills the slots in
//! the order they are asked for; the forward pass takes them in that order. The ring's whole
//! state sits behind one mutex and one condition variable, and no read is ever made while
//! the mutex is held: once every (slot, layer) pair has been seen, streaming a layer
//! allocates nothing.

use super::leaf::Leaf;
use crate::engine::bind::{bind_layer, Binder};
use crate::engine::config::ModelConfig;
use crate::engine::layer::Layer;
use crate::stream::arena::Arena;
use crate::stream::arena::Slot;
use crate::stream::index::TensorInfo;
use crate::stream::ring::RingSlot;
use crate::stream::trunk::{DecodeScratch, LayerRun, Trunk};
use crate::stream::{Checkpoint, StreamError};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar};

/// A layer, or why it could not be read.
pub(super) type LayerResult = Result<Arc<Layer>, StreamError>;

/// Read one layer's non-expert weights into allocations of their own (pinned layers).
pub(super) fn load_layer(
    ck: &Checkpoint,
    trunk: Option<&Trunk>,
    cfg: &ModelConfig,
    il: usize,
    mapped: bool,
) -> LayerResult {
    let b = Binder::new(ck, true, false)
        .with_trunk(trunk)
        .mapped(mapped);
    bind(ck, cfg, il, b).map(Arc::new)
}

/// Bind layer `il` with `b`: the layer, or its problems as one error.
fn bind(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    il: usize,
    mut b: Binder,
) -> Result<Layer, StreamError> {
    let layer = bind_layer(&mut b, cfg, il)?;
    match (layer, b.into_result()) {
        (Some(l), Ok(())) => Ok(l),
        (_, Err(e)) => Err(StreamError::Unrepresentable {
            path: ck.dir().to_path_buf(),
            name: format!("layer {il}"),
            reason: e.to_string(),
        }),
        (None, Ok(())) => Err(StreamError::Unrepresentable {
            path: ck.dir().to_path_buf(),
            name: format!("layer {il}"),
            reason: "incomplete layer".into(),
        }),
    }
}

/// Layer `il` of `trunk` when it is stored encoded, for pinning: its stored run read through
/// the ring's staging memory (planned, and idle while a plan is made; the whole run or a
/// window of it) and decoded from there into an allocation of its own (with `coded`, its
/// nibble-coded matrices kept as stored), so loading it takes no memory beyond the layer and
/// the plan's staging. None when the layer is stored raw, or
/// there is no staging (then [`load_layer`] reads it alone).
pub(super) fn load_encoded(
    ck: &Checkpoint,
    trunk: &Trunk,
    cfg: &ModelConfig,
    il: usize,
    ring: &LayerRing,
    coded: bool,
) -> Option<LayerResult> {
    trunk.decoded_len(il)?;
    ring.with_stage(|stage| {
        let mem = stage.mem.as_mut()?;
        let read = trunk
            .read_decode_layer(il, mem, &mut stage.scratch, coded)
            .and_then(|run| bind(ck, cfg, il, Binder::new(ck, true, false).with_run(run)));
        Some(read.map(Arc::new))
    })
}

/// Layer `il` of `trunk`, read as it lies into an allocation of its own and held coded
/// there, for pinning (see `Trunk::read_in_place_layer`): no staging.
pub(super) fn load_in_place(
    ck: &Checkpoint,
    trunk: &Trunk,
    cfg: &ModelConfig,
    il: usize,
) -> LayerResult {
    let run = trunk.read_in_place_layer(il)?;
    bind(ck, cfg, il, Binder::new(ck, true, false).with_run(run)).map(Arc::new)
}

/// One of a layer's tensors: its name, where it lies in its shard, and its place in a slot.
#[derive(Debug)]
struct Span {
    name: String,
    info: TensorInfo,
    at: usize,
}

/// How a layer is read into a slot.
#[derive(Debug)]
enum Layout {
    /// Its run of the packed trunk, in one piece of `len` bytes.
    Trunk { len: usize },
    /// Its tensors from the shards, each to its place.
    Shards { spans: Vec<Span> },
    /// Its run of the packed trunk, holding encoded tensors, read into the ring's staging
    /// buffer (`window` bytes of it at least) and decoded from there into `len` bytes of the
    /// slot; or, in a ring that holds layers coded, read as it lies into `in_place` bytes of
    /// the slot and multiplied coded there, where the run allows it
    /// (`Trunk::in_place_len`).
    Encoded {
        window: usize,
        len: usize,
        in_place: Option<usize>,
    },
}

/// Tensors start at this alignment in a slot (the widest kernel load).
const SPAN_ALIGN: usize = 64;

/// Where every layer's non-expert tensors lie, found once.
#[derive(Debug)]
pub(super) struct LayerTable {
    layouts: Vec<Layout>,
}

impl LayerTable {
    /// The table of `ck`'s layers (read from `trunk` when there is one). A layer whose
    /// tensors do not bind is laid out by the names it has; its first read reports what is
    /// wrong.
    pub(super) fn new(ck: &Checkpoint, trunk: Option<&Trunk>, cfg: &ModelConfig) -> LayerTable {
        let windows = trunk.map(Trunk::window_lens).unwrap_or_default();
        let layouts: Vec<Layout> = (0..cfg.num_hidden_layers)
            .map(|il| match trunk {
                Some(t) => match (t.raw_run_len(il), t.decoded_len(il)) {
                    (Some(len), _) => Layout::Trunk { len },
                    (None, Some((stored, len))) => Layout::Encoded {
                        window: windows
                            .get(il)
                            .map_or(stored, |&w| usize::try_from(w).unwrap_or(stored)),
                        len,
                        in_place: t.in_place_len(il),
                    },
                    // Not a layer of the trunk: its first read reports it.
                    (None, None) => Layout::Trunk { len: 0 },
                },
                None => {
                    // The names a layer's binding fetches, in order, without reading them.
                    let mut b = Binder::new(ck, false, false);
                    let _ = bind_layer(&mut b, cfg, il);
                    let mut at = 0;
                    let spans = b
                        .order
                        .into_iter()
                        .filter_map(|name| {
                            let info = ck.info(&name)?;
                            let span = Span { name, info, at };
                            at += (span.info.n_bytes() as usize).next_multiple_of(SPAN_ALIGN);
                            Some(span)
                        })
                        .collect();
                    Layout::Shards { spans }
                }
            })
            .collect();
        LayerTable { layouts }
    }
}

impl Layout {
    /// Bytes the layer takes in a slot, in a ring that holds layers `coded` or not.
    fn len(&self, coded: bool) -> usize {
        match self {
            Layout::Trunk { len } => *len,
            Layout::Shards { spans } => spans.last().map_or(0, |s| {
                s.at + (s.info.n_bytes() as usize).next_multiple_of(SPAN_ALIGN)
            }),
            Layout::Encoded { in_place, len, .. } => in_place.filter(|_| coded).unwrap_or(*len),
        }
    }

    /// Bytes the layer stages (at least) before it is decoded into a slot (0: read as it
    /// lies), in a ring that holds layers `coded` or not.
    fn staged(&self, coded: bool) -> usize {
        match self {
            Layout::Encoded {
                in_place: Some(_), ..
            } if coded => 0,
            Layout::Encoded { window, .. } => *window,
            _ => 0,
        }
    }
}

/// Where the reader stages a layer's encoded run before decoding it into a slot (and where a
/// pinned encoded layer is staged when the plan loads it): memory of the largest window of a
/// run the decoder needs (the whole run, or a window of it) and the list of pieces a layer
/// decodes in, both made once per plan.
#[derive(Default)]
pub(super) struct Stage {
    mem: Option<Slot>,
    scratch: DecodeScratch,
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage")
            .field("bytes", &self.mem.as_ref().map_or(0, Slot::len))
            .finish_non_exhaustive()
    }
}

/// What the reader needs to read a layer.
#[derive(Debug)]
pub(super) struct Source {
    pub(super) ck: Arc<Checkpoint>,
    pub(super) trunk: Option<Arc<Trunk>>,
    pub(super) cfg: ModelConfig,
    pub(super) table: LayerTable,
}

impl Source {
    /// Read layer `il` into `slot` (an encoded one through `stage`, or as it lies where the
    /// ring holds layers `coded` and its run allows): the layer bound to it, None (nothing
    /// read) while a layer bound to the slot is still lent out.
    fn fill(
        &self,
        slot: &mut RingSlot<Layer>,
        stage: &mut Stage,
        il: usize,
        coded: bool,
    ) -> Option<LayerResult> {
        let ck = &*self.ck;
        match (&self.table.layouts[il], self.trunk.as_deref()) {
            (
                Layout::Encoded {
                    in_place: Some(len),
                    ..
                },
                Some(trunk),
            ) if coded => self.fill_run(
                slot,
                il,
                *len,
                // Checked against the run's checksum on every read: the layer bound the first
                // time (its kernels' index) is handed out again.
                |area| trunk.read_in_place_into(il, area),
                |mem| trunk.in_place_layer_run(il, mem),
            ),
            (Layout::Encoded { len, .. }, Some(trunk)) => self.fill_run(
                slot,
                il,
                *len,
                |area| {
                    let Some(mem) = stage.mem.as_mut() else {
                        return Err(too_large(ck, il));
                    };
                    // Read and decoded overlapped, a segment of the run at a time (through a
                    // window of the run when the staging is smaller than the run).
                    trunk.read_decode_into(il, mem, area, &mut stage.scratch)
                },
                |mem| trunk.decoded_layer_run(il, mem),
            ),
            (Layout::Trunk { len }, Some(trunk)) => self.fill_run(
                slot,
                il,
                *len,
                |area| trunk.read_run_into(il, area),
                |mem| trunk.raw_layer_run(il, mem),
            ),
            (Layout::Shards { spans }, _) => slot.fill(
                il,
                |area| {
                    for s in spans {
                        let n = s.info.n_bytes() as usize;
                        let Some(to) = area.get_mut(s.at..s.at + n) else {
                            return Err(too_large(ck, il));
                        };
                        ck.read_tensor_into(&s.name, &s.info, to)?;
                    }
                    Ok(())
                },
                |mem| {
                    let parts = spans
                        .iter()
                        .map(|s| {
                            let n = s.info.n_bytes() as usize;
                            let b = mem.slice(s.at, n).ok_or_else(|| too_large(ck, il))?;
                            Ok((s.name.clone(), s.info.dtype, b))
                        })
                        .collect::<Result<Vec<_>, StreamError>>()?;
                    let run = LayerRun::from_parts(il, parts);
                    bind(
                        ck,
                        &self.cfg,
                        il,
                        Binder::new(ck, true, false).with_run(run),
                    )
                },
            ),
            _ => Some(load_layer(ck, self.trunk.as_deref(), &self.cfg, il, false)),
        }
    }
}

impl Source {
    /// Fill `slot` with layer `il` from the trunk: `read` writes its `len` bytes into the
    /// slot, and the first time the layer comes to the slot `run` finds its tensors there to
    /// bind.
    fn fill_run(
        &self,
        slot: &mut RingSlot<Layer>,
        il: usize,
        len: usize,
        read: impl FnOnce(&mut [std::mem::MaybeUninit<u8>]) -> Result<(), StreamError>,
        run: impl FnOnce(&crate::stream::bytes::Bytes) -> Result<LayerRun, StreamError>,
    ) -> Option<LayerResult> {
        let ck = &*self.ck;
        slot.fill(
            il,
            |area| match area.get_mut(..len) {
                Some(area) => read(area),
                None => Err(too_large(ck, il)),
            },
            |mem| {
                bind(
                    ck,
                    &self.cfg,
                    il,
                    Binder::new(ck, true, false).with_run(run(mem)?),
                )
            },
        )
    }
}

fn too_large(ck: &Checkpoint, il: usize) -> StreamError {
    StreamError::Unrepresentable {
        path: ck.dir().to_path_buf(),
        name: format!("layer {il}"),
        reason: "larger than a slot of the read-ahead ring".into(),
    }
}

/// Where a slot stands.
#[derive(Debug)]
enum Status {
    /// Nothing asked of it.
    Free,
    /// Layer `il` is to be read into it.
    Queued(usize),
    /// The reader is reading layer `il` into it.
    Reading(usize),
    /// Layer `il` was read (or failed), waiting to be taken.
    Ready(usize, LayerResult),
    /// Being read, but no longer wanted: free once the read ends.
    Discard,
}

impl Status {
    fn layer(&self) -> Option<usize> {
        match self {
            Status::Queued(il) | Status::Reading(il) | Status::Ready(il, _) => Some(*il),
            Status::Free | Status::Discard => None,
        }
    }
}

#[derive(Debug)]
struct RingState {
    /// The slots; None while the reader has one out.
    slots: Vec<Option<RingSlot<Layer>>>,
    /// Bytes each slot holds.
    caps: Vec<usize>,
    /// The memory of the slots, made anew for each plan, one arena per slot: the `n` slots
    /// are the sizes of the `n` largest layers the plan streams, which is what the plan
    /// counts.
    arenas: Vec<Arc<Arena>>,
    status: Vec<Status>,
    /// Slots asked for, oldest first.
    pending: VecDeque<usize>,
    /// Slots for the reader to fill, in order.
    queue: VecDeque<usize>,
    /// Where encoded layers are staged; None while the reader has it out.
    stage: Option<Stage>,
    /// Whether the slots hold the layers that can be read in place coded, as they lie
    /// (`Plan::ring_coded`).
    coded: bool,
    /// Bytes each layer takes in a slot of this ring.
    lens: Vec<usize>,
    stop: bool,
    /// Whether the reader is still running.
    alive: usize,
}

impl RingState {
    /// Give up slot `s`'s request.
    fn discard(&mut self, s: usize) {
        self.status[s] = match self.status[s] {
            Status::Reading(_) | Status::Discard => Status::Discard,
            _ => Status::Free,
        };
        self.queue.retain(|&q| q != s);
    }

    /// Ask for layer `il`, of `len` bytes, in a free slot it fits: the smallest one whose
    /// layers are not lent out when there is one, else the smallest; None when every slot it
    /// fits is asked for or still being read.
    fn ask(&mut self, il: usize, len: usize) -> Option<usize> {
        let free = |st: &RingState, s: usize| {
            matches!(st.status[s], Status::Free) && st.slots[s].is_some() && st.caps[s] >= len
        };
        let n = self.slots.len();
        let smallest =
            |ok: &dyn Fn(usize) -> bool| (0..n).filter(|&s| ok(s)).min_by_key(|&s| self.caps[s]);
        let s =
            smallest(&|s| free(self, s) && self.slots[s].as_ref().is_some_and(|x| !x.is_lent()))
                .or_else(|| smallest(&|s| free(self, s)))?;
        self.status[s] = Status::Queued(il);
        self.queue.push_back(s);
        self.pending.push_back(s);
        Some(s)
    }
}

/// The bytes a layer takes in a slot and stages, in a ring that holds layers decoded (0) and
/// coded (1).
#[derive(Debug)]
struct LayoutSizes {
    len: [usize; 2],
    staged: [usize; 2],
}

/// The read-ahead ring: its slots, their state, and the reader thread that fills them.
#[derive(Debug)]
pub(super) struct LayerRing {
    state: Leaf<RingState>,
    changed: Condvar,
    /// How each layer is read.
    layouts: Vec<LayoutSizes>,
    /// The trunk, to size the staging's list of pieces.
    trunk: Option<Arc<Trunk>>,
    /// Layers of the model (a slot keeps one bound layer per layer it has held).
    layers: usize,
    /// The reader's pool, and every thread the reader runs on, joined when it stops: nothing
    /// of the ring runs (or allocates) after the store is gone.
    pool: Leaf<Option<rayon::ThreadPool>>,
    threads: Arc<Leaf<Vec<std::thread::JoinHandle<()>>>>,
}

impl LayerRing {
    /// A ring with no slot yet (see [`LayerRing::resize`]) and its reader thread, reading
    /// from `src`.
    pub(super) fn start(src: Source) -> std::io::Result<Arc<LayerRing>> {
        let ring = Arc::new(LayerRing {
            state: Leaf::new(RingState {
                slots: Vec::new(),
                caps: Vec::new(),
                arenas: Vec::new(),
                status: Vec::new(),
                pending: VecDeque::new(),
                queue: VecDeque::new(),
                stage: Some(Stage::default()),
                coded: false,
                lens: src.table.layouts.iter().map(|l| l.len(false)).collect(),
                stop: false,
                alive: 0,
            }),
            changed: Condvar::new(),
            layouts: (src.table.layouts.iter())
                .map(|l| LayoutSizes {
                    len: [l.len(false), l.len(true)],
                    staged: [l.staged(false), l.staged(true)],
                })
                .collect(),
            trunk: src.trunk.clone(),
            layers: src.cfg.num_hidden_layers,
            pool: Leaf::new(None),
            threads: Arc::new(Leaf::new(Vec::new())),
        });
        let reader = Arc::clone(&ring);
        // The reader runs on a thread of a pool of its own, whose other threads take the
        // pieces of its reads straight from its queue (a thread outside a pool hands work to
        // it through the pool's shared queue, which allocates now and then). It is as wide as
        // the I/O pool; with none, the reader reads alone.
        match crate::stream::checkpoint::io_pool().map(rayon::ThreadPool::current_num_threads) {
            Some(n) => {
                ring.state.lock().alive = 1;
                let threads = Arc::clone(&ring.threads);
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(n.max(2))
                    .spawn_handler(move |t| {
                        let h = std::thread::Builder::new()
                            .name(format!("k3-reader-{}", t.index()))
                            .spawn(move || t.run())?;
                        threads.lock().push(h);
                        Ok(())
                    })
                    .build()
                    .map_err(std::io::Error::other)?;
                pool.spawn(move || {
                    reader.read(&src);
                    reader.exited();
                });
                *ring.pool.lock() = Some(pool);
            }
            None => {
                ring.state.lock().alive = 1;
                let h = std::thread::Builder::new()
                    .name("k3-reader".into())
                    .spawn(move || {
                        reader.read(&src);
                        reader.exited();
                    })?;
                ring.threads.lock().push(h);
            }
        }
        Ok(ring)
    }

    /// The reader thread: fill the queued slots in order until stopped.
    fn read(&self, src: &Source) {
        let mut g = self.state.lock();
        loop {
            // The staging memory may be out with a pinned layer being loaded: wait for it
            // before taking a request (whose status may change while waiting).
            if g.stage.is_none() && !g.stop {
                g = g.wait(&self.changed);
                continue;
            }
            let Some(s) = g.queue.pop_front() else {
                if g.stop {
                    return;
                }
                g = g.wait(&self.changed);
                continue;
            };
            let Status::Queued(il) = g.status[s] else {
                continue;
            };
            let Some(mut slot) = g.slots[s].take() else {
                continue;
            };
            let mut stage = g.stage.take().unwrap_or_default();
            g.status[s] = Status::Reading(il);
            let coded = g.coded;
            drop(g);
            // A slot whose last layer is still lent out is waited for: the forward pass
            // gives a layer back before it asks for the next.
            let result = loop {
                if let Some(r) = src.fill(&mut slot, &mut stage, il, coded) {
                    break Some(r);
                }
                if matches!(self.state.lock().status[s], Status::Discard) {
                    break None;
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
            };
            g = self.state.lock();
            g.slots[s] = Some(slot);
            g.stage = Some(stage);
            g.status[s] = match (&g.status[s], result) {
                (Status::Reading(_), Some(r)) => Status::Ready(il, r),
                _ => Status::Free,
            };
            self.changed.notify_all();
        }
    }

    /// Layer `il`: the one read ahead for it, waited for, or else read now. Requests
    /// ahead of it that were not taken are given up.
    pub(super) fn take(&self, il: usize) -> LayerResult {
        let mut g = self.state.lock();
        while let Some(&s) = g.pending.front() {
            if g.status[s].layer() == Some(il) {
                break;
            }
            g.pending.pop_front();
            g.discard(s);
        }
        let s = loop {
            if let Some(s) = g.pending.pop_front() {
                break s;
            }
            let len = g.lens.get(il).copied().unwrap_or(0);
            if !g.caps.iter().any(|&c| c >= len) {
                return Err(StreamError::Unrepresentable {
                    path: std::path::PathBuf::new(),
                    name: format!("layer {il}"),
                    reason: if g.slots.is_empty() {
                        "the read-ahead ring has no slot".into()
                    } else {
                        "larger than every slot of the read-ahead ring".into()
                    },
                });
            }
            if g.ask(il, len).is_some() {
                self.changed.notify_all();
            } else {
                g = g.wait(&self.changed);
            }
        };
        loop {
            if let Status::Ready(..) = g.status[s] {
                if let Status::Ready(_, r) = std::mem::replace(&mut g.status[s], Status::Free) {
                    return r;
                }
            }
            g = g.wait(&self.changed);
        }
    }

    /// Read layer `il` ahead, if fewer than `depth` layers are asked for and `il` is not one
    /// of them. Returns whether more may be asked for.
    pub(super) fn read_ahead(&self, il: usize, depth: usize) -> bool {
        let mut g = self.state.lock();
        if g.pending.len() >= depth {
            return false;
        }
        if g.pending.iter().any(|&s| g.status[s].layer() == Some(il)) {
            return false;
        }
        let len = g.lens.get(il).copied().unwrap_or(0);
        let asked = g.ask(il, len).is_some();
        if asked {
            self.changed.notify_all();
        }
        asked && g.pending.len() < depth
    }

    /// Drop every request, wait for the reader to finish the read under way, and make
    /// `slots` slots of the sizes of the `slots` largest layers `pinned` leaves streamed (the
    /// layers bound to the old slots go with them), holding layers `coded` or not
    /// (`Plan::ring_coded`), and a staging of `stage` bytes (at least the largest window an
    /// encoded run needs, when any layer is stored encoded and not read in place). `None`:
    /// no staging, for a plan that pins every layer and has none left to load.
    pub(super) fn resize(
        &self,
        slots: usize,
        pinned: &[bool],
        stage: Option<usize>,
        coded: bool,
    ) -> std::io::Result<()> {
        let mut g = self.state.lock();
        while let Some(s) = g.pending.pop_front() {
            g.discard(s);
        }
        while g
            .status
            .iter()
            .any(|s| matches!(s, Status::Reading(_) | Status::Discard))
        {
            g = g.wait(&self.changed);
        }
        g.slots.clear();
        g.caps.clear();
        g.status.clear();
        g.queue.clear();
        g.arenas.clear();
        let mode = usize::from(coded);
        g.coded = coded;
        g.lens = self.layouts.iter().map(|l| l.len[mode]).collect();
        let mut lens: Vec<usize> = (g.lens.iter().enumerate())
            .filter(|&(il, _)| !pinned.get(il).copied().unwrap_or(false))
            .map(|(_, &n)| n)
            .collect();
        lens.sort_unstable_by(|a, b| b.cmp(a));
        // The staging of the largest window an encoded run needs, streamed or pinned: a
        // pinned layer stored encoded is read through it and decoded from there too (see
        // [`load_encoded`]). None when no layer is stored encoded. It may be out with a layer
        // being loaded.
        while g.stage.is_none() {
            g = g.wait(&self.changed);
        }
        let window = (self.layouts.iter())
            .map(|l| l.staged[mode])
            .max()
            .unwrap_or(0);
        let staged = match stage {
            Some(stage) if window > 0 => stage.max(window),
            _ => 0,
        };
        g.stage = Some(Stage::default());
        if staged > 0 {
            let stage_arena = Arena::new(staged);
            stage_arena.set_slots(1)?;
            g.stage = Some(Stage {
                mem: stage_arena.take(),
                scratch: self
                    .trunk
                    .as_deref()
                    .map(Trunk::decode_scratch)
                    .unwrap_or_default(),
            });
        }
        // With fewer streamed layers than slots, the extra slots are the smallest's size.
        let last = lens.last().copied().unwrap_or(0);
        for i in 0..slots {
            let arena = Arena::new(lens.get(i).copied().unwrap_or(last).max(1));
            arena.set_slots(1)?;
            let slot = RingSlot::new(&arena, self.layers).ok_or_else(|| {
                std::io::Error::other("the read-ahead ring's memory has no free slot")
            })?;
            g.caps.push(slot.capacity());
            g.slots.push(Some(slot));
            g.status.push(Status::Free);
            g.arenas.push(arena);
        }
        g.pending.reserve(slots);
        g.queue.reserve(slots);
        Ok(())
    }

    /// Run `f` with the staging memory, waited for while the reader has it out; it goes back
    /// when `f` returns.
    fn with_stage<R>(&self, f: impl FnOnce(&mut Stage) -> R) -> R {
        let mut g = self.state.lock();
        let mut stage = loop {
            if let Some(st) = g.stage.take() {
                break st;
            }
            g = g.wait(&self.changed);
        };
        drop(g);
        let r = f(&mut stage);
        self.state.lock().stage = Some(stage);
        self.changed.notify_all();
        r
    }

    /// Release the staging memory (waited for while a read has it out): for a plan that pins
    /// every layer, once they are loaded.
    pub(super) fn release_stage(&self) {
        let mut g = self.state.lock();
        while g.stage.is_none() {
            g = g.wait(&self.changed);
        }
        let held = g.stage.replace(Stage::default());
        drop(g);
        self.changed.notify_all();
        drop(held);
    }

    /// Bytes of the staging memory held now.
    pub(super) fn stage_bytes(&self) -> u64 {
        let g = self.state.lock();
        g.stage
            .as_ref()
            .and_then(|st| st.mem.as_ref())
            .map_or(0, |m| m.len() as u64)
    }

    /// Bytes of the ring's slots.
    pub(super) fn bytes(&self) -> u64 {
        self.state.lock().caps.iter().map(|&c| c as u64).sum()
    }

    /// The reader has returned.
    fn exited(&self) {
        let mut g = self.state.lock();
        g.alive = g.alive.saturating_sub(1);
        self.changed.notify_all();
    }

    /// Stop the reader, and wait until its threads have ended.
    pub(super) fn stop(&self) {
        let mut g = self.state.lock();
        g.stop = true;
        self.changed.notify_all();
        while g.alive > 0 {
            g = g.wait(&self.changed);
        }
        drop(g);
        // With no job left, a dropped pool's threads end.
        drop(self.pool.lock().take());
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            let _ = t.join();
        }
    }
}
