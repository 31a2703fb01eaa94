//! The kernels of a one-node group ([`Kernels`]): the entry points it loads
//! from `kernels-cuda/layout.cu`, `dispatch.cu`, `combine_pull.cu` and
//! `combine_push.cu` (plus the low-latency ones of `low_latency.cu` for a
//! group of that mode), the dynamic shared memory each launch asks for, and
//! the kernels' view of a [`RecvLayout`].
//!
//! Tests: the unit tests below (every entry point is in its module's PTX;
//! the layout exchange's shared memory).

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ops::abi::{self, LayoutKind};
use crate::ops::config::{Mode, MAX_EXPERTS};
use crate::ops::low_latency::kernels::LlKernels;
use crate::runtime::{Communicator, Function, Module};
use crate::types::RecvLayout;

/// Largest expert-major alignment the kernels take.
const MAX_ALIGNMENT: usize = 4096;

impl RecvLayout {
    /// The kernels' view: the layout kind and the alignment in rows (1 for
    /// rank-major). Handles are made by [`EpGroup::layout`](crate::EpGroup::layout), which checked
    /// the alignment ([`RecvLayout::check_for_kernels`]).
    pub(crate) fn kind(self) -> (LayoutKind, i32) {
        match self {
            RecvLayout::RankMajor => (LayoutKind::RankMajor, 1),
            RecvLayout::ExpertMajor { alignment } => (LayoutKind::ExpertMajor, alignment as i32),
        }
    }

    /// Refuses an alignment the kernels cannot take, naming `layout`.
    pub(crate) fn check_for_kernels(self) -> Result<()> {
        match self {
            RecvLayout::ExpertMajor { alignment }
                if alignment == 0 || alignment > MAX_ALIGNMENT =>
            {
                Err(Error::arg(
                    "layout",
                    format!("ExpertMajor alignment in 1..={MAX_ALIGNMENT}"),
                    alignment,
                ))
            }
            _ => Ok(()),
        }
    }
}

/// Dynamic shared memory of the layout exchange (every scan block asks for
/// it; the last one runs the exchange): two int32 per expert.
pub(crate) fn exchange_smem(num_experts: usize) -> u32 {
    (2 * num_experts * 4) as u32
}

/// The most [`exchange_smem`] asks for: 128 KiB at [`MAX_EXPERTS`], above
/// the 48 KiB a launch gets without raising the kernel's limit.
pub(crate) fn exchange_smem_limit() -> u32 {
    exchange_smem(MAX_EXPERTS)
}

/// `NAME_r2`, `NAME_r4`, `NAME_r8`: a combine kernel per bound on the world.
macro_rules! by_world {
    ($name:literal) => {
        [
            concat!($name, "_r2"),
            concat!($name, "_r4"),
            concat!($name, "_r8"),
        ]
    };
}

// The entry points a group loads: [rank-major, expert-major] where there is
// one per receive layout, [r2, r4, r8] where there is one per world bound.
const LAYOUT_SCAN: [&str; 2] = ["moe_ep_layout_scan_i32", "moe_ep_layout_scan_i64"];
const PUBLISH_REFUSAL: &str = "moe_ep_publish_refusal";
const DISPATCH: [&str; 2] = ["moe_ep_dispatch_rank_major", "moe_ep_dispatch_expert_major"];
const COMBINE_BWD: [&str; 2] = [
    "moe_ep_combine_bwd_rank_major",
    "moe_ep_combine_bwd_expert_major",
];
const COMBINE_PULL: [&str; 3] = by_world!("moe_ep_combine_pull");
const DISPATCH_BWD_PULL: [&str; 3] = by_world!("moe_ep_dispatch_bwd_pull");
const COMBINE_PUSH: [[&str; 3]; 2] = [
    by_world!("moe_ep_combine_push_rank_major"),
    by_world!("moe_ep_combine_push_expert_major"),
];
const DISPATCH_BWD_PUSH: [[&str; 3]; 2] = [
    by_world!("moe_ep_dispatch_bwd_push_rank_major"),
    by_world!("moe_ep_dispatch_bwd_push_expert_major"),
];

