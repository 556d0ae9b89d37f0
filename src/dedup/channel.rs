//! Descriptors of shared memory passed between processes: each process that serves memory
//! listens on `<dir>/<token>.sock` (its random name, `process_token`) (a thread of its own, started on its first export) and hands
//! a descriptor to a process of the same user that asks for one of its export numbers
//! (`SCM_RIGHTS`). Nothing needs starting beforehand and nothing runs as root.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};
use crate::sync::lock;

/// How long either side waits for the other before giving up on one exchange.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(5);

/// Reply status: the descriptor follows.
const FOUND: u8 = 0;
/// Reply status: this process no longer serves that number.
const GONE: u8 = 1;

/// What this process serves: export number -> (descriptor, length).
fn exports() -> &'static Mutex<HashMap<u64, (OwnedFd, u64)>> {
    static EXPORTS: OnceLock<Mutex<HashMap<u64, (OwnedFd, u64)>>> = OnceLock::new();
    EXPORTS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The directory this process listens in, once it does.
static LISTENING: OnceLock<std::result::Result<PathBuf, Error>> = OnceLock::new();

static NEXT_EXPORT: AtomicU64 = AtomicU64::new(1);

fn socket_path(dir: &Path, owner: u64) -> PathBuf {
    dir.join(format!("{owner:016x}.sock"))
}

/// This process's name among the processes sharing memory: random, so that neither a reused
/// pid nor another pid namespace's process is ever taken for it.
pub fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let here = &nanos as *const u128 as usize;
        let seed = format!(
            "{}-{nanos}-{here:x}-{:?}",
            std::process::id(),
            std::thread::current().id()
        );
        // Never 0: 0 means "not offered" in the pool's books.
        xxhash_rust::xxh3::xxh3_64(seed.as_bytes()).max(1)
    })
}

/// A new random number for an offer's origin.
pub fn new_origin(export: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&[process_token().to_le_bytes(), export.to_le_bytes()].concat())
}

/// Serves `fd` (`len` bytes of device memory) from now on; returns its export number. Starts
/// this process's listener in `dir` on first use.
pub fn serve(dir: &Path, fd: OwnedFd, len: u64) -> Result<u64> {
    let listening = LISTENING.get_or_init(|| listen(dir));
    match listening {
        Ok(at) if at == dir => {}
        Ok(at) => {
            return Err(Error::invalid_argument(format!(
                "this process already shares memory through {}, not {}",
                at.display(),
                dir.display()
            )))
        }
        Err(err) => return Err(err.clone()),
    }
    let export = NEXT_EXPORT.fetch_add(1, Ordering::Relaxed);
    lock(exports()).insert(export, (fd, len));
    Ok(export)
}

/// Stops serving `export`; its descriptor is closed.
pub fn unserve(export: u64) {
    lock(exports()).remove(&export);
}

fn listen(dir: &Path) -> std::result::Result<PathBuf, Error> {
    let path = socket_path(dir, process_token());
    let listener = UnixListener::bind(&path)
        .map_err(|e| Error::driver(format!("dedup socket {}: {e}", path.display())))?;
    std::thread::Builder::new()
        .name("glake-dedup".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(stream) => {
                        if let Err(err) = answer(stream) {
                            log::debug!("dedup: a request was not answered: {err}");
                        }
                    }
                    Err(err) => log::debug!("dedup: accept: {err}"),
                }
            }
        })
        .map_err(|e| Error::driver(format!("dedup listener thread: {e}")))?;
    Ok(dir.to_path_buf())
}

/// Answers one request: an export number in, a status and a length out, with the descriptor.
fn answer(mut stream: UnixStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(EXCHANGE_TIMEOUT))?;
    stream.set_write_timeout(Some(EXCHANGE_TIMEOUT))?;
    if !same_user(&stream) {
        return Err(std::io::Error::other("a process of another user asked"));
    }
    let mut request = [0u8; 8];
    stream.read_exact(&mut request)?;
    let export = u64::from_le_bytes(request);
    let served = lock(exports())
        .get(&export)
        .and_then(|(fd, len)| fd.try_clone().ok().map(|fd| (fd, *len)));
    let mut reply = [GONE; 9];
    match served {
        Some((fd, len)) => {
            reply[0] = FOUND;
            reply[1..].copy_from_slice(&len.to_le_bytes());
            send_with_fd(&stream, &reply, fd.as_raw_fd())
        }
        None => stream.write_all(&reply),
    }
}

fn same_user(stream: &UnixStream) -> bool {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    // SAFETY: geteuid has no failure mode.
    rc == 0 && cred.uid == unsafe { libc::geteuid() }
}

