//! Engine statistics: a cheap, cloneable snapshot the front ends poll (tokens/s, memory, disk,
//! expert-cache residency, compute vs I/O time). Everything here is a measurement; nothing
//! feeds back into the arithmetic.

use serde::Serialize;

/// Where a layer's weights live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Residency {
    /// Held in memory for the whole run.
    Pinned,
    /// Streamed from disk through the read-ahead ring.
    Ring,
}

/// One layer's residency.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LayerResidency {
    /// Trunk weights.
    pub trunk: Residency,
    /// Routed experts of this layer currently resident.
    pub experts_resident: u32,
    /// Routed experts of this layer.
    pub experts_total: u32,
}

/// A snapshot of the engine's figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StatsSnapshot {
    /// Tokens per second over the most recent token.
    pub tokens_per_second: f64,
    /// Tokens generated in the current turn.
    pub turn_tokens: u64,
    /// Seconds spent generating in the current turn.
    pub turn_seconds: f64,
    /// Prompt tokens already prefilled in the current turn.
    pub prefill_done: u64,
    /// Prompt tokens to prefill in the current turn.
    pub prefill_total: u64,
    /// Resident set size now (bytes).
    pub rss_bytes: u64,
    /// Peak resident set size (bytes).
    pub peak_rss_bytes: u64,
    /// Memory budget in force (bytes); `None` when the whole model is held resident.
    pub budget_bytes: Option<u64>,
    /// Bytes of weights in the checkpoint.
    pub model_bytes: u64,
    /// Bytes read from the checkpoint since start.
    pub disk_bytes_read: u64,
    /// Bytes read from the checkpoint in the current turn.
    pub turn_disk_bytes: u64,
    /// Disk throughput over the most recent token (MB/s).
    pub disk_mb_per_s: f64,
    /// Routed-expert lookups that found the expert in memory.
    pub expert_hits: u64,
    /// Routed-expert lookups that had to read it.
    pub expert_misses: u64,
    /// Per layer residency.
    pub layers: Vec<LayerResidency>,
    /// Seconds spent computing since start.
    pub compute_seconds: f64,
    /// Seconds spent waiting on reads since start.
    pub io_wait_seconds: f64,
    /// Routed experts read ahead of their layer on a prediction.
    pub prefetch_reads: u64,
    /// Of those, the ones their layer then asked for.
    pub prefetch_used: u64,
    /// Experts predicted for the next layer (top-k per prediction).
    pub predicted: u64,
    /// Of those, the ones the next layer chose.
    pub predicted_right: u64,
    /// Predictions made and checked against their layer's routing.
    pub predictions: u64,
    /// Per rank of a prediction (the most likely first): how many times its layer chose it.
    pub predicted_right_by_rank: Vec<u64>,
    /// Early predictions (from the previous layer's FFN input, before its experts) checked
    /// against their layer's routing.
    pub early_predictions: u64,
    /// Per rank of an early prediction: how many times its layer chose it.
    pub early_predicted_right_by_rank: Vec<u64>,
    /// Predicted reads dropped before they started (their layer's routing came first).
    pub prefetch_cancelled: u64,
    /// Whether the early prediction is fixed or chosen by timing, and what the timing did.
    pub early: super::trial::TrialStats,
    /// Positions the session holds.
    pub positions: u64,
    /// Most positions the session may hold.
    pub context_limit: u64,
    /// The least budget the plan in force can run under (0 when the model is resident).
    pub floor_bytes: u64,
    /// Speculative decoding since start: forward passes while decoding.
    pub spec_passes: u64,
    /// Tokens proposed by the drafter.
    pub spec_proposed: u64,
    /// Proposed tokens that were used.
    pub spec_accepted: u64,
    /// Decoding steps (tokens whose logits a pass produced).
    pub spec_steps: u64,
    /// The expert slot arena: slots, how they were faulted in, huge pages, heap fallbacks.
    pub arena: super::arena::ArenaStats,
    /// Bytes of the read-ahead ring's slots (the memory streamed layers are read into).
    pub ring_bytes: u64,
    /// Bytes of the staging encoded runs are read through, held now (none once a plan that
    /// pins every layer has loaded them).
    pub stage_bytes: u64,
}

/// Per rank, how often it was right out of `n` predictions.
fn accuracy(right_by_rank: &[u64], n: u64) -> Vec<f64> {
    let n = n.max(1) as f64;
    right_by_rank.iter().map(|&r| r as f64 / n).collect()
}

