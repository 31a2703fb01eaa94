//! The kernel images build.rs compiled from `kernels-cuda/` (sm_90a cubin +
//! compute_90 PTX per `.cu`), and the NCCL header version they were built with.
include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

#[cfg(test)]
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
