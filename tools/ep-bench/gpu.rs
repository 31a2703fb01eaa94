//! Placeholder while the GPU half of ep-bench is written (same session).
use crate::cli::{Case, Opts};
use crate::launch::RankEnv;
use crate::report::CaseResult;
pub fn device_count() -> Result<usize, String> {
    moe_ep::device_count().map_err(|e| e.to_string())
}
pub fn nccl_unique_id() -> Result<[u8; 128], String> {
    Err("not yet".into())
}
pub fn run_rank(_: &Opts, _: &[Case], _: &RankEnv) -> Result<Vec<CaseResult>, String> {
    Err("not yet".into())
}