impl StatsSnapshot {
    /// Decoding steps per forward pass (1.0 without speculation; 0 before any).
    #[must_use]
    pub fn tokens_per_pass(&self) -> f64 {
        if self.spec_passes == 0 {
            0.0
        } else {
            self.spec_steps as f64 / self.spec_passes as f64
        }
    }

    /// Per rank of a prediction, the fraction of predictions whose layer chose that expert
    /// (empty before any prediction).
    #[must_use]
    pub fn prediction_accuracy_by_rank(&self) -> Vec<f64> {
        accuracy(&self.predicted_right_by_rank, self.predictions)
    }

    /// [`StatsSnapshot::prediction_accuracy_by_rank`] of the early predictions.
    #[must_use]
    pub fn early_prediction_accuracy_by_rank(&self) -> Vec<f64> {
        accuracy(&self.early_predicted_right_by_rank, self.early_predictions)
    }

    /// Hits over lookups (1.0 when nothing was looked up).
    #[must_use]
    pub fn expert_hit_rate(&self) -> f64 {
        let n = self.expert_hits + self.expert_misses;
        if n == 0 {
            1.0
        } else {
            self.expert_hits as f64 / n as f64
        }
    }
}

/// Resident and peak set size of this process from `/proc/self/status` (0 where unavailable).
#[must_use]
pub fn rss_bytes() -> (u64, u64) {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return (0, 0);
    };
    let field = |key: &str| {
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The machine's CPU time so far, in clock ticks, from the `cpu` line of `/proc/stat`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuTicks {
    /// Time the hypervisor gave this machine's CPUs to something else while they had work.
    pub steal: u64,
    /// All of it: user, nice, system, idle, iowait, irq, softirq and steal.
    pub total: u64,
}

impl CpuTicks {
    /// Now, or None where `/proc/stat` cannot be read (not Linux).
    #[must_use]
    pub fn now() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// The `cpu` line of a `/proc/stat` text (None if it has none, or fewer than the eight
    /// fields through `steal`). Guest time is already counted in user time, so it is not added.
    #[must_use]
    pub fn parse(stat: &str) -> Option<Self> {
        let line = stat
            .lines()
            .find(|l| l.split_whitespace().next() == Some("cpu"))?;
        let f: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(str::parse)
            .collect::<std::result::Result<_, _>>()
            .ok()?;
        (f.len() == 8).then(|| Self {
            steal: f[7],
            total: f.iter().sum(),
        })
    }

    /// The fraction of the machine's CPU time stolen between `earlier` and `self` (None when
    /// no time passed, or the counters went backwards).
    #[must_use]
    pub fn steal_fraction_since(&self, earlier: &Self) -> Option<f64> {
        let total = self.total.checked_sub(earlier.total)?;
        let steal = self.steal.checked_sub(earlier.steal)?;
        (total > 0).then(|| steal as f64 / total as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::CpuTicks;

    const STAT: &str = "cpu  100 5 50 800 10 1 2 32 7 0\n\
                        cpu0 50 2 25 400 5 0 1 16 3 0\n\
                        intr 12345\n";

    #[test]
    fn the_cpu_line_gives_the_stolen_and_the_total_ticks() {
        let t = CpuTicks::parse(STAT).expect("a cpu line");
        assert_eq!(
            t,
            CpuTicks {
                steal: 32,
                total: 1000
            }
        );
        // A kernel without the steal field, and a text without a cpu line, give nothing.
        assert_eq!(CpuTicks::parse("cpu  1 2 3 4 5 6 7\n"), None);
        assert_eq!(CpuTicks::parse("cpu0 1 2 3 4 5 6 7 8\n"), None);
        assert_eq!(CpuTicks::parse("cpu  1 2 x 4 5 6 7 8\n"), None);
    }

    #[test]
    fn the_steal_fraction_is_stolen_over_all_ticks_between_two_readings() {
        let a = CpuTicks {
            steal: 32,
            total: 1000,
        };
        let b = CpuTicks {
            steal: 82,
            total: 1200,
        };
        assert_eq!(b.steal_fraction_since(&a), Some(0.25));
        assert_eq!(a.steal_fraction_since(&a), None);
        assert_eq!(a.steal_fraction_since(&b), None);
        if cfg!(target_os = "linux") {
            let now = CpuTicks::now().expect("/proc/stat on Linux");
            assert!(now.total > 0 && now.steal <= now.total);
        }
    }
}
