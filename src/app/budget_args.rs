//! Memory-budget flags (and the packed trunk) shared by `k3 run`, `k3 chat`, `k3 plan` and
//! `k3 bench`.

use crate::stream::budget::{self, BudgetRequest};
use crate::{Error, Result};
use clap::Args;

/// How much memory the model may use.
#[derive(Clone, Debug, Default, Args)]
pub struct BudgetArgs {
    /// Total memory budget in GB (decimal); the plan fits everything in it.
    #[arg(long, value_name = "GB", conflicts_with_all = ["preset", "trunk_gb", "cache_gb"])]
    pub mem: Option<f64>,
    /// A named budget: ultra, laptop, desktop, workstation, server, max.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["trunk_gb", "cache_gb"])]
    pub preset: Option<String>,
    /// Trunk budget in GB (with --cache-gb); 0 keeps the whole trunk resident. The two
    /// numbers together are the budget.
    #[arg(long, value_name = "GB", requires = "cache_gb")]
    pub trunk_gb: Option<f64>,
    /// Expert-cache budget in GB (with --trunk-gb).
    #[arg(long, value_name = "GB", requires = "trunk_gb")]
    pub cache_gb: Option<f64>,
    /// A packed trunk written by `k3 pack` for this checkpoint: layers are read from it in one
    /// sequential pass each. Tokens do not depend on it.
    #[arg(long, value_name = "DIR")]
    pub trunk: Option<std::path::PathBuf>,
}

/// Largest budget accepted, in GB (a million: far above any machine, far below overflow).
const MAX_BUDGET_GB: f64 = 1e6;

fn bytes(gb: f64, flag: &str) -> Result<u64> {
    if gb.is_finite() && gb > 0.0 && gb < MAX_BUDGET_GB {
        Ok((gb * 1e9) as u64)
    } else if gb.is_finite() && gb >= MAX_BUDGET_GB {
        Err(Error::Usage(format!(
            "{flag}: {gb} GB is above the largest budget accepted ({MAX_BUDGET_GB:e} GB)"
        )))
    } else {
        Err(Error::Usage(format!(
            "{flag}: {gb} is not a positive number of GB"
        )))
    }
}

/// Memory available to this process: `MemAvailable`, capped by a cgroup limit.
#[must_use]
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let avail = meminfo
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))?
        .split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()?
        * 1024;
    Some(budget::cgroup_limit().map_or(avail, |c| c.min(avail)))
}

impl BudgetArgs {
    /// The request these flags make; `default` when none is given.
    pub fn request(&self, default: BudgetRequest) -> Result<BudgetRequest> {
        if let Some(gb) = self.mem {
            return Ok(BudgetRequest::Total(bytes(gb, "--mem")?));
        }
        if let Some(name) = &self.preset {
            return budget::preset(name).ok_or_else(|| {
                let names: Vec<&str> = budget::PRESETS.iter().map(|p| p.0).collect();
                Error::Usage(format!("--preset {name:?}: one of {}", names.join(", ")))
            });
        }
        if let (Some(t), Some(c)) = (self.trunk_gb, self.cache_gb) {
            return Ok(BudgetRequest::Split {
                trunk: if t == 0.0 {
                    None
                } else {
                    Some(bytes(t, "--trunk-gb")?)
                },
                cache: bytes(c, "--cache-gb")?,
            });
        }
        Ok(default)
    }

    /// Whether any budget flag was given.
    #[must_use]
    pub fn given(&self) -> bool {
        self.mem.is_some() || self.preset.is_some() || self.trunk_gb.is_some()
    }
}

/// The automatic budget: 80% of the memory available now.
#[must_use]
pub fn auto_request() -> BudgetRequest {
    available_bytes().map_or(BudgetRequest::Resident, |a| {
        BudgetRequest::Total(a / 10 * 8)
    })
}
