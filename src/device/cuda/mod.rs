//! The CUDA backend: the only module that calls the CUDA driver.
//!
//! It uses the raw driver API of `cudarc::driver::sys`, loaded at run time. cudarc's wrappers
//! panic when `libcuda` or one of its symbols is missing, so [`CudaDevice::open`],
//! [`is_available`] and [`driver_version`] first check the library and every symbol this file
//! calls; no driver function is called before that check has passed.
//!
//! Callers come from any thread (PyTorch frees from threads that never set a device), so every
//! method makes the device's primary context current for the duration of the call and restores
//! the thread's previous context afterwards, leaving the caller's CUDA runtime state untouched.

mod kernels;

use std::collections::HashSet;
use std::ffi::{c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::raw::c_char;
use std::ptr;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::sys;

use super::{
    BackendKind, CaptureMode, Device, DevicePtr, Event, HostMemory, MemInfo, PhysHandle, Stream,
};
use crate::error::{Error, ErrorKind, Result};

/// Oldest driver accepted: CUDA 11.2, the first with a stable virtual memory management API.
const MIN_DRIVER_VERSION: i32 = 11020;

/// Every driver symbol this file calls, spelled as the `cudarc::driver::sys` wrappers load them.
/// Checked up front because a missing one would make the wrapper panic.
const REQUIRED_SYMBOLS: [&str; 46] = [
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuMemGetAllocationGranularity",
    "cuMemGetInfo_v2",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuPointerGetAttributes",
    "cuThreadExchangeStreamCaptureMode",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
];

/// Shareable memory is exported as POSIX file descriptors (passed over Unix sockets).
const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// Result of the library and symbol check, done once per process.
static SYMBOLS: OnceLock<Result<()>> = OnceLock::new();
/// Result of `cuInit(0)` (after the symbol check), done once per process.
static INIT: OnceLock<Result<()>> = OnceLock::new();

/// Checks that `libcuda` loads and exports every symbol in [`REQUIRED_SYMBOLS`].
fn symbols() -> Result<()> {
    SYMBOLS
        .get_or_init(|| {
            // SAFETY: only tries to dlopen the candidate library names; panics on nothing.
            if !unsafe { sys::is_culib_present() } {
                return Err(Error::new(ErrorKind::NoDevice, "libcuda not found"));
            }
            // SAFETY: `is_culib_present` just loaded one of the names `culib` tries, in the same
            // order, so `culib` finds a library and does not panic.
            let lib = unsafe { sys::culib() };
            for name in REQUIRED_SYMBOLS {
                // SAFETY: the symbol is only looked up, never called through this pointer.
                if unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err() {
                    return Err(Error::new(
                        ErrorKind::Unsupported,
                        format!("the CUDA driver does not export {name}"),
                    ));
                }
            }
            Ok(())
        })
        .clone()
}

/// Loads the driver and runs `cuInit(0)`.
fn init() -> Result<()> {
    INIT.get_or_init(|| {
        symbols()?;
        // SAFETY: symbols are present; cuInit takes no pointers.
        check(unsafe { sys::cuInit(0) }, "cuInit")
    })
    .clone()
}

/// The name of a driver error, from `cuGetErrorName` when the driver is loaded.
fn error_name(result: sys::CUresult) -> String {
    if matches!(SYMBOLS.get(), Some(Ok(()))) {
        let mut name: *const c_char = ptr::null();
        // SAFETY: symbols are present; `name` is a valid out-pointer.
        let status = unsafe { sys::cuGetErrorName(result, &mut name) };
        if status == sys::CUresult::CUDA_SUCCESS && !name.is_null() {
            // SAFETY: the driver returns a pointer to a static NUL-terminated string.
            return unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned();
        }
    }
    format!("{result:?}")
}

/// Turns a driver status into a `Result`, naming the call and the error.
fn check(result: sys::CUresult, call: &str) -> Result<()> {
    let kind = match result {
        sys::CUresult::CUDA_SUCCESS => return Ok(()),
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => ErrorKind::OutOfMemory,
        sys::CUresult::CUDA_ERROR_NO_DEVICE => ErrorKind::NoDevice,
        _ => ErrorKind::Driver,
    };
    Err(Error::new(
        kind,
        format!("{call} failed: {}", error_name(result)),
    ))
}

/// Whether a usable CUDA driver with at least one device is present. Never panics.
pub fn is_available() -> bool {
    if init().is_err() {
        return false;
    }
    let mut count = 0;
    // SAFETY: the driver is initialised; `count` is a valid out-pointer.
    let status = unsafe { sys::cuDeviceGetCount(&mut count) };
    status == sys::CUresult::CUDA_SUCCESS && count > 0
}

/// The CUDA version the installed driver supports, e.g. 13000 for CUDA 13.0.
pub fn driver_version() -> Result<i32> {
    symbols()?;
    let mut version = 0;
    // SAFETY: symbols are present; `version` is a valid out-pointer. Needs no cuInit.
    check(
        unsafe { sys::cuDriverGetVersion(&mut version) },
        "cuDriverGetVersion",
    )?;
    Ok(version)
}

fn to_stream(stream: Stream) -> sys::CUstream {
    stream.0 as usize as sys::CUstream
}

fn to_event(event: Event) -> sys::CUevent {
    event.0 as usize as sys::CUevent
}

/// Makes a context current on this thread for the guard's lifetime; restores the previous one on
/// drop, so that a caller's CUDA runtime keeps its device. Costs one `cuCtxGetCurrent` when the
/// context is already current.
struct ContextGuard {
    previous: sys::CUcontext,
    switched: bool,
}

impl ContextGuard {
    fn enter(ctx: sys::CUcontext) -> Result<Self> {
        let mut previous: sys::CUcontext = ptr::null_mut();
        // SAFETY: `previous` is a valid out-pointer.
        check(
            unsafe { sys::cuCtxGetCurrent(&mut previous) },
            "cuCtxGetCurrent",
        )?;
        if previous == ctx {
            return Ok(ContextGuard {
                previous,
                switched: false,
            });
        }
        // SAFETY: `ctx` is a primary context retained by the `CudaDevice` that outlives the guard.
        check(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")?;
        Ok(ContextGuard {
            previous,
            switched: true,
        })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if self.switched {
            // SAFETY: restores the context that was current when the guard was made (or none).
            let status = unsafe { sys::cuCtxSetCurrent(self.previous) };
            if let Err(err) = check(status, "cuCtxSetCurrent (restore)") {
                log::warn!("{err}");
            }
        }
    }
}

/// One CUDA device, driven through its primary context (the one the CUDA runtime and PyTorch
/// use, so pointers and streams are shared with them).
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: i32,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    granularity: usize,
    /// Live physical handles. The driver dereferences a handle as a pointer and crashes on a
    /// stale or foreign one, so `map` and `release_physical` check here first.
    handles: Mutex<HashSet<sys::CUmemGenericAllocationHandle>>,
    /// The library's own device code, JIT-compiled on first use (or why it could not be).
    kernels: OnceLock<Result<kernels::Kernels>>,
}

// SAFETY: `CUdevice` is an integer and `CUcontext` an opaque handle; the driver API calls made
// here are thread-safe, and every method makes the context current on the calling thread.
unsafe impl Send for CudaDevice {}
// SAFETY: as above; `&self` methods hold no Rust-side mutable state.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// Opens device `ordinal`: checks driver and symbols, requires driver >= CUDA 11.2 and
    /// virtual memory management support, and retains the primary context (released on drop).
    pub fn open(ordinal: i32) -> Result<CudaDevice> {
        init()?;
        let version = driver_version()?;
        if version < MIN_DRIVER_VERSION {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("CUDA driver {version} is older than the required {MIN_DRIVER_VERSION}"),
            ));
        }
        if ordinal < 0 {
            return Err(Error::invalid_argument(format!(
                "negative CUDA device ordinal {ordinal}"
            )));
        }
        let mut count = 0;
        // SAFETY: the driver is initialised; `count` is a valid out-pointer.
        check(
            unsafe { sys::cuDeviceGetCount(&mut count) },
            "cuDeviceGetCount",
        )?;
        if ordinal >= count {
            return Err(Error::new(
                ErrorKind::NoDevice,
                format!("CUDA device {ordinal} does not exist ({count} visible)"),
            ));
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: `device` is a valid out-pointer; `ordinal` is in range.
        check(
            unsafe { sys::cuDeviceGet(&mut device, ordinal) },
            "cuDeviceGet",
        )?;
        let mut vmm = 0;
        // SAFETY: `vmm` is a valid out-pointer; `device` came from cuDeviceGet.
        check(
            unsafe {
                sys::cuDeviceGetAttribute(
                    &mut vmm,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                    device,
                )
            },
            "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)",
        )?;
        if vmm == 0 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("CUDA device {ordinal} does not support virtual memory management"),
            ));
        }
        let mut ctx: sys::CUcontext = ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; `device` came from cuDeviceGet.
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) },
            "cuDevicePrimaryCtxRetain",
        )?;
        // Built before the last step so that a failure below releases the context (Drop).
        let mut this = CudaDevice {
            ordinal,
            device,
            ctx,
            granularity: 0,
            handles: Mutex::new(HashSet::new()),
            kernels: OnceLock::new(),
        };
        let guard = ContextGuard::enter(ctx)?;
        let prop = this.allocation_prop();
        let mut granularity = 0usize;
        // SAFETY: `granularity` is a valid out-pointer and `prop` a fully initialised struct.
        check(
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut granularity,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )
            },
            "cuMemGetAllocationGranularity",
        )?;
        if !granularity.is_power_of_two() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("CUDA allocation granularity {granularity} is not a power of two"),
            ));
        }
        this.granularity = granularity;
        drop(guard);
        Ok(this)
    }

    /// Pinned device memory on this device, no shareable handle types.
    fn allocation_prop(&self) -> sys::CUmemAllocationProp {
        self.allocation_prop_with(sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE)
    }

    fn allocation_prop_with(
        &self,
        handle_types: sys::CUmemAllocationHandleType,
    ) -> sys::CUmemAllocationProp {
        sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: handle_types,
            location: device_location(self.ordinal),
            win32HandleMetaData: ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        }
    }

    /// `cuMemSetAccess` of `[va, va+size)` for `devices`, with `flags`.
    fn grant(
        &self,
        va: DevicePtr,
        size: usize,
        devices: &[i32],
        flags: sys::CUmemAccess_flags,
    ) -> Result<()> {
        if devices.is_empty() {
            return Ok(());
        }
        if let Some(bad) = devices.iter().find(|&&d| d < 0) {
            return Err(Error::invalid_argument(format!(
                "negative CUDA device ordinal {bad}"
            )));
        }
        let descs: Vec<sys::CUmemAccessDesc> = devices
            .iter()
            .map(|&d| sys::CUmemAccessDesc {
                location: device_location(d),
                flags,
            })
            .collect();
        let _guard = self.enter()?;
        // SAFETY: `descs` holds `descs.len()` initialised descriptors for the call's duration.
        check(
            unsafe { sys::cuMemSetAccess(va, size, descs.as_ptr(), descs.len()) },
            "cuMemSetAccess",
        )
    }

    /// `cuMemCreate` of `size` bytes with `prop`, booked as a live handle.
    fn create_with(&self, size: usize, prop: sys::CUmemAllocationProp) -> Result<PhysHandle> {
        let _guard = self.enter()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and fully initialised `prop`.
        check(
            unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) },
            "cuMemCreate",
        )
        .map_err(|e| {
            e.context(format!(
                "creating {size} bytes on CUDA device {}",
                self.ordinal
            ))
        })?;
        self.handles().insert(handle);
        Ok(PhysHandle(handle))
    }

    /// The live-handle set; a poisoned lock is still usable (the set is updated atomically).
    fn handles(&self) -> MutexGuard<'_, HashSet<sys::CUmemGenericAllocationHandle>> {
        self.handles.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes this device's context current for the rest of the calling scope.
    fn enter(&self) -> Result<ContextGuard> {
        ContextGuard::enter(self.ctx)
    }
}

