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
