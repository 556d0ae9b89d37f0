//! The C API. Every export is `glake_*`, runs inside `guard` (a panic becomes
//! `GLAKE_STATUS_PANIC`, never an unwind into C), returns a [`glake_status`] and writes results
//! through out-pointers; [`glake_last_error_message`] gives the text of the last failure on the
//! calling thread. Nothing below this module knows about C.
#![allow(non_camel_case_types)]

mod dedup;
mod exports;
mod handles;
mod planner;
mod profiler;
mod session;
mod sleep;
mod transfer;

pub use dedup::*;
pub use exports::*;
pub use planner::*;
pub use profiler::*;
pub use session::*;
pub use sleep::*;
pub use transfer::*;

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{Error, ErrorKind};

/// Result of every C API call.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum glake_status {
    GLAKE_STATUS_SUCCESS = 0,
    /// A value is out of range, or flag bits are unknown.
    GLAKE_STATUS_INVALID_ARGUMENT = 1,
    /// A required pointer argument is NULL.
    GLAKE_STATUS_NULL_POINTER = 2,
    /// The pointer was not allocated by this pool (or points inside an allocation).
    GLAKE_STATUS_INVALID_POINTER = 3,
    /// The pointer was already freed.
    GLAKE_STATUS_DOUBLE_FREE = 4,
    /// Not enough device memory within the pool's cap.
    GLAKE_STATUS_OUT_OF_MEMORY = 5,
    /// A driver call failed.
    GLAKE_STATUS_DRIVER_ERROR = 6,
    /// No usable device of the requested backend.
    GLAKE_STATUS_NO_DEVICE = 7,
    /// Not supported by this backend or driver.
    GLAKE_STATUS_UNSUPPORTED = 8,
    /// A platform limit was reached (for example the number of memory mappings).
    GLAKE_STATUS_RESOURCE_LIMIT = 9,
    /// The call is not allowed in the current state.
    GLAKE_STATUS_INVALID_STATE = 10,
    /// The pool handle is not (or no longer) valid.
    GLAKE_STATUS_INVALID_HANDLE = 11,
    /// An internal panic was caught; the library stays usable but the call did nothing.
    GLAKE_STATUS_PANIC = 12,
    /// An internal invariant failed.
    GLAKE_STATUS_INTERNAL = 13,
}

/// Each error kind and the status it is reported as (one table, read both ways).
const STATUS_OF_KIND: [(ErrorKind, glake_status); 11] = [
    (
        ErrorKind::InvalidArgument,
        glake_status::GLAKE_STATUS_INVALID_ARGUMENT,
    ),
    (
        ErrorKind::NullPointer,
        glake_status::GLAKE_STATUS_NULL_POINTER,
    ),
    (
        ErrorKind::InvalidPointer,
        glake_status::GLAKE_STATUS_INVALID_POINTER,
    ),
    (
        ErrorKind::DoubleFree,
        glake_status::GLAKE_STATUS_DOUBLE_FREE,
    ),
    (
        ErrorKind::OutOfMemory,
        glake_status::GLAKE_STATUS_OUT_OF_MEMORY,
    ),
    (ErrorKind::Driver, glake_status::GLAKE_STATUS_DRIVER_ERROR),
    (ErrorKind::NoDevice, glake_status::GLAKE_STATUS_NO_DEVICE),
    (
        ErrorKind::Unsupported,
        glake_status::GLAKE_STATUS_UNSUPPORTED,
    ),
    (
        ErrorKind::ResourceLimit,
        glake_status::GLAKE_STATUS_RESOURCE_LIMIT,
    ),
    (
        ErrorKind::InvalidState,
        glake_status::GLAKE_STATUS_INVALID_STATE,
    ),
    (ErrorKind::Internal, glake_status::GLAKE_STATUS_INTERNAL),
];

impl From<ErrorKind> for glake_status {
    fn from(kind: ErrorKind) -> Self {
        STATUS_OF_KIND
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(glake_status::GLAKE_STATUS_INTERNAL, |(_, s)| *s)
    }
}

