//! The one error type of the crate. Every driver failure, bad input and exhausted budget becomes
//! an [`Error`]; nothing below the C boundary panics on purpose.

use std::fmt;

/// What went wrong, coarse enough to map onto a C status code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A value passed in is out of range or malformed.
    InvalidArgument,
    /// A required pointer argument was NULL.
    NullPointer,
    /// A pointer this pool did not hand out (or an interior pointer).
    InvalidPointer,
    /// A pointer this pool handed out that is already free.
    DoubleFree,
    /// The request cannot be satisfied within the device or the configured cap.
    OutOfMemory,
    /// A driver (or operating-system) call failed.
    Driver,
    /// No usable device or driver.
    NoDevice,
    /// The operation is not available on this backend or driver version.
    Unsupported,
    /// A limit of the platform was reached (for example `vm.max_map_count`).
    ResourceLimit,
    /// The object is in a state that does not allow the call (for example during graph capture).
    InvalidState,
    /// A bug: an internal invariant did not hold.
    Internal,
}

/// An error with a human-readable message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    pub fn out_of_memory(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::OutOfMemory, message)
    }

    pub fn driver(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Driver, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// The same error with `context: ` put in front of its message.
    pub fn context(self, context: impl fmt::Display) -> Self {
        Error {
            kind: self.kind,
            message: format!("{context}: {}", self.message),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;
