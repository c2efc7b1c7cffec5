//! Moving a socket from one shard's runtime to another's.
//!
//! monoio has no safe conversion from its `TcpStream` back to a
//! `std::net::TcpStream`, and the architecture hands each connection to
//! the core that owns its model exactly once. This is the crate's only
//! `unsafe`: `into_raw_fd` gives up ownership of the descriptor (monoio
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

/// Adopt a socket into the current runtime.
pub fn adopt(stream: std::net::TcpStream) -> std::io::Result<monoio::net::TcpStream> {
    stream.set_nonblocking(true)?;
    let s = monoio::net::TcpStream::from_std(stream)?;
    let _ = s.set_nodelay(true);
    Ok(s)
}
