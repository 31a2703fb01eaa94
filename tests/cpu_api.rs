//! CPU tests of the public API's host-side checks: no GPU, driver or NCCL
//! needed.

use std::time::Duration;

use moe_ep::{Error, GroupConfig, Mode, NcclVersion};

fn arg_of(e: Error) -> &'static str {
    match e {
        Error::InvalidArgument { arg, .. } => arg,
        other => panic!("expected InvalidArgument, got {other}"),
    }
}

#[test]
fn group_config_rejects_each_bad_field_by_name() {
    let ok = GroupConfig::new(256, 7168, 4096);
    ok.validate(2).expect("defaults are valid for 2 ranks");
    let bad = |f: &dyn Fn(&mut GroupConfig), world: usize| {
        let mut c = ok.clone();
        f(&mut c);
        arg_of(c.validate(world).unwrap_err())
    };
    assert_eq!(bad(&|_| {}, 0), "world");
    assert_eq!(bad(&|_| {}, 9), "world");
    assert_eq!(bad(&|c| c.num_experts = 255, 2), "num_experts");
    assert_eq!(bad(&|c| c.num_experts = 0, 2), "num_experts");
    assert_eq!(bad(&|c| c.num_experts = 16386, 2), "num_experts");
    assert_eq!(bad(&|c| c.num_experts = usize::MAX - 1, 2), "num_experts");
    assert_eq!(bad(&|c| c.hidden = 7170, 2), "hidden");
    assert_eq!(bad(&|c| c.hidden = 0, 2), "hidden");
    assert_eq!(
        bad(&|c| c.max_tokens_per_rank = 0, 2),
        "max_tokens_per_rank"
    );
    assert_eq!(bad(&|c| c.num_sms = 0, 2), "num_sms");
    assert_eq!(bad(&|c| c.num_sms = 133, 2), "num_sms");
    assert_eq!(bad(&|c| c.combine_chunks = 0, 2), "combine_chunks");
    assert_eq!(bad(&|c| c.combine_chunks = 3, 2), "combine_chunks");
    assert_eq!(bad(&|c| c.combine_chunks = 32, 2), "combine_chunks");
    for n in [1, 2, 4, 8, 16] {
        let mut c = ok.clone();
        c.combine_chunks = n;
        c.validate(2).unwrap();
    }
    assert_eq!(bad(&|c| c.mode = Mode::LowLatency, 2), "mode");
    assert_eq!(bad(&|c| c.timeout = Duration::ZERO, 2), "timeout");
    let msg = {
        let mut c = ok.clone();
        c.hidden = 7170;
        c.validate(2).unwrap_err().to_string()
    };
    assert!(
        msg.contains("multiple of 8") && msg.contains("7170"),
        "{msg}"
    );
}

/// Without a driver the crate answers with an error, never a panic; with one
/// (a GPU machine) it counts the devices.
#[test]
fn missing_driver_is_an_error_not_a_panic() {
    match moe_ep::device_count() {
        Ok(n) => eprintln!("driver present: {n} device(s)"),
        Err(Error::NoDriver(msg)) => {
            assert!(msg.contains("libcuda") || msg.contains("cuInit"), "{msg}")
        }
        Err(e) => panic!("unexpected error kind: {e}"),
    }
    match moe_ep::context(0) {
        Ok(_) => {}
        Err(Error::NoDriver(_)) | Err(Error::NotEnoughGpus { .. }) => {}
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

#[test]
fn nccl_versions_decode_and_order() {
    let v = NcclVersion::from_code(22809);
    assert_eq!((v.major, v.minor, v.patch), (2, 28, 9));
    assert_eq!(v.to_string(), "2.28.9");
    assert_eq!(v.code(), 22809);
    assert!(NcclVersion::from_code(22803) < v);
    assert!(NcclVersion::from_code(22902) > v);
    assert_eq!(NcclVersion::from_code(2708).to_string(), "2.7.8");
}