/// Removes sockets no process listens on any more (a process killed leaves its socket).
pub fn remove_stale_sockets(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "sock") && !listening(&path) {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Whether process `owner` still listens in `dir`.
pub fn serves(dir: &Path, owner: u64) -> bool {
    listening(&socket_path(dir, owner))
}

fn listening(path: &Path) -> bool {
    !matches!(
        UnixStream::connect(path),
        Err(err) if matches!(
            err.kind(),
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
        )
    )
}

/// What asking a process for an export gave.
#[derive(Debug)]
pub enum Fetched {
    /// The descriptor and the length it serves.
    Memory(OwnedFd, u64),
    /// The process is gone (no socket, or no one listening).
    ProcessGone,
    /// The process lives but no longer serves that number.
    ExportGone,
}

/// Asks process `owner` for its export `export`.
pub fn fetch(dir: &Path, owner: u64, export: u64) -> Result<Fetched> {
    let path = socket_path(dir, owner);
    let mut stream = match UnixStream::connect(&path) {
        Ok(stream) => stream,
        Err(err)
            if matches!(
                err.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Ok(Fetched::ProcessGone)
        }
        Err(err) => {
            return Err(Error::driver(format!(
                "dedup socket {}: {err}",
                path.display()
            )))
        }
    };
    let io = |e: std::io::Error| Error::driver(format!("dedup socket {}: {e}", path.display()));
    if !same_user(&stream) {
        return Err(Error::new(
            ErrorKind::InvalidState,
            format!("dedup socket {} belongs to another user", path.display()),
        ));
    }
    stream
        .set_read_timeout(Some(EXCHANGE_TIMEOUT))
        .map_err(io)?;
    stream
        .set_write_timeout(Some(EXCHANGE_TIMEOUT))
        .map_err(io)?;
    stream.write_all(&export.to_le_bytes()).map_err(io)?;
    let (reply, fd) = receive_with_fd(&stream).map_err(io)?;
    match (reply[0], fd) {
        (FOUND, Some(fd)) => {
            let mut len = [0u8; 8];
            len.copy_from_slice(&reply[1..]);
            Ok(Fetched::Memory(fd, u64::from_le_bytes(len)))
        }
        (GONE, _) => Ok(Fetched::ExportGone),
        _ => Err(Error::new(
            ErrorKind::InvalidState,
            format!("dedup socket {}: a malformed reply", path.display()),
        )),
    }
}

/// Room for the control message of `fds` descriptors.
fn control_len(fds: usize) -> usize {
    // SAFETY: CMSG_SPACE is a pure computation.
    unsafe { libc::CMSG_SPACE((fds * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// A control-message buffer aligned for `cmsghdr` (a byte vector would not be), with room for
/// a few descriptors: a peer that sends more than one gets the extra ones closed.
#[repr(C)]
struct Control {
    _align: [libc::cmsghdr; 0],
    bytes: [u8; 64],
}

fn send_with_fd(stream: &UnixStream, bytes: &[u8; 9], fd: RawFd) -> std::io::Result<()> {
    let mut control = Control {
        _align: [],
        bytes: [0; 64],
    };
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the fields set below point at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.bytes.as_mut_ptr().cast();
    msg.msg_controllen = control_len(1) as _;
    // SAFETY: the aligned control buffer has room for one header and one descriptor.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
    }
    // SAFETY: `msg` and everything it points to live across the call.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if sent as usize != bytes.len() {
        return Err(std::io::Error::other("short send"));
    }
    Ok(())
}

fn receive_with_fd(stream: &UnixStream) -> std::io::Result<([u8; 9], Option<OwnedFd>)> {
    let mut bytes = [0u8; 9];
    let mut control = Control {
        _align: [],
        bytes: [0; 64],
    };
    let mut iov = libc::iovec {
        iov_base: bytes.as_mut_ptr().cast(),
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the fields set below point at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.bytes.as_mut_ptr().cast();
    msg.msg_controllen = control.bytes.len() as _;
    // SAFETY: `msg` and its buffers live across the call; descriptors arrive close-on-exec.
    let got = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Every descriptor received is owned here (the first is the answer; more are closed).
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `control`, each checked to
    // hold as many descriptors as its length says.
    unsafe {
        let header = libc::CMSG_LEN(0) as usize;
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*cmsg).cmsg_len as usize).saturating_sub(header)
                    / std::mem::size_of::<RawFd>();
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::other(
            "the reply's descriptors were cut short",
        ));
    }
    if (got as usize) < bytes.len() {
        return Err(std::io::Error::other("short reply"));
    }
    let fd = if fds.is_empty() {
        None
    } else {
        Some(fds.swap_remove(0))
    };
    Ok((bytes, fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_travels_and_gone_ones_say_so() {
        let dir = std::env::temp_dir().join(format!("glake-channel-{}", std::process::id()));
        let dir = super::super::index::directory(Some(&dir)).unwrap();
        let file = tempfile_with(b"shared bytes");
        let export = serve(&dir, file, 12).unwrap();
        let me = process_token();
        match fetch(&dir, me, export).unwrap() {
            Fetched::Memory(fd, len) => {
                assert_eq!(len, 12);
                let mut text = String::new();
                let mut file = std::fs::File::from(fd);
                std::io::Seek::rewind(&mut file).unwrap();
                file.read_to_string(&mut text).unwrap();
                assert_eq!(text, "shared bytes");
            }
            other => panic!("{other:?}"),
        }
        unserve(export);
        assert!(matches!(
            fetch(&dir, me, export).unwrap(),
            Fetched::ExportGone
        ));
        assert!(matches!(
            fetch(&dir, me ^ 1, 1).unwrap(),
            Fetched::ProcessGone
        ));
    }

    fn tempfile_with(bytes: &[u8]) -> OwnedFd {
        let path = std::env::temp_dir().join(format!("glake-channel-file-{}", std::process::id()));
        let mut file = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.write_all(bytes).unwrap();
        std::fs::remove_file(&path).unwrap();
        file.into()
    }
}