/// The error kind a status stands for, if it stands for one.
pub(crate) fn kind_of_status(status: u32) -> Option<ErrorKind> {
    STATUS_OF_KIND
        .iter()
        .find(|(_, s)| *s as u32 == status)
        .map(|(k, _)| *k)
}

/// A failure as the C API reports it.
pub(crate) struct Failure {
    status: glake_status,
    message: String,
}

impl From<Error> for Failure {
    fn from(err: Error) -> Self {
        Failure {
            status: err.kind().into(),
            message: err.message().to_string(),
        }
    }
}

impl Failure {
    pub(crate) fn new(status: glake_status, message: impl Into<String>) -> Self {
        Failure {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn null(what: &str) -> Self {
        Failure::new(
            glake_status::GLAKE_STATUS_NULL_POINTER,
            format!("{what} is NULL"),
        )
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = text);
}

/// Runs `f` as the body of an export: a panic is caught, an error is recorded as the thread's
/// last error message, and the status is returned.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), Failure>) -> glake_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            set_last_error("");
            glake_status::GLAKE_STATUS_SUCCESS
        }
        Ok(Err(failure)) => {
            set_last_error(&failure.message);
            failure.status
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            set_last_error(&format!("internal panic caught: {what}"));
            glake_status::GLAKE_STATUS_PANIC
        }
    }
}

/// Borrows a C array as a slice; NULL is allowed only for an empty one.
///
/// # Safety
/// `ptr` must point to `len` readable values when non-NULL.
pub(crate) unsafe fn slice_of<'a, T>(
    ptr: *const T,
    len: usize,
    what: &str,
) -> Result<&'a [T], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Failure::null(what));
    }
    // SAFETY: non-NULL and, per the caller's contract, `len` readable values.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// The message of the last failed call on this thread ("" after a success). The pointer stays
/// valid until the next glake call on the same thread.
#[no_mangle]
pub extern "C" fn glake_last_error_message() -> *const c_char {
    LAST_ERROR.with(|slot| slot.borrow().as_ptr())
}

/// A constant name for a status code ("GLAKE_STATUS_OUT_OF_MEMORY"), or "GLAKE_STATUS_UNKNOWN".
#[no_mangle]
pub extern "C" fn glake_status_name(status: u32) -> *const c_char {
    const NAMES: [&[u8]; 14] = [
        b"GLAKE_STATUS_SUCCESS\0",
        b"GLAKE_STATUS_INVALID_ARGUMENT\0",
        b"GLAKE_STATUS_NULL_POINTER\0",
        b"GLAKE_STATUS_INVALID_POINTER\0",
        b"GLAKE_STATUS_DOUBLE_FREE\0",
        b"GLAKE_STATUS_OUT_OF_MEMORY\0",
        b"GLAKE_STATUS_DRIVER_ERROR\0",
        b"GLAKE_STATUS_NO_DEVICE\0",
        b"GLAKE_STATUS_UNSUPPORTED\0",
        b"GLAKE_STATUS_RESOURCE_LIMIT\0",
        b"GLAKE_STATUS_INVALID_STATE\0",
        b"GLAKE_STATUS_INVALID_HANDLE\0",
        b"GLAKE_STATUS_PANIC\0",
        b"GLAKE_STATUS_INTERNAL\0",
    ];
    NAMES
        .get(status as usize)
        .copied()
        .unwrap_or(b"GLAKE_STATUS_UNKNOWN\0")
        .as_ptr()
        .cast()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn a_panic_becomes_a_status_and_a_message() {
        let status = guard(|| panic!("boom"));
        assert_eq!(status, glake_status::GLAKE_STATUS_PANIC);
        let text = unsafe { CStr::from_ptr(glake_last_error_message()) };
        assert_eq!(text.to_str().unwrap(), "internal panic caught: boom");
        assert_eq!(guard(|| Ok(())), glake_status::GLAKE_STATUS_SUCCESS);
    }
}
