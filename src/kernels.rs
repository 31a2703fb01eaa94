//! The kernel images build.rs compiled from `kernels-cuda/` (sm_90a cubin +
//! compute_90 PTX per `.cu`), and the NCCL header version they were built with.
//! Built with `DOCS_RS` or `MOE_EP_NO_KERNELS=1` (`cfg(moe_ep_no_kernels)`),
//! `MODULES` is empty and every module load returns `Error::Module`.
include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

#[cfg(all(test, not(moe_ep_no_kernels)))]
mod tests {
    use super::*;

    /// The kernels build.rs embedded are here, both images per module.
    #[test]
    fn every_kernel_module_is_embedded_with_cubin_and_ptx() {
        let names = [
            "layout",
            "dispatch",
            "combine_pull",
            "combine_push",
            "low_latency",
            "symm",
            "two_level",
            "util",
        ];
        for name in names {
            let (_, cubin, ptx) = MODULES
                .iter()
                .find(|m| m.0 == name)
                .unwrap_or_else(|| panic!("{name} missing"));
            assert_eq!(&cubin[..4], b"\x7fELF", "{name}: cubin is not an ELF image");
            assert!(
                ptx.ends_with(&[0])
                    && std::str::from_utf8(&ptx[..ptx.len() - 1])
                        .unwrap()
                        .contains(".target sm_90"),
                "{name}: PTX"
            );
        }
        assert_eq!(MODULES.len(), names.len(), "a module without a test entry");
        const { assert!(NCCL_HEADERS_VERSION_CODE >= 22800) };
    }
}

/// Built without kernels: no images, the pinned (or found) header version.
#[cfg(all(test, moe_ep_no_kernels))]
mod no_kernels_tests {
    #[test]
    fn no_kernel_module_is_embedded() {
        assert!(super::MODULES.is_empty());
        const { assert!(super::NCCL_HEADERS_VERSION_CODE >= 22800) };
    }
}
