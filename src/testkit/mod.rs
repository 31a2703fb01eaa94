//! Support for the tests and ep-bench (feature `testkit`; not part of the
//! stable API): seeded routing and token generators ([`workload`]) and the
//! launchers of `kernels-cuda/util.cu` ([`copy`]: a pattern writer and
//! checker, the SM and bulk-copy loops that measure the NVLink ceilings),
//! NCCL's all-to-all of the same rows and the timed runs' start line
//! ([`nccl`]), and the multi-rank test harness ([`ranks`]: real GPUs or
//! virtual ranks).

pub mod copy;
pub mod nccl;
pub mod ranks;
pub mod workload;
