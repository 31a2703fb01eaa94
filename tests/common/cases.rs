//! The case table of the multi-rank GPU tests, shared by the NVLink path's
//! (`gpu_intranode.rs`) and the two-level path's (`gpu_two_level.rs`): a
//! [`Case`] per routing and size, and [`with_case_table!`], which hands the
//! table to a test file's own macro (one module per case, one test per
//! receive layout).
#![allow(dead_code)]

use moe_ep::testkit::workload::Routing;

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub tokens: usize,
    pub hidden: usize,
    pub topk: usize,
    pub experts: usize,
    pub routing: Routing,
    /// This rank sends nothing (0 tokens).
    pub silent_rank: Option<usize>,
    pub idx_i32: bool,
    /// `GroupConfig::combine_chunks` (the pipeline depth of combine).
    pub chunks: usize,
    /// `GroupConfig::num_sms`: 1 (no pushing/summing split in combine), 2
    /// (one block of each), 3, and the default 24 (or what fits when the
    /// ranks share one GPU).
    pub sms: usize,
}

pub const fn case(
    tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    routing: Routing,
) -> Case {
    Case {
        tokens,
        hidden,
        topk,
        experts,
        routing,
        silent_rank: None,
        idx_i32: false,
        chunks: 8, // (the default is 4; the table covers 1, 4, 8 and 16)
        sms: 24,
    }
}

impl Case {
    /// The case's id, built from its fields (defaults left out):
    /// `<routing>_t<T>_h<H>_k<K>_e<E>[_silent<r>][_i32][_c<chunks>][_sm<sms>]`.
    pub fn id(&self) -> String {
        let routing = match self.routing {
            Routing::Uniform => "uniform".to_string(),
            Routing::Skewed { hot_share } => format!("skewed{}", (hot_share * 100.0).round()),
            Routing::Masked { masked_share } => format!("masked{}", (masked_share * 100.0).round()),
        };
        let mut id = format!(
            "{routing}_t{}_h{}_k{}_e{}",
            self.tokens, self.hidden, self.topk, self.experts
        );
        if let Some(r) = self.silent_rank {
            id += &format!("_silent{r}");
        }
        if self.idx_i32 {
            id += "_i32";
        }
        if self.chunks != 8 {
            id += &format!("_c{}", self.chunks);
        }
        if self.sms != 24 {
            id += &format!("_sm{}", self.sms);
        }
        id
    }
}

/// Calls `$m! { <case id> = <case>; ... }` with the whole table; the test
/// file's macro makes a module per case, whose tests check that their name
/// is the id of the case's fields.
#[macro_export]
macro_rules! with_case_table {
    ($m:ident) => {
        $m! {
    uniform_t127_h2048_k8_e64 = case(127, 2048, 8, 64, Routing::Uniform);
    // More chunks than tokens: most are empty.
    uniform_t1_h2560_k2_e8_c16 = Case { chunks: 16, ..case(1, 2560, 2, 8, Routing::Uniform) };
    uniform_t0_h4096_k8_e256 = case(0, 4096, 8, 256, Routing::Uniform);
    // No pipelining (push everything, then sum) on one block.
    skewed50_t500_h5120_k8_e256_c1_sm1 = Case {
        chunks: 1,
        sms: 1,
        ..case(500, 5120, 8, 256, Routing::Skewed { hot_share: 0.5 })
    };
    masked30_t300_h6144_k2_e64_sm3 = Case {
        sms: 3,
        ..case(300, 6144, 2, 64, Routing::Masked { masked_share: 0.3 })
    };
    uniform_t200_h7168_k1_e8_silent1_c4_sm2 = Case {
        silent_rank: Some(1),
        chunks: 4,
        sms: 2,
        ..case(200, 7168, 1, 8, Routing::Uniform)
    };
    uniform_t256_h2048_k16_e64_i32 = Case { idx_i32: true, ..case(256, 2048, 16, 64, Routing::Uniform) };
    uniform_t4096_h7168_k8_e256 = case(4096, 7168, 8, 256, Routing::Uniform);
    // More experts than a block has threads: the layout's exchange scans the
    // experts' block starts in two tiles.
    uniform_t200_h2048_k8_e1024 = case(200, 2048, 8, 1024, Routing::Uniform);
    // The most experts a group takes: the layout exchange's per-expert
    // arrays need 128 KiB of shared memory.
    uniform_t100_h512_k8_e16384 = case(100, 512, 8, 16384, Routing::Uniform);
    // The largest sizes of the NVLink path's scope (16384 tokens per rank,
    // hidden 16384, 512 experts), in two cases to keep the CPU side short.
    uniform_t16384_h2048_k4_e512_c4 = Case { chunks: 4, ..case(16384, 2048, 4, 512, Routing::Uniform) };
    uniform_t1024_h16384_k8_e512_c4 = Case { chunks: 4, ..case(1024, 16384, 8, 512, Routing::Uniform) };
        }
    };
}