fn device_location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

fn unknown_handle(handle: PhysHandle) -> Error {
    Error::invalid_argument(format!(
        "physical handle {:#x} was not created by this device or is already released",
        handle.0
    ))
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if let Some(Ok(kernels)) = self.kernels.get() {
            if let Ok(_guard) = self.enter() {
                kernels.unload();
            }
        }
        // SAFETY: releases the reference retained in `open`; nothing uses `ctx` afterwards.
        let status = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        // At process exit the driver may already be shut down; nothing left to do then.
        if status != sys::CUresult::CUDA_ERROR_DEINITIALIZED {
            if let Err(err) = check(status, "cuDevicePrimaryCtxRelease") {
                log::warn!("{err}");
            }
        }
    }
}

impl Device for CudaDevice {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn ordinal(&self) -> i32 {
        self.ordinal
    }

    fn granularity(&self) -> usize {
        self.granularity
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let _guard = self.enter()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; the context is current.
        check(
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            "cuMemGetInfo",
        )?;
        Ok(MemInfo { free, total })
    }

    fn device_count(&self) -> Result<usize> {
        let mut count = 0;
        // SAFETY: valid out-pointer; the driver was initialised in `open`.
        check(
            unsafe { sys::cuDeviceGetCount(&mut count) },
            "cuDeviceGetCount",
        )?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    fn can_access_peer(&self, peer: i32) -> Result<bool> {
        if peer == self.ordinal {
            return Ok(true);
        }
        if peer < 0 {
            return Err(Error::invalid_argument(format!(
                "negative CUDA device ordinal {peer}"
            )));
        }
        let mut peer_device: sys::CUdevice = 0;
        // SAFETY: valid out-pointer; an out-of-range ordinal is reported as an error.
        check(
            unsafe { sys::cuDeviceGet(&mut peer_device, peer) },
            "cuDeviceGet",
        )?;
        let mut can = 0;
        // SAFETY: valid out-pointer and device handles from cuDeviceGet.
        check(
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, peer_device, self.device) },
            "cuDeviceCanAccessPeer",
        )?;
        Ok(can != 0)
    }

    fn reserve(&self, size: usize, align: usize) -> Result<DevicePtr> {
        let _guard = self.enter()?;
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; no fixed address requested, no flags.
        check(
            unsafe { sys::cuMemAddressReserve(&mut va, size, align, 0, 0) },
            "cuMemAddressReserve",
        )
        .map_err(|e| e.context(format!("reserving {size} bytes (align {align})")))?;
        Ok(va)
    }

    fn unreserve(&self, va: DevicePtr, size: usize) -> Result<()> {
        let _guard = self.enter()?;
        // SAFETY: the driver validates that the range was reserved.
        check(
            unsafe { sys::cuMemAddressFree(va, size) },
            "cuMemAddressFree",
        )
    }

    fn create_physical(&self, size: usize) -> Result<PhysHandle> {
        self.create_with(size, self.allocation_prop())
    }

    fn create_shareable(&self, size: usize) -> Result<PhysHandle> {
        self.create_with(size, self.allocation_prop_with(POSIX_FD))
    }

    fn export_handle(&self, handle: PhysHandle) -> Result<OwnedFd> {
        let _guard = self.enter()?;
        let handles = self.handles();
        if !handles.contains(&handle.0) {
            return Err(unknown_handle(handle));
        }
        let mut fd: libc::c_int = -1;
        // SAFETY: the handle is live (checked above, lock held); for POSIX descriptors the
        // driver writes an `int` through the out-pointer.
        check(
            unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut libc::c_int).cast(),
                    handle.0,
                    POSIX_FD,
                    0,
                )
            },
            "cuMemExportToShareableHandle",
        )?;
        if fd < 0 {
            return Err(Error::driver(
                "cuMemExportToShareableHandle gave no descriptor",
            ));
        }
        // SAFETY: the driver handed over a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn import_handle(&self, fd: BorrowedFd<'_>, size: usize) -> Result<PhysHandle> {
        let _guard = self.enter()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer; for POSIX descriptors the driver takes the descriptor's
        // value as the pointer argument and does not take ownership of it.
        check(
            unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut handle,
                    fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                    POSIX_FD,
                )
            },
            "cuMemImportFromShareableHandle",
        )?;
        let mut prop = self.allocation_prop();
        // SAFETY: the handle was just imported; `prop` is a valid out-pointer.
        let known = check(
            unsafe { sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, handle) },
            "cuMemGetAllocationPropertiesFromHandle",
        );
        // Another GPU's memory cannot back this device's ranges.
        let same_device = prop.location.id == self.ordinal;
        if known.is_err() || !same_device || size % self.granularity != 0 {
            // SAFETY: releasing the handle imported above, used nowhere.
            unsafe { sys::cuMemRelease(handle) };
            return Err(Error::invalid_argument(format!(
                "import: the descriptor is not {size} bytes of memory of CUDA device {}",
                self.ordinal
            )));
        }
        self.handles().insert(handle);
        Ok(PhysHandle(handle))
    }

    fn identity(&self) -> Result<String> {
        // CUDA 11.4 and later; the wrapper would panic on an older driver without it.
        // SAFETY: the symbol is only looked up; `symbols()` succeeded, so the library loaded.
        if unsafe { sys::culib().get::<*const ()>(b"cuDeviceGetUuid_v2") }.is_err() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "the CUDA driver has no cuDeviceGetUuid_v2 (CUDA 11.4)",
            ));
        }
        let _guard = self.enter()?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: valid out-pointer and device; the symbol is present (checked above).
        check(
            unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, self.device) },
            "cuDeviceGetUuid_v2",
        )?;
        Ok(uuid
            .bytes
            .iter()
            .map(|b| format!("{:02x}", *b as u8))
            .collect::<String>())
    }

    fn release_physical(&self, handle: PhysHandle) -> Result<()> {
        let _guard = self.enter()?;
        // Held across the call so that no `map` can use the handle while it is released.
        let mut handles = self.handles();
        if !handles.contains(&handle.0) {
            return Err(unknown_handle(handle));
        }
        // SAFETY: the handle came from `cuMemCreate` here and has not been released.
        check(unsafe { sys::cuMemRelease(handle.0) }, "cuMemRelease")?;
        handles.remove(&handle.0);
        Ok(())
    }

    fn map(&self, va: DevicePtr, size: usize, handle: PhysHandle, offset: usize) -> Result<()> {
        let _guard = self.enter()?;
        let handles = self.handles();
        if !handles.contains(&handle.0) {
            return Err(unknown_handle(handle));
        }
        // SAFETY: the handle is live (checked above, lock held); the driver validates the range
        // and the offset.
        check(
            unsafe { sys::cuMemMap(va, size, offset, handle.0, 0) },
            "cuMemMap",
        )
    }

    fn unmap(&self, va: DevicePtr, size: usize) -> Result<()> {
        let _guard = self.enter()?;
        // SAFETY: the driver validates the range.
        check(unsafe { sys::cuMemUnmap(va, size) }, "cuMemUnmap")
    }

    fn set_access(&self, va: DevicePtr, size: usize, devices: &[i32]) -> Result<()> {
        self.grant(
            va,
            size,
            devices,
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        )
    }

    fn set_access_read_only(&self, va: DevicePtr, size: usize, devices: &[i32]) -> Result<()> {
        self.grant(
            va,
            size,
            devices,
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
        )
    }

    fn equal_bytes(&self, a: DevicePtr, b: DevicePtr, len: usize, stream: Stream) -> Result<bool> {
        self.compare_on_device(a, b, len, stream)
    }

    fn create_stream(&self) -> Result<Stream> {
        let _guard = self.enter()?;
        let mut stream: sys::CUstream = ptr::null_mut();
        // SAFETY: valid out-pointer; the stream belongs to the current (primary) context.
        check(
            unsafe {
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            },
            "cuStreamCreate",
        )?;
        Ok(Stream(stream as usize as u64))
    }

    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        if stream == Stream::DEFAULT {
            return Err(Error::invalid_argument(
                "cannot destroy the default CUDA stream",
            ));
        }
        let _guard = self.enter()?;
        // SAFETY: the caller passes a stream from `create_stream`; the driver validates it.
        check(
            unsafe { sys::cuStreamDestroy_v2(to_stream(stream)) },
            "cuStreamDestroy",
        )
    }

    fn create_event(&self) -> Result<Event> {
        let _guard = self.enter()?;
        let mut event: sys::CUevent = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check(
            unsafe {
                sys::cuEventCreate(
                    &mut event,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            },
            "cuEventCreate",
        )?;
        Ok(Event(event as usize as u64))
    }

    fn create_timed_event(&self) -> Result<Event> {
        let _guard = self.enter()?;
        let mut event: sys::CUevent = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check(
            unsafe { sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) },
            "cuEventCreate",
        )?;
        Ok(Event(event as usize as u64))
    }

    fn elapsed_ns(&self, start: Event, end: Event) -> Result<u64> {
        let _guard = self.enter()?;
        let mut ms: f32 = 0.0;
        // SAFETY: valid out-pointer; the driver validates the event handles (and refuses
        // events made without timing or not yet complete).
        check(
            unsafe { sys::cuEventElapsedTime_v2(&mut ms, to_event(start), to_event(end)) },
            "cuEventElapsedTime",
        )?;
        // `as` saturates: a negative span (end completed first) becomes 0.
        Ok((f64::from(ms) * 1e6) as u64)
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        let _guard = self.enter()?;
        // SAFETY: the caller passes an event from `create_event`; the driver validates it.
        check(
            unsafe { sys::cuEventDestroy_v2(to_event(event)) },
            "cuEventDestroy",
        )
    }

    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        let _guard = self.enter()?;
        // SAFETY: handles from this backend (or 0, the legacy stream); the driver validates them.
        check(
            unsafe { sys::cuEventRecord(to_event(event), to_stream(stream)) },
            "cuEventRecord",
        )
    }

    fn query_event(&self, event: Event) -> Result<bool> {
        let _guard = self.enter()?;
        // SAFETY: the driver validates the event handle.
        match unsafe { sys::cuEventQuery(to_event(event)) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "cuEventQuery").map(|()| false),
        }
    }

    fn synchronize_event(&self, event: Event) -> Result<()> {
        let _guard = self.enter()?;
        // SAFETY: the driver validates the event handle.
        check(
            unsafe { sys::cuEventSynchronize(to_event(event)) },
            "cuEventSynchronize",
        )
    }

    fn synchronize_stream(&self, stream: Stream) -> Result<()> {
        let _guard = self.enter()?;
        // SAFETY: the driver validates the stream handle (0 is the legacy stream).
        check(
            unsafe { sys::cuStreamSynchronize(to_stream(stream)) },
            "cuStreamSynchronize",
        )
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        use sys::CUstreamCaptureMode as M;
        let mut value = match mode {
            CaptureMode::Global => M::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => M::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // SAFETY: `value` is a valid in/out pointer; the mode is per thread, no context needed.
        check(
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut value) },
            "cuThreadExchangeStreamCaptureMode",
        )?;
        Ok(match value {
            M::CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
            M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
            M::CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
        })
    }

    fn synchronize_device(&self) -> Result<()> {
        let _guard = self.enter()?;
        // SAFETY: no arguments; waits for all work of the current (primary) context.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        let _guard = self.enter()?;
        // SAFETY: the driver validates both handles.
        check(
            unsafe { sys::cuStreamWaitEvent(to_stream(stream), to_event(event), 0) },
            "cuStreamWaitEvent",
        )
    }

    unsafe fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _guard = self.enter()?;
        // SAFETY: the caller guarantees `src` is valid for `len` bytes until the copy completes.
        check(
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), len, to_stream(stream)) },
            "cuMemcpyHtoDAsync",
        )
    }

    unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _guard = self.enter()?;
        // SAFETY: the caller guarantees `dst` is valid for `len` bytes until the copy completes.
        check(
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, len, to_stream(stream)) },
            "cuMemcpyDtoHAsync",
        )
    }

    fn copy_device(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _guard = self.enter()?;
        // SAFETY: device addresses only; the driver validates them.
        check(
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, to_stream(stream)) },
            "cuMemcpyDtoDAsync",
        )
    }

    fn alloc_pinned(&self, size: usize) -> Result<*mut u8> {
        let _guard = self.enter()?;
        let mut host: *mut c_void = ptr::null_mut();
        // SAFETY: valid out-pointer; portable so that any context can use the memory.
        check(
            unsafe { sys::cuMemHostAlloc(&mut host, size, sys::CU_MEMHOSTALLOC_PORTABLE) },
            "cuMemHostAlloc",
        )
        .map_err(|e| e.context(format!("allocating {size} pinned bytes")))?;
        Ok(host.cast::<u8>())
    }

    unsafe fn free_pinned(&self, ptr: *mut u8) -> Result<()> {
        let _guard = self.enter()?;
        // SAFETY: the caller guarantees `ptr` came from `alloc_pinned` and is no longer in use.
        check(
            unsafe { sys::cuMemFreeHost(ptr.cast::<c_void>()) },
            "cuMemFreeHost",
        )
    }
    unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let _guard = self.enter()?;
        // SAFETY: the caller guarantees the range stays valid until it is unregistered.
        check(
            unsafe {
                sys::cuMemHostRegister_v2(
                    ptr.cast::<c_void>(),
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            },
            "cuMemHostRegister",
        )
        .map_err(|e| e.context(format!("page-locking {len} bytes at {ptr:?}")))
    }

    unsafe fn unregister_host(&self, ptr: *mut u8) -> Result<()> {
        let _guard = self.enter()?;
        // SAFETY: the caller guarantees no queued copy uses the range any more.
        check(
            unsafe { sys::cuMemHostUnregister(ptr.cast::<c_void>()) },
            "cuMemHostUnregister",
        )
    }

    fn host_memory(&self, ptr: *const u8, len: usize) -> Result<HostMemory> {
        if ptr.is_null() {
            return Err(Error::new(ErrorKind::NullPointer, "host pointer is NULL"));
        }
        let _guard = self.enter()?;
        let last = (ptr as u64).saturating_add(len.saturating_sub(1) as u64);
        for at in [ptr as u64, last] {
            let mut kind: u32 = 0;
            let mut attribute = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
            let mut data = (&mut kind as *mut u32).cast::<c_void>();
            // SAFETY: one attribute and one out-pointer of its size; the driver only looks the
            // address up. The plural call answers memory type 0 for pageable memory where the
            // singular one fails (which tools such as compute-sanitizer report as an error).
            let status = unsafe { sys::cuPointerGetAttributes(1, &mut attribute, &mut data, at) };
            if status != sys::CUresult::CUDA_SUCCESS
                || kind != sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32
            {
                return Ok(HostMemory::Pageable);
            }
        }
        Ok(HostMemory::Pinned)
    }

    fn numa_node(&self) -> Option<u32> {
        let mut node = -1;
        // SAFETY: valid out-pointer; an attribute the driver does not know is an error, not UB.
        let status = unsafe {
            sys::cuDeviceGetAttribute(
                &mut node,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
                self.device,
            )
        };
        (status == sys::CUresult::CUDA_SUCCESS && node >= 0).then_some(node as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_names_the_call_and_kind() {
        let err = check(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate")
            .err()
            .map(|e| (e.kind(), e.message().to_owned()));
        let (kind, message) = err.unwrap_or((ErrorKind::Internal, String::new()));
        assert_eq!(kind, ErrorKind::OutOfMemory);
        assert!(message.contains("cuMemCreate"), "{message}");
        assert!(message.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{message}");
        assert!(check(sys::CUresult::CUDA_SUCCESS, "cuInit").is_ok());
    }

    #[test]
    fn open_without_driver_is_an_error() {
        // SAFETY: only probes for the library.
        if unsafe { sys::is_culib_present() } {
            return;
        }
        let err = CudaDevice::open(0).err().map(|e| e.kind());
        assert_eq!(err, Some(ErrorKind::NoDevice));
        assert!(!is_available());
        assert!(driver_version().is_err());
    }

    #[test]
    fn round_trip() -> Result<()> {
        if !is_available() {
            assert!(CudaDevice::open(0).is_err());
            return Ok(());
        }
        let dev = CudaDevice::open(0)?;
        assert_eq!(dev.kind(), BackendKind::Cuda);
        let gran = dev.granularity();
        assert!(gran.is_power_of_two() && gran >= 4096);
        let info = dev.mem_info()?;
        assert!(info.free <= info.total && info.total > 0);
        assert!(dev.device_count()? >= 1);
        assert!(dev.can_access_peer(0)?);

        let size = 2 * gran;
        let va = dev.reserve(size, gran)?;
        let handle = dev.create_physical(size)?;
        dev.map(va, size, handle, 0)?;
        dev.set_access(va, size, &[dev.ordinal()])?;
        let bogus = dev.map(va, gran, PhysHandle(handle.0 ^ 0x10), 0);
        assert_eq!(
            bogus.err().map(|e| e.kind()),
            Some(ErrorKind::InvalidArgument)
        );

        let stream = dev.create_stream()?;
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut out = vec![0u8; 4096];
        let mut moved = vec![0u8; 4096];
        // SAFETY: `data`, `out` and `moved` outlive the stream synchronisation below.
        unsafe {
            dev.copy_to_device(va, data.as_ptr(), data.len(), stream)?;
            dev.copy_to_host(out.as_mut_ptr(), va, out.len(), stream)?;
        }
        dev.copy_device(va + gran as u64, va, 4096, stream)?;
        let event = dev.create_event()?;
        dev.record_event(event, stream)?;
        dev.stream_wait_event(Stream::DEFAULT, event)?;
        // SAFETY: as above.
        unsafe { dev.copy_to_host(moved.as_mut_ptr(), va + gran as u64, 4096, Stream::DEFAULT)? };
        dev.synchronize_stream(stream)?;
        dev.synchronize_event(event)?;
        dev.synchronize_stream(Stream::DEFAULT)?;
        dev.synchronize_device()?;
        assert!(dev.query_event(event)?);
        assert_eq!(out, data);
        assert_eq!(moved, data);

        let pinned = dev.alloc_pinned(4096)?;
        // SAFETY: nothing uses `pinned`.
        unsafe { dev.free_pinned(pinned)? };

        dev.destroy_event(event)?;
        dev.destroy_stream(stream)?;
        dev.unmap(va, size)?;
        dev.release_physical(handle)?;
        let again = dev.release_physical(handle);
        assert_eq!(
            again.err().map(|e| e.kind()),
            Some(ErrorKind::InvalidArgument)
        );
        dev.unreserve(va, size)?;
        Ok(())
    }

    #[test]
    fn calls_leave_the_thread_context_alone() -> Result<()> {
        if !is_available() {
            return Ok(());
        }
        let dev = CudaDevice::open(0)?;
        std::thread::scope(|s| {
            s.spawn(|| -> Result<()> {
                dev.mem_info()?;
                let mut current: sys::CUcontext = ptr::null_mut();
                // SAFETY: valid out-pointer.
                check(
                    unsafe { sys::cuCtxGetCurrent(&mut current) },
                    "cuCtxGetCurrent",
                )?;
                assert!(current.is_null());
                Ok(())
            })
            .join()
            .unwrap_or_else(|_| Err(Error::internal("thread panicked")))
        })
    }
}
