//! Opening a checkpoint as a [`Model`]: the config, the memory plan, and the weights bound to
//! the graph (`bind.rs`) either all in memory or through the [`Streamer`].

use super::bind::{bind_model, Binder};
pub use super::bind::{model_sizes, names, BindError};
use super::config::ModelConfig;
use super::model::Model;
use super::residency::Streamer;
use super::store::ResidentWeights;
use crate::stream::budget::{BudgetRequest, ModelSizes, Plan};
use crate::stream::trunk::{Trunk, TrunkError};
use crate::stream::{Checkpoint, StreamError};
use std::path::{Path, PathBuf};

/// Failure while loading a model.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Config refused.
    #[error(transparent)]
    Config(#[from] super::config::ConfigError),
    /// Files refused or unreadable.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// Graph mismatch.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The memory budget is below what the model needs to run.
    #[error("{0}")]
    Budget(String),
    /// The packed trunk is unusable.
    #[error(transparent)]
    Trunk(#[from] TrunkError),
}

/// What loading read, and the plan it followed.
#[derive(Clone, Debug)]
pub struct LoadInfo {
    /// Tensor bytes read.
    pub bytes_read: u64,
    /// SHA-256 over every tensor's name, dtype, shape and offset.
    pub index_digest: [u8; 32],
    /// The memory plan.
    pub plan: Plan,
    /// The model's byte sizes.
    pub sizes: ModelSizes,
}

/// Check that the checkpoint binds to `cfg` (names, shapes, dtypes, nothing unclaimed)
/// without reading any weight.
pub fn check_graph(cfg: &ModelConfig, ck: &Checkpoint) -> Result<(), LoadError> {
    let mut check = Binder::new(ck, false, true);
    let ok = bind_model(&mut check, cfg, false)?.is_some();
    check.into_result()?;
    if ok {
        Ok(())
    } else {
        Err(BindError::one(ck.dir(), "incomplete graph").into())
    }
}

/// How [`Model::open_with`] opens a checkpoint.
#[derive(Clone)]
pub struct OpenOptions {
    /// The memory budget.
    pub budget: BudgetRequest,
    /// Context length the plan reserves state for.
    pub context: u64,
    /// Sequence states of that length the plan reserves room for (1 + a chat's snapshots).
    pub states: u64,
    /// A packed trunk directory (`k3 pack`) to read layers from.
    pub trunk: Option<PathBuf>,
    /// Read with `O_DIRECT` where the filesystem allows it (streamed weights and the trunk);
    /// off with `K3_NO_DIRECT=1`.
    pub direct: bool,
    /// Take the weights the plan keeps resident (pinned layers, the output head, or the
    /// whole model) in place from read-only mappings of the shards instead of reading them
    /// into the heap; off with `K3_MMAP=0`. Streamed layers and experts are always read.
    pub mapped: bool,
    /// Called with (bytes read, bytes to read) while loading.
    pub progress: Option<std::sync::Arc<dyn Fn(u64, u64) + Send + Sync>>,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            budget: BudgetRequest::Resident,
            context: 4096,
            states: 1,
            trunk: None,
            direct: crate::tuning::Tuning::get().direct_io,
            mapped: crate::tuning::Tuning::get().mmap,
            progress: None,
        }
    }
}

impl Model {
    /// Load `dir/config.json` and every weight of the checkpoint in `dir`, resident.
    pub fn load(dir: &Path) -> Result<Model, LoadError> {
        Self::load_counted(dir).map(|(m, _)| m)
    }

    /// [`Model::load`], also returning the number of tensor bytes read.
    pub fn load_counted(dir: &Path) -> Result<(Model, u64), LoadError> {
        Self::load_full(dir).map(|(m, info)| (m, info.bytes_read))
    }

    /// [`Model::load`], also returning what was read and a digest of the tensor index.
    pub fn load_full(dir: &Path) -> Result<(Model, LoadInfo), LoadError> {
        Self::open(dir, BudgetRequest::Resident, 4096)
    }

    /// Open the checkpoint in `dir` under a memory budget: everything is validated first
    /// (names, shapes, dtypes, unclaimed tensors); a resident request reads everything, any
    /// other reads only what the plan pins and streams the rest. `context` sizes the state
    /// reserve of the plan.
    pub fn open(
        dir: &Path,
        req: BudgetRequest,
        context: u64,
    ) -> Result<(Model, LoadInfo), LoadError> {
        Self::open_with_progress(dir, req, context, None)
    }

    /// [`Model::open`], calling `progress(done, total)` as weight bytes are read.
    pub fn open_with_progress(
        dir: &Path,
        req: BudgetRequest,
        context: u64,
        progress: Option<std::sync::Arc<dyn Fn(u64, u64) + Send + Sync>>,
    ) -> Result<(Model, LoadInfo), LoadError> {
        Self::open_with(
            dir,
            &OpenOptions {
                budget: req,
                context,
                progress,
                ..OpenOptions::default()
            },
        )
    }

