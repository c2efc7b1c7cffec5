//! Moving a socket from one shard's runtime to another's.
//!
//! monoio has no safe conversion from its `TcpStream` back to a
//! `std::net::TcpStream`, and the architecture hands each connection to
//! the core that owns its model exactly once. This is the crate's only
//! `unsafe` (descriptor ownership and borrowing): `into_raw_fd` gives up ownership of the descriptor (monoio
//! deregisters it from its poller first), so wrapping it in a new owner is
//! the ownership transfer `FromRawFd` documents; nothing else holds it.

use std::os::fd::{FromRawFd, IntoRawFd};

/// Take a socket out of the current runtime.
#[allow(unsafe_code)]
pub fn into_std(stream: monoio::net::TcpStream) -> std::net::TcpStream {
    let fd = stream.into_raw_fd();
    // SAFETY: `fd` was just released by its only owner (see module docs).
    unsafe { std::net::TcpStream::from_raw_fd(fd) }
}

/// Take out a socket that was watched for readiness (a held request):
/// a cancelled io_uring poll may still hold the runtime's descriptor
/// until its completion arrives, so `into_raw_fd` would find a second
/// reference. The socket is duplicated instead (one `dup`, only on this
/// path); the runtime closes its copy when the poll completes.
/// The caller drops its `stream` afterwards.
#[allow(unsafe_code)]
pub fn dup_watched(stream: &monoio::net::TcpStream) -> std::io::Result<std::net::TcpStream> {
    use std::os::fd::{AsRawFd, BorrowedFd};
    // SAFETY: the descriptor is open for the whole borrow (`stream` lives).
    let owned = unsafe { BorrowedFd::borrow_raw(stream.as_raw_fd()) }.try_clone_to_owned()?;
    Ok(std::net::TcpStream::from(owned))
}

/// Write what the socket takes now, without blocking and without the
/// runtime (one `send` with `MSG_DONTWAIT`): a held request's keepalive
/// goes out while its readiness watch stays armed (`Conn::unless_gone`).
#[allow(unsafe_code)]
pub fn send_now(stream: &monoio::net::TcpStream, bytes: &[u8]) -> std::io::Result<usize> {
    use std::os::fd::{AsRawFd, BorrowedFd};
    if bytes.is_empty() {
        return Ok(0);
    }
    // SAFETY: the descriptor is open for the whole borrow (`stream` lives).
    let fd = unsafe { BorrowedFd::borrow_raw(stream.as_raw_fd()) };
    socket2::SockRef::from(&fd).send_with_flags(bytes, libc::MSG_DONTWAIT)
}

/// Whether an idle socket's peer has closed it (or sent bytes nobody
/// asked for): one `recv` with `MSG_PEEK | MSG_DONTWAIT`. A keep-alive
/// client checks this before it reuses a connection, as HTTP clients do:
/// some servers (llama.cpp's) close after a streamed response although
/// they announce keep-alive.
#[allow(unsafe_code)]
pub fn peer_gone(stream: &monoio::net::TcpStream) -> bool {
    use std::os::fd::{AsRawFd, BorrowedFd};
    // SAFETY: the descriptor is open for the whole borrow (`stream` lives).
    let fd = unsafe { BorrowedFd::borrow_raw(stream.as_raw_fd()) };
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    match socket2::SockRef::from(&fd)
        .recv_with_flags(&mut byte, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    {
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        Ok(_) => true,
    }
}

/// Shut both directions of a socket that is still open but owned
/// elsewhere (a link socket whose read is in flight in the runtime): the
/// peer sees the end at once and the pending read completes.
#[allow(unsafe_code)]
pub fn shut_down(fd: std::os::fd::RawFd) {
    use std::os::fd::BorrowedFd;
    // SAFETY: the caller guarantees `fd` is open for this call (see
    // `LinkSocket`'s `Drop`: a half of the stream still owns it).
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let _ = socket2::SockRef::from(&fd).shutdown(std::net::Shutdown::Both);
}

/// Adopt a socket into the current runtime.
pub fn adopt(stream: std::net::TcpStream) -> std::io::Result<monoio::net::TcpStream> {
    stream.set_nonblocking(true)?;
    let s = monoio::net::TcpStream::from_std(stream)?;
    let _ = s.set_nodelay(true);
    Ok(s)
}
