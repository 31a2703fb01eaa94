//! The C ABI from C, without a GPU: `capi/include/moe_ep.h` compiles as C11
//! and C++17 (warnings as errors), `capi/tests/abi_test.c` links against the
//! static and the shared library and passes its checks against each (version,
//! bad struct sizes and magics, NULL and bad arguments named, no driver is
//! an error code), and every struct's size, field offsets and init macro as
//! the C compiler sees them equal the Rust mirrors of this crate. The shared
//! library carries its SONAME, and `capi/install.sh` installs a package that
//! `pkg-config --cflags --libs moe_ep` links the C test against (shared and
//! static). On a GPU, `capi/tests/window_test.c` wraps a buffer the caller
//! registered itself and dispatches into it at a byte offset, then runs the
//! ABI 5 calls (an fp8 dispatch, the drop policy's results, eager sizes, the
//! footprint); without one it says `SKIP: c_window_dispatch_at_an_offset:
//! no GPU`.
//!
//! Needs `cc`, `c++`, `readelf` and `pkg-config` on the PATH (`CC`, `CXX`,
//! `READELF`, `PKG_CONFIG` override them). In this file `moe_ep` is this
//! crate (its library's name) and `moe_ep_rust` moe-ep's Rust API.

use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use moe_ep::*;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Where cargo put libmoe_ep.so and libmoe_ep.a for this test binary: the
/// profile directory (`cargo build`) or `deps/` (`cargo test`), whichever
/// holds the newer pair, so that a library left by an earlier `cargo build`
/// is not tested in place of the one built with this test.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let built = |dir: &Path| -> Option<std::time::SystemTime> {
        let time = |f: &str| std::fs::metadata(dir.join(f)).and_then(|m| m.modified());
        Some(time("libmoe_ep.so").ok()?.min(time("libmoe_ep.a").ok()?))
    };
    [deps.parent().unwrap(), deps]
        .into_iter()
        .filter_map(|dir| Some((built(dir)?, dir)))
        .max_by_key(|&(t, _)| t)
        .map(|(_, dir)| dir.to_path_buf())
        .unwrap_or_else(|| {
            panic!(
                "libmoe_ep.so / libmoe_ep.a not found next to {}",
                deps.display()
            )
        })
}

fn tool(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_string())
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

fn header() -> PathBuf {
    Path::new(ROOT).join("include/moe_ep.h")
}

#[test]
fn header_compiles_as_c11_and_cxx17() {
    let warn = ["-Wall", "-Wextra", "-Werror", "-pedantic"];
    run(Command::new(tool("CC", "cc"))
        .args(["-x", "c", "-std=c11", "-fsyntax-only"])
        .args(warn)
        .arg(header()));
    run(Command::new(tool("CXX", "c++"))
        .args(["-x", "c++", "-std=c++17", "-fsyntax-only"])
        .args(warn)
        .arg(header()));
}

