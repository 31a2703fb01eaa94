//! Gives libmoe_ep.so its SONAME, `libmoe_ep.so.<ABI_MAJOR>`, and passes it
//! to the crate as `MOE_EP_SONAME` (`moe_ep::SONAME` of this crate).
//!
//! `ABI_MAJOR` changes only with a change that breaks the header's ABI rule
//! (something removed, reordered or given another meaning); additions grow
//! `MOE_EP_ABI_VERSION` and keep the SONAME. `capi/install.sh` reads
//! `ABI_MAJOR` from this file.

use std::env;

/// The ABI's major version: the number in the SONAME.
const ABI_MAJOR: u32 = 1;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let soname = format!("libmoe_ep.so.{ABI_MAJOR}");
    println!("cargo:rustc-env=MOE_EP_SONAME={soname}");
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    }
}