/// One kernel per receive layout.
pub(crate) struct ByLayout {
    pub(crate) rank_major: Function,
    pub(crate) expert_major: Function,
}

impl ByLayout {
    fn load(
        names: [&'static str; 2],
        load: impl Fn(&'static str) -> Result<Function>,
    ) -> Result<ByLayout> {
        Ok(ByLayout {
            rank_major: load(names[0])?,
            expert_major: load(names[1])?,
        })
    }
    /// The kernel of `layout`.
    pub(crate) fn of(&self, layout: RecvLayout) -> &Function {
        match layout {
            RecvLayout::RankMajor => &self.rank_major,
            RecvLayout::ExpertMajor { .. } => &self.expert_major,
        }
    }
}

/// The kernels of a group: one entry point per path (the launchers pick),
/// each module loaded once per context.
pub(crate) struct Kernels {
    // layout.cu
    pub(crate) layout_scan_i32: Function,
    pub(crate) layout_scan_i64: Function,
    pub(crate) publish_refusal: Function,
    // dispatch.cu
    pub(crate) dispatch: ByLayout,
    pub(crate) combine_bwd: ByLayout,
    // combine_pull.cu and combine_push.cu: the smallest compile-time world
    // bound that fits (registers); every one may take COMBINE_SMEM of
    // dynamic shared memory (the pushed rank-major bulk-copy ring), the
    // pushed expert-major ones EM_COMBINE_SMEM (their stages).
    pub(crate) combine_pull: Function,
    pub(crate) dispatch_bwd_pull: Function,
    pub(crate) combine_push: ByLayout,
    pub(crate) dispatch_bwd_push: ByLayout,
    // low_latency.cu, for a group of that mode.
    pub(crate) ll: Option<LlKernels>,
}

impl Kernels {
    pub(crate) fn load(comm: &Communicator, mode: Mode) -> Result<Kernels> {
        let ctx = comm.context();
        let (layout, dispatch) = (Module::get(ctx, "layout")?, Module::get(ctx, "dispatch")?);
        let (pull, push) = (
            Module::get(ctx, "combine_pull")?,
            Module::get(ctx, "combine_push")?,
        );
        let bound = match comm.world() {
            0..=2 => 0,
            3..=4 => 1,
            _ => 2,
        };
        let pick = |names: [&'static str; 3]| names[bound];
        let combine_with = |m: &Arc<Module>, name: &'static str, smem: u32| -> Result<Function> {
            let f = m.function(name)?;
            f.allow_dynamic_smem(smem)?;
            Ok(f)
        };
        let combine =
            |m: &Arc<Module>, name: &'static str| combine_with(m, name, abi::COMBINE_SMEM);
        // The expert-major pushed kernels: their own stages (EM_COMBINE_SMEM).
        let em_push = |f: &'static str| {
            let smem = if f.contains("expert_major") {
                abi::EM_COMBINE_SMEM
            } else {
                abi::COMBINE_SMEM
            };
            combine_with(&push, f, smem)
        };
        Ok(Kernels {
            // The scan's last block runs the exchange, whose per-expert
            // arrays take up to 2 x MAX_EXPERTS int32 (128 KiB): above the
            // default 48 KiB.
            layout_scan_i32: {
                let f = layout.function(LAYOUT_SCAN[0])?;
                f.allow_dynamic_smem(exchange_smem_limit())?;
                f
            },
            layout_scan_i64: {
                let f = layout.function(LAYOUT_SCAN[1])?;
                f.allow_dynamic_smem(exchange_smem_limit())?;
                f
            },
            publish_refusal: layout.function(PUBLISH_REFUSAL)?,
            dispatch: ByLayout::load(DISPATCH, |f| dispatch.function(f))?,
            combine_bwd: ByLayout::load(COMBINE_BWD, |f| dispatch.function(f))?,
            combine_pull: combine(&pull, pick(COMBINE_PULL))?,
            dispatch_bwd_pull: combine(&pull, pick(DISPATCH_BWD_PULL))?,
            combine_push: ByLayout::load(COMBINE_PUSH.map(pick), em_push)?,
            dispatch_bwd_push: ByLayout::load(DISPATCH_BWD_PUSH.map(pick), em_push)?,
            ll: match mode {
                Mode::LowLatency => Some(LlKernels::load(comm)?),
                Mode::HighThroughput => None,
            },
        })
    }

    /// Every kernel with the dynamic shared memory its launches ask for.
    pub(crate) fn with_smem(&self, num_experts: usize) -> Vec<(&Function, u32)> {
        let smem = abi::COMBINE_SMEM;
        let mut all = vec![
            (&self.layout_scan_i32, exchange_smem(num_experts)),
            (&self.layout_scan_i64, exchange_smem(num_experts)),
            (&self.dispatch.rank_major, 0),
            (&self.dispatch.expert_major, 0),
            (&self.combine_bwd.rank_major, 0),
            (&self.combine_bwd.expert_major, 0),
            (&self.combine_pull, smem),
            (&self.dispatch_bwd_pull, smem),
            (&self.combine_push.rank_major, smem),
            (&self.combine_push.expert_major, abi::EM_COMBINE_SMEM),
            (&self.dispatch_bwd_push.rank_major, smem),
            (&self.dispatch_bwd_push.expert_major, abi::EM_COMBINE_SMEM),
        ];
        all.extend(self.ll.iter().flat_map(|k| k.all().map(|f| (f, 0))));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::low_latency::kernels::{
        LL_COMBINE_RECV, LL_COMBINE_SEND, LL_COPY, LL_RECV, LL_SEND,
    };

    /// Every entry point `Kernels::load` looks up is in its module's PTX
    /// (a misspelt name would otherwise show only on a GPU).
    #[test]
    #[cfg_attr(moe_ep_no_kernels, ignore = "built without kernel images")]
    fn every_entry_point_is_in_its_module() {
        let per_world = |n: [[&'static str; 3]; 2]| n.concat();
        let modules: [(&str, Vec<&str>); 5] = [
            ("layout", [&LAYOUT_SCAN[..], &[PUBLISH_REFUSAL]].concat()),
            ("dispatch", [DISPATCH, COMBINE_BWD].concat()),
            ("combine_pull", [COMBINE_PULL, DISPATCH_BWD_PULL].concat()),
            (
                "combine_push",
                [per_world(COMBINE_PUSH), per_world(DISPATCH_BWD_PUSH)].concat(),
            ),
            (
                "low_latency",
                [
                    &LL_SEND[..],
                    &LL_RECV,
                    &[LL_COPY],
                    &LL_COMBINE_SEND,
                    &LL_COMBINE_RECV,
                ]
                .concat(),
            ),
        ];
        for (module, entries) in modules {
            let (_, _, ptx) = crate::kernels::MODULES
                .iter()
                .find(|m| m.0 == module)
                .unwrap_or_else(|| panic!("module {module} is not embedded"));
            let ptx = std::str::from_utf8(&ptx[..ptx.len() - 1]).unwrap();
            let found = ptx.matches(".entry ").count();
            assert_eq!(found, entries.len(), "{module}: entry points");
            for f in entries {
                assert!(ptx.contains(&format!(".entry {f}(")), "{module}: no {f}");
            }
        }
    }

    #[test]
    fn exchange_smem_is_two_words_per_expert_up_to_the_limit() {
        assert_eq!(exchange_smem(256), 2 * 256 * 4);
        // The most experts: 128 KiB, what the exchange's limit is raised to.
        assert_eq!(exchange_smem(MAX_EXPERTS), 128 * 1024);
        assert_eq!(exchange_smem_limit(), 128 * 1024);
    }
}