    /// Open the checkpoint in `dir` as `opts` say (budget, packed trunk, direct I/O).
    pub fn open_with(dir: &Path, opts: &OpenOptions) -> Result<(Model, LoadInfo), LoadError> {
        let (req, context, progress) = (opts.budget, opts.context, opts.progress.clone());
        // The one-token products' row order is chosen once per process, before any pass.
        crate::kernels::calibrate_row_order();
        let cfg = ModelConfig::load(&dir.join("config.json"))?;
        let mut ck = Checkpoint::open(dir)?;
        let trunk = match &opts.trunk {
            Some(t) => {
                let mut t = Trunk::open(t, &ck, cfg.num_hidden_layers)?;
                t.set_direct(opts.direct);
                Some(std::sync::Arc::new(t))
            }
            None => None,
        };
        let digest = ck.index_digest();
        let mut sizes = model_sizes(&cfg, &ck);
        if let Some(t) = &trunk {
            t.manifest().sizes_into(&mut sizes, names::LM_HEAD);
        }
        let plan = crate::stream::budget::plan_states(
            &sizes,
            req,
            context,
            opts.states,
            crate::stream::budget::cgroup_limit(),
        )
        .map_err(|e| LoadError::Budget(e.to_string()))?;
        if let Some(p) = progress {
            let total = if plan.budget_bytes.is_none() {
                sizes.model_bytes()
            } else {
                plan.pinned_bytes
                    + if plan.head_resident {
                        sizes.held_head(&plan)
                    } else {
                        0
                    }
                    + sizes.small
            };
            ck.set_progress(Box::new(move |done| p(done.min(total), total)));
        }
        if plan.budget_bytes.is_none() {
            let coded = (plan.pin_coded, plan.head_coded);
            let model = Self::bind_opts(cfg, &ck, trunk.as_deref(), opts.mapped, coded)?;
            let info = LoadInfo {
                bytes_read: ck.bytes_read(),
                index_digest: digest,
                plan,
                sizes,
            };
            return Ok((model, info));
        }
        // Validate the whole graph (names, shapes, dtypes, nothing unclaimed: CPU work on
        // the index, no weight read) while the plan's weights are read (I/O), and refuse the
        // checkpoint with the validation's error when it fails, whatever the reading found.
        ck.set_drop_behind(true);
        ck.set_direct(opts.direct);
        let ck = std::sync::Arc::new(ck);
        let (checked, streamer) = std::thread::scope(|sc| {
            let check = sc.spawn(|| {
                let checked = check_graph(&cfg, &ck);
                if checked.is_err() {
                    // Whatever is still to read would be thrown away.
                    ck.stop_loading();
                }
                checked
            });
            let streamer = Self::open_streamed(&cfg, &ck, trunk, &sizes, &plan, opts.mapped);
            let checked = check.join().unwrap_or_else(|_| {
                Err(BindError::one(dir, "the thread validating the graph failed").into())
            });
            (checked, streamer)
        });
        checked?;
        let (streamer, norm, out_res_fold) = streamer?;
        let info = LoadInfo {
            bytes_read: streamer.stats().disk_bytes_read,
            index_digest: digest,
            plan,
            sizes,
        };
        let model = Model {
            cfg,
            out_res_fold,
            norm,
            weights: Box::new(streamer),
        };
        Ok((model, info))
    }

    /// The final norm, the output AttnRes fold and a streamer holding what `plan` keeps
    /// resident, read from `ck`.
    fn open_streamed(
        cfg: &ModelConfig,
        ck: &std::sync::Arc<Checkpoint>,
        trunk: Option<std::sync::Arc<Trunk>>,
        sizes: &ModelSizes,
        plan: &Plan,
        mapped: bool,
    ) -> Result<(Streamer, Vec<f32>, Vec<f32>), LoadError> {
        let dir = ck.dir();
        let mut b = Binder::new(ck, true, false);
        let norm = b.vector(names::NORM, cfg.hidden_size)?;
        let fold = b.fold(names::OUT_RES_NORM, names::OUT_RES_PROJ, cfg.hidden_size)?;
        b.into_result()?;
        let (Some(norm), Some(out_res_fold)) = (norm, fold) else {
            return Err(BindError::one(dir, "final norm").into());
        };
        let streamer = Streamer::new(
            cfg.clone(),
            std::sync::Arc::clone(ck),
            trunk,
            sizes.clone(),
            plan.clone(),
            mapped,
        )?;
        Ok((streamer, norm, out_res_fold))
    }

    /// Bind an open checkpoint to `cfg`, reading every weight.
    pub fn bind(cfg: ModelConfig, ck: &Checkpoint) -> Result<Model, LoadError> {
        Self::bind_with(cfg, ck, None)
    }

    /// [`Model::bind`], reading layers' non-expert tensors from `trunk` when given.
    pub fn bind_with(
        cfg: ModelConfig,
        ck: &Checkpoint,
        trunk: Option<&Trunk>,
    ) -> Result<Model, LoadError> {
        Self::bind_opts(cfg, ck, trunk, false, (false, false))
    }

    /// [`Model::bind_with`], taking the checkpoint's tensors in place from mappings of its
    /// shards when `mapped`, and keeping the trunk's nibble-coded matrices coded where `coded`
    /// says (the layers', the output head's: `Plan::pin_coded`, `Plan::head_coded`).
    fn bind_opts(
        cfg: ModelConfig,
        ck: &Checkpoint,
        trunk: Option<&Trunk>,
        mapped: bool,
        coded: (bool, bool),
    ) -> Result<Model, LoadError> {
        let mut b = Binder::new(ck, true, true)
            .with_trunk(trunk)
            .mapped(mapped)
            .coded(coded.0, coded.1);
        let bound = bind_model(&mut b, &cfg, true)?;
        match bound {
            Some((embed, lm_head, norm, out_res_fold, layers)) if b.problems.is_empty() => {
                let layers = layers.into_iter().map(std::sync::Arc::new).collect();
                let read = ck.bytes_read();
                let weights = ResidentWeights::new(&cfg, embed, layers, lm_head, read);
                Ok(Model {
                    cfg,
                    out_res_fold,
                    norm,
                    weights: Box::new(weights),
                })
            }
            _ => Err(BindError {
                dir: ck.dir().to_path_buf(),
                problems: b.problems,
            }
            .into()),
        }
    }
}
