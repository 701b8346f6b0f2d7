//! placeholder (replaced by the sampler module)
/// e
#[derive(Debug, thiserror::Error)]
#[error("sample")]
pub struct SampleError;
