//! Raw foreign interfaces, loaded at run time.
//!
//! This layer only mirrors C declarations and loads symbols: types are
//! `#[repr(C)]` copies of the headers, functions are plain `extern "C"` pointers
//! in a table, and nothing here checks return codes. The checked, documented
//! calls live one layer up (`crate::runtime::nccl_call`).

pub mod nccl;