fn tmp(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// Builds the C test into `name`, with `flags` (include paths, libraries).
fn build_c_test_with(name: &str, flags: &[&str]) -> PathBuf {
    build_c_file("abi_test.c", name, flags)
}

/// Builds `tests/<source>` into `name`, with `flags`.
fn build_c_file(source: &str, name: &str, flags: &[&str]) -> PathBuf {
    let out = tmp(name);
    run(Command::new(tool("CC", "cc"))
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .arg(Path::new(ROOT).join("tests").join(source))
        .arg("-o")
        .arg(&out)
        .args(flags));
    out
}

/// Builds the C test against one of the libraries of the build into `name`.
fn build_c_test(name: &str, link: &[&str]) -> PathBuf {
    let inc = format!("-I{}", Path::new(ROOT).join("include").display());
    build_c_test_with(name, &[&[inc.as_str()], link].concat())
}

/// The C test against libmoe_ep.so of `lib_dir()`, into `name` (see
/// [`shared_c_file`]).
fn shared_test(name: &str) -> PathBuf {
    shared_c_file("abi_test.c", name, &[])
}

/// `tests/<source>` against libmoe_ep.so of `lib_dir()`, into `name`. The program
/// needs the library by its SONAME, which cargo does not make: a directory
/// of this test holds it as a link to the built file, and the program finds
/// it there through DT_RPATH, which (unlike RUNPATH) comes before the
/// LD_LIBRARY_PATH that cargo gives tests.
fn shared_c_file(source: &str, name: &str, extra: &[&str]) -> PathBuf {
    let dir = lib_dir();
    let sodir = tmp(&format!("{name}-lib"));
    std::fs::create_dir_all(&sodir).unwrap();
    let link = sodir.join(SONAME);
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(dir.join("libmoe_ep.so"), &link).unwrap();
    let (d, s) = (dir.to_str().unwrap(), sodir.to_str().unwrap());
    let inc = format!("-I{}", Path::new(ROOT).join("include").display());
    let (libs, rpath) = (format!("-L{d}"), format!("-Wl,-rpath,{s}"));
    let flags = [
        inc.as_str(),
        &libs,
        "-lmoe_ep",
        &rpath,
        "-Wl,--disable-new-dtags",
    ];
    build_c_file(source, name, &[&flags[..], extra].concat())
}

/// The checks must pass without a GPU against both libraries.
#[test]
fn c_test_passes_against_the_static_and_the_shared_library() {
    let a = lib_dir().join("libmoe_ep.a");
    let stat = build_c_test(
        "abi_test_static",
        &[
            a.to_str().unwrap(),
            "-lpthread",
            "-ldl",
            "-lm",
            "-lrt",
            "-lgcc_s",
            "-lutil",
        ],
    );
    for exe in [stat, shared_test("abi_test_shared")] {
        let text = run(&mut Command::new(&exe));
        println!("{}:\n{text}", exe.display());
        assert!(text.contains("passed: 0 failures"), "{text}");
    }
}

/// On a GPU (one: 2 virtual ranks and `moe_ep_pool_wrap_device`; two: 2
/// NCCL ranks, a communicator and window the C program makes itself, and
/// `moe_ep_pool_wrap_window`): a range of the wrapped buffer at a byte
/// offset is dispatch's `recv_tokens`, written in place, and combine's
/// `expert_out`, read in place, every value checked; `moe_ep_buffer_range`
/// and the wrap of the other kind refused by name. Without a GPU the program
/// prints `SKIP: c_window_dispatch_at_an_offset: no GPU (...)`, passed on to
/// the test's output.
#[test]
fn c_window_dispatch_at_an_offset() {
    use std::io::Write;
    let exe = shared_c_file("window_test.c", "window_test", &["-lpthread", "-ldl"]);
    let out = Command::new(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    if let Some(skip) = text.lines().find(|l| l.starts_with("SKIP: ")) {
        // Past the test harness's capture: scripts/test.sh counts it.
        let _ = writeln!(std::io::stderr(), "{skip}");
        assert!(out.status.success(), "{text}");
        return;
    }
    println!("{text}");
    assert!(
        out.status.success() && text.contains("passed: 0 failures"),
        "{} ({}):\n{text}",
        exe.display(),
        out.status
    );
}

/// The Rust mirrors' sizes, offsets and magics, by C name.
fn rust_layout() -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    macro_rules! s {
        ($t:ty, $c:literal, versioned, [$($f:ident),*]) => {
            s!($t, $c, [$($f),*]);
            let v = <$t as Versioned>::init();
            m.insert(concat!($c, " init_size").to_string(), v.size as usize);
            m.insert(concat!($c, " magic").to_string(), <$t as Versioned>::MAGIC as usize);
            assert_eq!(<$t as Versioned>::NAME, $c);
        };
        ($t:ty, $c:literal, [$($f:ident),*]) => {
            m.insert(concat!($c, " size").to_string(), size_of::<$t>());
            $(m.insert(concat!($c, ".", stringify!($f)).to_string(), offset_of!($t, $f));)*
        };
    }
    s!(CBuf, "moe_ep_buf_t", [ptr, len]);
    s!(CBufMut, "moe_ep_buf_mut_t", [ptr, len]);
    s!(CUniqueId, "moe_ep_unique_id_t", []);
    s!(
        CVersionInfo,
        "moe_ep_version_info_t",
        versioned,
        [
            major,
            minor,
            patch,
            abi_version,
            nccl_headers_version,
            reserved
        ]
    );
    s!(
        CGroupConfig,
        "moe_ep_group_config_t",
        versioned,
        [
            num_experts,
            hidden,
            max_tokens_per_rank,
            recv_capacity,
            num_sms,
            combine_chunks,
            mode,
            timeout_ms,
            ranks_per_node,
            padding,
            overflow
        ]
    );
    s!(
        CLayoutArgs,
        "moe_ep_layout_args_t",
        versioned,
        [topk_idx, topk_idx_dtype, topk, layout, alignment]
    );
    s!(
        CDispatchArgs,
        "moe_ep_dispatch_args_t",
        versioned,
        [x, topk_weights, recv_tokens, recv_topk_weights]
    );
    s!(
        CCombineArgs,
        "moe_ep_combine_args_t",
        versioned,
        [expert_out, weights, out]
    );
    s!(
        CCombineBackwardArgs,
        "moe_ep_combine_backward_args_t",
        versioned,
        [grad_out, weights, grad_expert_out]
    );
    s!(
        CDispatchBackwardArgs,
        "moe_ep_dispatch_backward_args_t",
        versioned,
        [
            grad_recv_tokens,
            grad_recv_topk_weights,
            grad_tokens,
            grad_topk_weights
        ]
    );
    s!(
        CRecvBuffers,
        "moe_ep_recv_buffers_t",
        versioned,
        [
            tokens,
            topk_weights,
            topk_idx,
            src,
            scales,
            scale_kind,
            reserved
        ]
    );
    s!(
        CHandleCounts,
        "moe_ep_handle_counts_t",
        versioned,
        [
            num_tokens,
            topk,
            recv_rows,
            recv_tokens,
            num_local_experts,
            max_recv_rows,
            dropped_rows
        ]
    );
    s!(
        CDispatchFp8Args,
        "moe_ep_dispatch_fp8_args_t",
        versioned,
        [
            codes,
            scales,
            scale_kind,
            reserved,
            topk_weights,
            recv_codes,
            recv_scales,
            recv_topk_weights
        ]
    );
    s!(
        CMemoryFootprint,
        "moe_ep_memory_footprint_t",
        versioned,
        [
            workspace,
            low_latency,
            pool_other,
            pool_free,
            two_level,
            pinned_host,
            device_total
        ]
    );
    s!(
        CLlDispatchArgs,
        "moe_ep_ll_dispatch_args_t",
        versioned,
        [
            x,
            x_scales,
            topk_idx,
            topk_weights,
            topk_idx_dtype,
            topk,
            layout,
            payload
        ]
    );
    s!(
        CLlCombineArgs,
        "moe_ep_ll_combine_args_t",
        versioned,
        [expert_out, weights, out]
    );
    s!(
        CLlHandleInfo,
        "moe_ep_ll_handle_info_t",
        versioned,
        [
            num_tokens,
            topk,
            hidden,
            num_rows,
            num_local_experts,
            world,
            max_tokens_per_rank,
            layout,
            fp8,
            buffer_set,
            state
        ]
    );
    s!(
        CLlBuffers,
        "moe_ep_ll_buffers_t",
        versioned,
        [
            tokens,
            fp8_codes,
            fp8_scales,
            src,
            topk_local_idx,
            topk_weights,
            tokens_per_local_expert,
            tokens_per_expert_source,
            tokens_from_rank
        ]
    );
    m
}

#[test]
fn struct_layouts_agree_with_the_c_compiler() {
    let text = run(Command::new(shared_test("abi_test_layout")).arg("layout"));
    let c: BTreeMap<String, usize> = text
        .lines()
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect();
    let rust = rust_layout();
    assert_eq!(
        c.keys().collect::<Vec<_>>(),
        rust.keys().collect::<Vec<_>>(),
        "the C test and the Rust table list different fields"
    );
    for (k, v) in &rust {
        assert_eq!(c[k], *v, "{k}: C says {}, Rust {v}", c[k]);
    }
    println!("{} sizes, offsets and magics agree", rust.len());
}

/// Status codes, enum values and the ABI version in the header equal the
/// library's.
#[test]
fn header_constants_agree_with_the_library() {
    let h = std::fs::read_to_string(header()).unwrap();
    let value = |name: &str| -> i64 {
        let line = h
            .lines()
            .find(|l| {
                let l = l.trim_start().trim_start_matches("#define ");
                l.starts_with(name) && l[name.len()..].starts_with([' ', '='])
            })
            .unwrap_or_else(|| panic!("{name} is not in the header"));
        let v = line[line.find(name).unwrap() + name.len()..]
            .trim_start_matches([' ', '='])
            .split([',', ' ', '/'])
            .next()
            .unwrap()
            .trim_end_matches('u');
        match v.strip_prefix("0x") {
            Some(x) => i64::from_str_radix(x, 16).unwrap(),
            None => v.parse().unwrap(),
        }
    };
    for (code, name) in STATUS_NAMES {
        assert_eq!(value(name.to_str().unwrap()), code as i64, "{name:?}");
    }
    assert_eq!(value("MOE_EP_ABI_VERSION"), ABI_VERSION as i64);
    let version: Vec<i64> = env!("CARGO_PKG_VERSION")
        .split('.')
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(
        [
            value("MOE_EP_VERSION_MAJOR"),
            value("MOE_EP_VERSION_MINOR"),
            value("MOE_EP_VERSION_PATCH")
        ],
        version[..],
        "the header's version is not Cargo.toml's"
    );
    for (name, v) in [
        ("MOE_EP_DTYPE_BF16", MOE_EP_DTYPE_BF16 as i64),
        ("MOE_EP_DTYPE_F32", MOE_EP_DTYPE_F32 as i64),
        ("MOE_EP_DTYPE_I32", MOE_EP_DTYPE_I32 as i64),
        ("MOE_EP_DTYPE_I64", MOE_EP_DTYPE_I64 as i64),
        ("MOE_EP_DTYPE_U8", MOE_EP_DTYPE_U8 as i64),
        ("MOE_EP_LAYOUT_RANK_MAJOR", MOE_EP_LAYOUT_RANK_MAJOR as i64),
        (
            "MOE_EP_LAYOUT_EXPERT_MAJOR",
            MOE_EP_LAYOUT_EXPERT_MAJOR as i64,
        ),
        (
            "MOE_EP_MODE_HIGH_THROUGHPUT",
            MOE_EP_MODE_HIGH_THROUGHPUT as i64,
        ),
        ("MOE_EP_MODE_LOW_LATENCY", MOE_EP_MODE_LOW_LATENCY as i64),
        ("MOE_EP_LL_BF16", MOE_EP_LL_BF16 as i64),
        ("MOE_EP_LL_CAST_FP8_EXACT", MOE_EP_LL_CAST_FP8_EXACT as i64),
        (
            "MOE_EP_LL_CAST_FP8_POWER_OF_TWO",
            MOE_EP_LL_CAST_FP8_POWER_OF_TWO as i64,
        ),
        ("MOE_EP_LL_FP8", MOE_EP_LL_FP8 as i64),
        ("MOE_EP_LL_SENT", MOE_EP_LL_SENT as i64),
        ("MOE_EP_LL_RECEIVED", MOE_EP_LL_RECEIVED as i64),
        ("MOE_EP_LL_COMBINE_SENT", MOE_EP_LL_COMBINE_SENT as i64),
        ("MOE_EP_LL_COMBINED", MOE_EP_LL_COMBINED as i64),
        ("MOE_EP_PADDING_ZERO", MOE_EP_PADDING_ZERO as i64),
        ("MOE_EP_PADDING_UNTOUCHED", MOE_EP_PADDING_UNTOUCHED as i64),
        ("MOE_EP_OVERFLOW_ERROR", MOE_EP_OVERFLOW_ERROR as i64),
        ("MOE_EP_OVERFLOW_DROP", MOE_EP_OVERFLOW_DROP as i64),
        ("MOE_EP_FP8_SCALES_NONE", MOE_EP_FP8_SCALES_NONE as i64),
        (
            "MOE_EP_FP8_SCALES_E8M0_PER_32",
            MOE_EP_FP8_SCALES_E8M0_PER_32 as i64,
        ),
        (
            "MOE_EP_FP8_SCALES_F32_PER_128",
            MOE_EP_FP8_SCALES_F32_PER_128 as i64,
        ),
    ] {
        assert_eq!(value(name), v, "{name}");
    }
}

/// `moe_ep_ll_buffer_bytes` is the Rust `ll_buffer_bytes` of the same config,
/// whatever the config's mode says.
#[test]
fn ll_buffer_bytes_agree_with_the_rust_api() {
    for (world, experts, hidden, tokens) in
        [(1, 8, 128, 1), (2, 64, 2048, 256), (8, 256, 7168, 128)]
    {
        let mut c = <CGroupConfig as Versioned>::init();
        c.num_experts = experts;
        c.hidden = hidden;
        c.max_tokens_per_rank = tokens;
        c.mode = MOE_EP_MODE_LOW_LATENCY;
        let (mut sym, mut local) = (0u64, 0u64);
        let st = unsafe { moe_ep_ll_buffer_bytes(&c, world, &mut sym, &mut local) };
        assert_eq!(st, MOE_EP_OK);
        let mut cfg =
            moe_ep_rust::GroupConfig::new(experts as usize, hidden as usize, tokens as usize);
        cfg.mode = moe_ep_rust::Mode::LowLatency;
        let want = moe_ep_rust::ops::ll_buffer_bytes(&cfg, world as usize);
        assert_eq!((sym, local), (want.symmetric, want.local), "world {world}");
        c.mode = MOE_EP_MODE_HIGH_THROUGHPUT;
        let (mut sym2, mut local2) = (0u64, 0u64);
        assert_eq!(
            unsafe { moe_ep_ll_buffer_bytes(&c, world, &mut sym2, &mut local2) },
            MOE_EP_OK
        );
        assert_eq!((sym2, local2), (sym, local));
    }
}

/// The dynamic section of an ELF file as readelf prints it.
fn dynamic_section(file: &Path) -> String {
    run(Command::new(tool("READELF", "readelf")).arg("-d").arg(file))
}

/// libmoe_ep.so is named by its ABI major (`SONAME`, `libmoe_ep.so.<major>`),
/// and a program linked against it needs that name.
#[test]
fn the_shared_library_carries_its_soname() {
    assert!(
        SONAME.starts_with("libmoe_ep.so.") && SONAME[13..].parse::<u32>().is_ok(),
        "{SONAME}"
    );
    let so = dynamic_section(&lib_dir().join("libmoe_ep.so"));
    assert!(
        so.contains(&format!("Library soname: [{SONAME}]")),
        "no SONAME {SONAME}:\n{so}"
    );
    let exe = dynamic_section(&shared_test("abi_test_soname"));
    assert!(
        exe.contains(&format!("Shared library: [{SONAME}]")),
        "{exe}"
    );
}

/// `capi/install.sh --lib-dir` of this build into a fresh prefix: the
/// files of the layout, and the C test linked through pkg-config against
/// the shared and the static library, each passing its checks.
#[test]
fn the_installed_package_links_through_pkg_config() {
    let prefix = tmp("install-prefix");
    let _ = std::fs::remove_dir_all(&prefix);
    run(Command::new("bash")
        .arg(Path::new(ROOT).join("install.sh"))
        .arg("--lib-dir")
        .arg(lib_dir())
        .arg(&prefix));
    let lib = prefix.join("lib");
    let version = format!("{}.{ABI_VERSION}", &SONAME[13..]);
    let real = format!("{SONAME}.{ABI_VERSION}");
    for f in [
        "include/moe_ep.h",
        "lib/libmoe_ep.a",
        "lib/pkgconfig/moe_ep.pc",
        "lib/cmake/moe_ep/moe_epConfig.cmake",
        "lib/cmake/moe_ep/moe_epConfigVersion.cmake",
    ] {
        assert!(prefix.join(f).is_file(), "{f} not installed");
    }
    assert!(std::fs::symlink_metadata(lib.join(&real))
        .unwrap()
        .is_file());
    for (link, to) in [(SONAME, real.as_str()), ("libmoe_ep.so", SONAME)] {
        let target = std::fs::read_link(lib.join(link)).unwrap();
        assert_eq!(target, Path::new(to), "{link}");
    }
    let config = std::fs::read_to_string(lib.join("cmake/moe_ep/moe_epConfig.cmake")).unwrap();
    for want in ["moe_ep::moe_ep ", "moe_ep::moe_ep_static ", &real] {
        assert!(config.contains(want), "moe_epConfig.cmake lacks {want}");
    }
    let pc = std::fs::read_to_string(lib.join("pkgconfig/moe_ep.pc")).unwrap();
    assert!(pc.contains(&format!("Version: {version}\n")), "{pc}");

    let pkg_config = |args: &[&str]| -> Vec<String> {
        let out = run(Command::new(tool("PKG_CONFIG", "pkg-config"))
            .env("PKG_CONFIG_PATH", lib.join("pkgconfig"))
            .args(args)
            .arg("moe_ep"));
        out.split_whitespace().map(str::to_string).collect()
    };
    assert_eq!(pkg_config(&["--modversion"]), [version]);
    // Shared: `pkg-config --cflags --libs moe_ep`, found at run time
    // through the prefix's SONAME link.
    let mut flags = pkg_config(&["--cflags", "--libs"]);
    flags.push(format!("-Wl,-rpath,{}", lib.display()));
    flags.push("-Wl,--disable-new-dtags".into());
    let refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let shared = build_c_test_with("abi_test_pc_shared", &refs);
    assert!(dynamic_section(&shared).contains(&format!("Shared library: [{SONAME}]")));
    // Static: `pkg-config --static`, libmoe_ep.a in place of -lmoe_ep (what
    // Libs.private adds is all the staticlib needs).
    let a = lib.join("libmoe_ep.a").display().to_string();
    let flags: Vec<String> = pkg_config(&["--cflags", "--static", "--libs"])
        .into_iter()
        .map(|f| if f == "-lmoe_ep" { a.clone() } else { f })
        .collect();
    let refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let stat = build_c_test_with("abi_test_pc_static", &refs);
    assert!(!dynamic_section(&stat).contains("libmoe_ep"));
    for exe in [shared, stat] {
        let text = run(&mut Command::new(&exe));
        assert!(
            text.contains("passed: 0 failures"),
            "{}:\n{text}",
            exe.display()
        );
    }
}
