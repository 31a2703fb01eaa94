//! The embedded kernel modules, loaded lazily once per context (sm_90a cubin
//! first, the compute_90 PTX when the cubin does not fit the GPU), and the
//! one launch function every Rust launcher goes through.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{result, sys, CudaContext, CudaStream};

use crate::error::{Error, Result};
use crate::kernels::MODULES;

/// One loaded module of `kernels-cuda/<name>.cu`.
pub struct Module {
    name: &'static str,
    raw: sys::CUmodule,
    funcs: Mutex<HashMap<&'static str, sys::CUfunction>>,
    ctx: Arc<CudaContext>,
}

// SAFETY: CUmodule/CUfunction handles are usable from any thread of the context.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

type Registry = Mutex<HashMap<(usize, &'static str), Arc<Module>>>;

impl Module {
    /// The module `name` in `ctx`, loaded on first use.
    pub fn get(ctx: &Arc<CudaContext>, name: &'static str) -> Result<Arc<Module>> {
        static REGISTRY: OnceLock<Registry> = OnceLock::new();
        let reg = REGISTRY.get_or_init(Default::default);
        let key = (ctx.cu_ctx() as usize, name);
        let mut map = reg.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = map.get(&key) {
            return Ok(m.clone());
        }
        let m = Arc::new(Self::load(ctx, name)?);
        map.insert(key, m.clone());
        Ok(m)
    }

    fn load(ctx: &Arc<CudaContext>, name: &'static str) -> Result<Module> {
        if cfg!(moe_ep_no_kernels) {
            return Err(Error::Module {
                module: name,
                detail: "moe-ep was built without kernels (DOCS_RS or MOE_EP_NO_KERNELS=1); \
                         rebuild with nvcc reachable (NVCC, CUDA_HOME/CUDA_PATH, PATH, or \
                         the .toolchain/ of scripts/setup-cuda.sh) and neither variable set"
                    .into(),
            });
        }
        let &(_, cubin, ptx) =
            MODULES
                .iter()
                .find(|(n, _, _)| *n == name)
                .ok_or_else(|| Error::Module {
                    module: name,
                    detail: "not embedded in this build".into(),
                })?;
        ctx.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        // SAFETY: the images are complete cubin / NUL-terminated PTX from build.rs.
        let raw = match unsafe { result::module::load_data(cubin.as_ptr() as *const c_void) } {
            Ok(m) => m,
            Err(cubin_err) => {
                match unsafe { result::module::load_data(ptx.as_ptr() as *const c_void) } {
                    Ok(m) => m,
                    Err(ptx_err) => {
                        return Err(Error::Module {
                            module: name,
                            detail: format!(
                        "cubin: {cubin_err}; PTX: {ptx_err} (moe-ep needs an sm_90 or newer GPU)"
                    ),
                        })
                    }
                }
            }
        };
        Ok(Module {
            name,
            raw,
            funcs: Mutex::new(HashMap::new()),
            ctx: ctx.clone(),
        })
    }

    /// The entry point `func` of this module.
    pub fn function(self: &Arc<Self>, func: &'static str) -> Result<Function> {
        let mut funcs = self.funcs.lock().unwrap_or_else(|p| p.into_inner());
        let raw = match funcs.get(func) {
            Some(f) => *f,
            None => {
                let cname = CString::new(func).expect("kernel names have no NUL");
                // SAFETY: raw is a live module.
                let f = unsafe { result::module::get_function(self.raw, cname) }.map_err(|e| {
                    Error::Module {
                        module: self.name,
                        detail: format!("no entry point {func}: {e}"),
                    }
                })?;
                // Loaded now, not at its first launch: with lazy loading (the
                // CUDA default) a first launch may wait for the whole GPU,
                // where other ranks' kernels on it (virtual ranks) can be
                // waiting for this rank's next launch.
                self.ctx
                    .bind_to_thread()
                    .map_err(Error::cuda("cuCtxSetCurrent"))?;
                // SAFETY: f is a function of a live module; its context is current.
                let rc = unsafe { sys::cuFuncLoad(f) };
                if rc != sys::CUresult::CUDA_SUCCESS {
                    return Err(Error::Module {
                        module: self.name,
                        detail: format!("loading {func}: {:?}", result::DriverError(rc)),
                    });
                }
                funcs.insert(func, f);
                f
            }
        };
        Ok(Function {
            raw,
            name: func,
            _module: self.clone(),
        })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: loaded in load; Drop runs once.
        if let Err(e) = unsafe { result::module::unload(self.raw) } {
            tracing::warn!("unloading module {} failed: {e}", self.name);
        }
    }
}

/// A kernel entry point; keeps its module loaded.
#[derive(Clone)]
pub struct Function {
    raw: sys::CUfunction,
    /// The `extern "C"` name.
    pub name: &'static str,
    _module: Arc<Module>,
}

// SAFETY: see Module.
unsafe impl Send for Function {}
unsafe impl Sync for Function {}

impl Function {
    /// Lets launches ask for up to `bytes` of dynamic shared memory (above
    /// the default 48 KiB needs this opt-in).
    pub fn allow_dynamic_smem(&self, bytes: u32) -> Result<()> {
        // SAFETY: raw is a live function of a loaded module.
        unsafe {
            result::function::set_function_attribute(
                self.raw,
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .map_err(|source| Error::Cuda {
            context: self.name,
            source,
        })
    }

    /// How many blocks of `block` threads with `smem` bytes of dynamic
    /// shared memory one SM holds at once (registers, shared memory, threads
    /// and the block limit all counted).
    pub fn max_blocks_per_sm(&self, block: u32, smem: u32) -> Result<usize> {
        // SAFETY: raw is a live function of a loaded module.
        let n = unsafe {
            result::occupancy::max_active_block_per_multiprocessor(
                self.raw,
                block as i32,
                smem as usize,
            )
        }
        .map_err(|source| Error::Cuda {
            context: self.name,
            source,
        })?;
        Ok(n.max(0) as usize)
    }

    /// Launches with one by-value parameter struct (`__grid_constant__ const P`).
    ///
    /// # Safety
    /// `P` must be the exact mirror of the kernel's parameter struct, and every
    /// pointer in it must be valid for what the kernel does with it until the
    /// launch has run on `stream`.
    pub unsafe fn launch<P: Copy>(
        &self,
        stream: &CudaStream,
        grid: u32,
        block: u32,
        smem: u32,
        params: &P,
    ) -> Result<()> {
        let mut p = *params;
        let mut args = [&mut p as *mut P as *mut c_void];
        result::launch_kernel(
            self.raw,
            (grid, 1, 1),
            (block, 1, 1),
            smem,
            stream.cu_stream(),
            &mut args,
        )
        .map_err(|source| Error::Cuda {
            context: self.name,
            source,
        })
    }

    /// Launches with an explicit argument array (kernels with several scalar
    /// parameters).
    ///
    /// # Safety
    /// `args[i]` must point at a value of exactly the kernel's i-th parameter type.
    pub unsafe fn launch_raw(
        &self,
        stream: &CudaStream,
        grid: u32,
        block: u32,
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        result::launch_kernel(
            self.raw,
            (grid, 1, 1),
            (block, 1, 1),
            smem,
            stream.cu_stream(),
            args,
        )
        .map_err(|source| Error::Cuda {
            context: self.name,
            source,
        })
    }
}
