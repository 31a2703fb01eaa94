//! Compiles every `kernels-cuda/*.cu` with nvcc to an sm_90a cubin and a
//! compute_90 PTX image, and generates `$OUT_DIR/kernels.rs`, which embeds
//! them with `include_bytes!` and records the version of the NCCL headers the
//! kernels were compiled against.
//!
//! nvcc is found via `NVCC` (a path to nvcc), then `CUDA_HOME` / `CUDA_PATH`
//! (`$X/bin/nvcc`), then `PATH`, then the pinned toolchain that
//! `scripts/setup-cuda.sh` installs from PyPI into `.toolchain/` of the
//! checkout. NCCL headers: `NCCL_INCLUDE_DIR`, then `NCCL_HOME/include`, then
//! `.toolchain/`, then `/usr/include`. Where none is found the build fails
//! with one line naming these options.
//!
//! With `DOCS_RS` set or `MOE_EP_NO_KERNELS=1` no nvcc is needed: the API is
//! built without kernel images (an empty `MODULES`, `cfg(moe_ep_no_kernels)`),
//! so that its docs build and every op returns `Error::Module` at run time.
//! Without NCCL headers there, `NCCL_HEADERS_VERSION_CODE` is
//! `DEFAULT_NCCL_CODE`, the pinned NCCL 2.28.9.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Machine code target: Hopper with its arch-specific features.
const CUBIN_GENCODE: &str = "-gencode=arch=compute_90a,code=sm_90a";
/// Portable fallback, JIT-compiled by the driver on any sm_90+ GPU.
const PTX_ARCH: &str = "-arch=compute_90";
/// NCCL_VERSION_CODE of the pinned headers (nvidia-nccl-cu13==2.28.9), used
/// by builds without kernels that find no nccl.h.
const DEFAULT_NCCL_CODE: i32 = 22809;

/// Ends the build with one `error:` line from cargo (no panic, no backtrace).
/// With `details` (nvcc's output) the script exits non-zero, so that cargo
/// shows them (its stderr) beneath that line.
fn fail(line: &str, details: &str) -> ! {
    println!("cargo::error={line}");
    if details.is_empty() {
        // cargo fails the build on the logged error alone.
        std::process::exit(0);
    }
    eprintln!("{details}");
    std::process::exit(1);
}

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let kdir = root.join("kernels-cuda");
    for var in [
        "NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "PATH",
        "NCCL_INCLUDE_DIR",
        "NCCL_HOME",
        "MOE_EP_PTXAS_REPORT",
        "DOCS_RS",
        "MOE_EP_NO_KERNELS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=kernels-cuda");
    println!("cargo::rustc-check-cfg=cfg(moe_ep_no_kernels)");
    let no_kernels =
        env::var_os("DOCS_RS").is_some() || env::var("MOE_EP_NO_KERNELS").as_deref() == Ok("1");

    let mut sources = Vec::new();
    let entries = fs::read_dir(&kdir)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", kdir.display()), ""));
    for entry in entries {
        let path = entry.unwrap().path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("cu") => sources.push(path.clone()),
            Some("cuh") | Some("h") => {}
            _ => continue,
        }
        println!("cargo:rerun-if-changed={}", path.display());
    }
    sources.sort();

    if no_kernels {
        // The API only (docs.rs, or MOE_EP_NO_KERNELS=1): no nvcc, no images.
        println!("cargo::rustc-cfg=moe_ep_no_kernels");
        let nccl_code = find_nccl_include(&root).map_or(DEFAULT_NCCL_CODE, |d| {
            nccl_header_version(&d.join("nccl.h"))
        });
        write_table(&out, nccl_code, &[]);
        return;
    }

    let nvcc = find_nvcc(&root).unwrap_or_else(|e| fail(&e, ""));
    let nccl_inc = find_nccl_include(&root).unwrap_or_else(|| {
        fail(
            "no NCCL headers (nccl.h, nccl_device.h) found: set NCCL_INCLUDE_DIR (or NCCL_HOME) \
             to NCCL >= 2.28 headers (e.g. the include/ of PyPI's nvidia-nccl-cu13==2.28.9 wheel), \
             or run scripts/setup-cuda.sh in a moe-ep checkout (installs them into .toolchain/)",
            "",
        )
    });
    let nccl_code = nccl_header_version(&nccl_inc.join("nccl.h"));

    // Compile cubin and PTX of every source in parallel (nvcc is slow).
    let jobs: Vec<_> = sources
        .iter()
        .flat_map(|src| {
            let stem = src.file_stem().unwrap().to_str().unwrap().to_string();
            [
                (src.clone(), stem.clone(), true),
                (src.clone(), stem, false),
            ]
        })
        .collect();
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(src, stem, cubin)| {
                let (nvcc, kdir, nccl_inc, out) = (&nvcc, &kdir, &nccl_inc, &out);
                s.spawn(move || compile(nvcc, src, stem, *cubin, kdir, nccl_inc, out))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let errors: Vec<String> = results.into_iter().filter_map(|r| r.err()).collect();
    if !errors.is_empty() {
        fail(
            &format!(
                "nvcc ({}) failed on {} of {} kernel images (its output is above)",
                nvcc.display(),
                errors.len(),
                jobs.len()
            ),
            &errors.join("\n"),
        );
    }
    let stems: Vec<&str> = sources
        .iter()
        .map(|src| src.file_stem().unwrap().to_str().unwrap())
        .collect();
    write_table(&out, nccl_code, &stems);
}

