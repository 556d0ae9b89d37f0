//! Device code the library runs itself: a byte comparison of two device ranges (deduplication
//! confirms equal memory on the GPU instead of reading both ranges through the host). The
//! kernel is PTX text, compiled by the driver's JIT when first needed, so no CUDA compiler is
//! needed to build the library.

use std::ffi::{c_void, CStr};
use std::ptr;

use cudarc::driver::sys;

use super::{check, to_stream, CudaDevice};
use crate::device::{Device, DevicePtr, Stream};
use crate::error::{Error, ErrorKind, Result};

/// `glake_differ(a, b, words, flag)`: every thread of a grid-stride loop compares 64-bit words
/// of `a` and `b` and, when any differed, stores 1 at `flag`.
const DIFFER_PTX: &CStr = c"
.version 6.0
.target sm_52
.address_size 64

.visible .entry glake_differ(
    .param .u64 a,
    .param .u64 b,
    .param .u64 words,
    .param .u64 flag
)
{
    .reg .pred p, q;
    .reg .b32 r<8>;
    .reg .b64 rd<14>;

    ld.param.u64 rd1, [a];
    ld.param.u64 rd2, [b];
    ld.param.u64 rd3, [words];
    ld.param.u64 rd4, [flag];
    cvta.to.global.u64 rd1, rd1;
    cvta.to.global.u64 rd2, rd2;
    mov.u32 r1, %ctaid.x;
    mov.u32 r2, %ntid.x;
    mov.u32 r3, %tid.x;
    mov.u32 r4, %nctaid.x;
    mul.wide.u32 rd5, r1, r2;
    cvt.u64.u32 rd6, r3;
    add.u64 rd5, rd5, rd6;
    mul.wide.u32 rd7, r4, r2;
    mov.u32 r5, 0;
LOOP:
    setp.ge.u64 p, rd5, rd3;
    @p bra DONE;
    shl.b64 rd8, rd5, 3;
    add.u64 rd9, rd1, rd8;
    add.u64 rd10, rd2, rd8;
    ld.global.nc.u64 rd11, [rd9];
    ld.global.nc.u64 rd12, [rd10];
    setp.ne.u64 q, rd11, rd12;
    selp.u32 r6, 1, 0, q;
    or.b32 r5, r5, r6;
    add.u64 rd5, rd5, rd7;
    bra LOOP;
DONE:
    setp.eq.u32 p, r5, 0;
    @p bra END;
    mov.u32 r7, 1;
    st.u32 [rd4], r7;
END:
    ret;
}
";

/// Threads per block and most blocks of a comparison (the loop strides over the rest).
const THREADS: u32 = 256;
const MAX_BLOCKS: u64 = 4096;

/// The loaded comparison kernel of one device's context.
#[derive(Debug)]
pub(super) struct Kernels {
    module: sys::CUmodule,
    differ: sys::CUfunction,
}

// SAFETY: module and function handles are opaque driver handles, usable from any thread with
// the device's context current (every caller enters it).
unsafe impl Send for Kernels {}
// SAFETY: as above; nothing mutable is reached through `&Kernels`.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// JIT-compiles the kernels into the current context.
    pub(super) fn load() -> Result<Kernels> {
        let mut module: sys::CUmodule = ptr::null_mut();
        // SAFETY: valid out-pointer and a NUL-terminated PTX image.
        check(
            unsafe { sys::cuModuleLoadData(&mut module, DIFFER_PTX.as_ptr().cast()) },
            "cuModuleLoadData",
        )?;
        let mut differ: sys::CUfunction = ptr::null_mut();
        // SAFETY: the module was just loaded; the name is NUL-terminated.
        let found = check(
            unsafe { sys::cuModuleGetFunction(&mut differ, module, c"glake_differ".as_ptr()) },
            "cuModuleGetFunction",
        );
        if let Err(err) = found {
            // SAFETY: unloading the module loaded above, used nowhere.
            unsafe { sys::cuModuleUnload(module) };
            return Err(err);
        }
        Ok(Kernels { module, differ })
    }
}

impl CudaDevice {
    /// [`Device::equal_bytes`] with the comparison kernel on `stream`.
    pub(super) fn compare_on_device(
        &self,
        a: DevicePtr,
        b: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<bool> {
        if len % 8 != 0 || a % 8 != 0 || b % 8 != 0 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "the device comparison takes 8-byte aligned whole words",
            ));
        }
        // Without the kernel (no JIT for this device), callers compare through the host.
        let kernels = self.kernels().map_err(|err| {
            Error::new(
                ErrorKind::Unsupported,
                format!("no device comparison: {err}"),
            )
        })?;
        // The kernel writes its answer straight into pinned host memory (unified addressing).
        let flag = self.alloc_pinned(8)?;
        // SAFETY: `flag` holds 8 writable bytes.
        unsafe { flag.cast::<u32>().write_volatile(0) };
        let words = (len / 8) as u64;
        let blocks = words.div_ceil(u64::from(THREADS)).clamp(1, MAX_BLOCKS) as u32;
        let (mut pa, mut pb, mut pw, mut pf) = (a, b, words, flag as u64);
        let mut params: [*mut c_void; 4] = [
            (&mut pa as *mut u64).cast(),
            (&mut pb as *mut u64).cast(),
            (&mut pw as *mut u64).cast(),
            (&mut pf as *mut u64).cast(),
        ];
        let launched = self.enter().and_then(|_guard| {
            // SAFETY: the function takes four 64-bit parameters, each pointed to by `params`
            // for the call's duration; the ranges are the caller's device memory.
            check(
                unsafe {
                    sys::cuLaunchKernel(
                        kernels.differ,
                        blocks,
                        1,
                        1,
                        THREADS,
                        1,
                        1,
                        0,
                        to_stream(stream),
                        params.as_mut_ptr(),
                        ptr::null_mut(),
                    )
                },
                "cuLaunchKernel",
            )
        });
        let result = launched
            .and_then(|()| self.synchronize_stream(stream))
            // SAFETY: the kernel has completed; `flag` is still ours.
            .map(|()| unsafe { flag.cast::<u32>().read_volatile() } == 0);
        // SAFETY: the stream is synchronised (or the launch failed): nothing uses `flag`.
        if let Err(err) = unsafe { self.free_pinned(flag) } {
            log::warn!("glake: a pinned flag was not freed: {err}");
        }
        result
    }

    /// The kernels of this device's context, loaded on first use.
    fn kernels(&self) -> Result<&Kernels> {
        self.kernels
            .get_or_init(|| {
                let _guard = self.enter()?;
                Kernels::load()
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

impl Kernels {
    /// Unloads the module; the caller has the context current and nothing runs its code.
    pub(super) fn unload(&self) {
        // SAFETY: loaded by `load`, and the caller's guarantees above.
        unsafe { sys::cuModuleUnload(self.module) };
    }
}