/// `$OUT_DIR/kernels.rs`: the NCCL header version and one
/// `(name, cubin, PTX)` entry per compiled module (none without kernels).
fn write_table(out: &Path, nccl_code: i32, stems: &[&str]) {
    let mut gen = String::new();
    writeln!(gen, "// Generated by build.rs. Do not edit.").unwrap();
    writeln!(
        gen,
        "/// NCCL_VERSION_CODE of the nccl.h the kernels were compiled against."
    )
    .unwrap();
    writeln!(
        gen,
        "pub const NCCL_HEADERS_VERSION_CODE: i32 = {nccl_code};"
    )
    .unwrap();
    writeln!(
        gen,
        "/// Embedded kernel images: (module name, sm_90a cubin, NUL-terminated compute_90 PTX)."
    )
    .unwrap();
    writeln!(gen, "pub const MODULES: &[(&str, &[u8], &[u8])] = &[").unwrap();
    for stem in stems {
        writeln!(
            gen,
            "    ({stem:?}, include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{stem}.cubin\")), include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{stem}.ptx\"))),"
        )
        .unwrap();
    }
    writeln!(gen, "];").unwrap();
    fs::write(out.join("kernels.rs"), gen).unwrap();
}

fn compile(
    nvcc: &Path,
    src: &Path,
    stem: &str,
    cubin: bool,
    kdir: &Path,
    nccl_inc: &Path,
    out: &Path,
) -> Result<(), String> {
    let target = out.join(format!("{stem}.{}", if cubin { "cubin" } else { "ptx" }));
    let mut cmd = Command::new(nvcc);
    cmd.args(["-std=c++17", "-O3", "-lineinfo", "--expt-relaxed-constexpr"])
        .arg(if cubin { CUBIN_GENCODE } else { PTX_ARCH })
        .arg(if cubin { "-cubin" } else { "-ptx" })
        .arg(format!("-I{}", kdir.display()))
        .arg(format!("-I{}", nccl_inc.display()))
        .arg("-o")
        .arg(&target)
        .arg(src);
    if cubin {
        // Register / spill report: MOE_EP_PTXAS_REPORT=1 cargo build shows it.
        cmd.arg("-Xptxas=-v");
    }
    let output = cmd
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} ({}):\n{}{}",
            src.display(),
            if cubin { "cubin" } else { "ptx" },
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    if cubin && env::var_os("MOE_EP_PTXAS_REPORT").is_some() {
        for line in String::from_utf8_lossy(&output.stderr).lines() {
            if line.contains("registers")
                || line.contains("spill")
                || line.contains("Compiling entry")
            {
                println!(
                    "cargo:warning=ptxas {stem}: {}",
                    line.trim_start_matches("ptxas info    : ")
                );
            }
        }
    } else {
        // cuModuleLoadData needs PTX to be NUL-terminated.
        let mut ptx = fs::read(&target).map_err(|e| e.to_string())?;
        ptx.push(0);
        fs::write(&target, ptx).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn is_file(p: &Path) -> bool {
    p.is_file()
}

/// nvcc, or the one error line that says where it was looked for.
fn find_nvcc(root: &Path) -> Result<PathBuf, String> {
    if let Some(p) = env::var_os("NVCC") {
        let p = PathBuf::from(p);
        return if is_file(&p) {
            Ok(p)
        } else {
            Err(format!(
                "NVCC={} is not a file (set it to the path of nvcc)",
                p.display()
            ))
        };
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = env::var_os(var) {
            let p = Path::new(&home).join("bin/nvcc");
            if is_file(&p) {
                return Ok(p);
            }
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let p = dir.join("nvcc");
            if is_file(&p) {
                return Ok(p);
            }
        }
    }
    let local = root.join(".toolchain/py/nvidia/cu13/bin/nvcc");
    if is_file(&local) {
        return Ok(local);
    }
    Err(format!(
        "no nvcc found (the kernels are CUDA C++ compiled at build time): set NVCC=/path/to/nvcc \
         or CUDA_HOME (or CUDA_PATH) to a CUDA 13 toolkit, put nvcc on PATH, or run \
         scripts/setup-cuda.sh in a moe-ep checkout (pinned nvcc from PyPI into {}); \
         MOE_EP_NO_KERNELS=1 builds the API without kernels (every op then fails at run time)",
        root.join(".toolchain").display()
    ))
}

fn find_nccl_include(root: &Path) -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Ok(d) = env::var("NCCL_INCLUDE_DIR") {
        candidates.push(PathBuf::from(d));
    }
    if let Ok(d) = env::var("NCCL_HOME") {
        candidates.push(Path::new(&d).join("include"));
    }
    candidates.push(root.join(".toolchain/py/nvidia/nccl/include"));
    candidates.push(PathBuf::from("/usr/include"));
    candidates
        .into_iter()
        .find(|d| d.join("nccl.h").is_file() && d.join("nccl_device.h").is_file())
}

fn nccl_header_version(header: &Path) -> i32 {
    let text = fs::read_to_string(header)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", header.display()), ""));
    let get = |name: &str| -> i32 {
        text.lines()
            .find_map(|l| {
                let mut it = l.split_whitespace();
                (it.next() == Some("#define") && it.next() == Some(name))
                    .then(|| it.next().and_then(|v| v.parse().ok()))
                    .flatten()
            })
            .unwrap_or_else(|| fail(&format!("{} has no {name}", header.display()), ""))
    };
    let (major, minor, patch) = (get("NCCL_MAJOR"), get("NCCL_MINOR"), get("NCCL_PATCH"));
    major * 10000 + minor * 100 + patch
}
