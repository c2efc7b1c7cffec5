//! Frames with descriptors over a Unix stream socket (SCM_RIGHTS): how a
//! running router gives its listening sockets, its client connections and
//! its held requests to the process that replaces it (issue 54).
//!
//! A frame is `[u32 header length][u32 payload length][header][payload]`,
//! its descriptors attached to its first byte. The reader asks for the 8
//! length bytes with `recvmsg` (the descriptors come with them) and reads
//! the rest with plain reads, which never reach the next frame's first
//! byte: a descriptor is never dropped by a read that did not expect it.
//!
//! The one `unsafe` here: a received descriptor number is wrapped in an
//! `OwnedFd` (the kernel just installed it in this process for us; nothing
//! else owns it).

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{self, ControlMessage, ControlMessageOwned, MsgFlags};

/// Most descriptors in one frame (the kernel's SCM_MAX_FD is 253).
pub const MAX_FDS: usize = 16;
/// Largest header (a JSON object of the upgrade protocol; a carried
/// stream's transcript is in it: the relay keeps at most 4 MiB of a
/// stream, whose text escaped as JSON stays under this).
pub const MAX_HEADER: usize = 16 << 20;
/// Largest payload (a carried request: the router's own body limit is
/// checked again when the request is parsed).
pub const MAX_PAYLOAD: usize = 64 << 20;

/// One received frame.
#[derive(Debug)]
pub struct Frame {
    /// The header bytes.
    pub header: Vec<u8>,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// The descriptors that came with it.
    pub fds: Vec<OwnedFd>,
}

/// Send one frame with `fds` attached (all of it, blocking).
pub fn send(
    sock: &UnixStream,
    header: &[u8],
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    if fds.len() > MAX_FDS || header.len() > MAX_HEADER || payload.len() > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "frame over its bounds",
        ));
    }
    let mut lens = [0u8; 8];
    lens[..4].copy_from_slice(&(header.len() as u32).to_be_bytes());
    lens[4..].copy_from_slice(&(payload.len() as u32).to_be_bytes());
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
    let iov = [
        IoSlice::new(&lens),
        IoSlice::new(header),
        IoSlice::new(payload),
    ];
    let total = lens.len() + header.len() + payload.len();
    let sent = loop {
        match socket::sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) => break n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(io::Error::from(e)),
        }
    };
    if sent < total {
        // The descriptors went with the first byte; the rest follows.
        let mut rest = Vec::with_capacity(total - sent);
        rest.extend_from_slice(&lens);
        rest.extend_from_slice(header);
        rest.extend_from_slice(payload);
        let mut w = sock;
        w.write_all(rest.get(sent..).unwrap_or_default())?;
    }
    Ok(())
}

/// Receive one frame; `Ok(None)` at a clean end of stream.
pub fn recv(sock: &UnixStream) -> io::Result<Option<Frame>> {
    let mut lens = [0u8; 8];
    let mut got = 0usize;
    let mut fds = Vec::new();
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
    while got < lens.len() {
        let n = {
            let mut iov = [IoSliceMut::new(lens.get_mut(got..).unwrap_or_default())];
            let msg = match socket::recvmsg::<()>(
                sock.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(m) => m,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(io::Error::from(e)),
            };
            for c in msg.cmsgs() {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    fds.extend(raw.into_iter().map(owned));
                }
            }
            msg.bytes
        };
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    let mut h = [0u8; 4];
    h.copy_from_slice(&lens[..4]);
    let header_len = u32::from_be_bytes(h) as usize;
    h.copy_from_slice(&lens[4..]);
    let payload_len = u32::from_be_bytes(h) as usize;
    if header_len > MAX_HEADER || payload_len > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "frame over its bounds",
        ));
    }
    let mut r = sock;
    let mut header = vec![0u8; header_len];
    r.read_exact(&mut header)?;
    let mut payload = vec![0u8; payload_len];
    r.read_exact(&mut payload)?;
    Ok(Some(Frame {
        header,
        payload,
        fds,
    }))
}

/// Own a descriptor the kernel installed in this process.
#[allow(unsafe_code)]
fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: SCM_RIGHTS just created `fd` in this process's table for
    // this receiver; nothing else refers to it (see module docs).
    unsafe { OwnedFd::from_raw_fd(fd) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn frames_carry_descriptors_and_bytes() {
        let (a, b) = UnixStream::pair().expect("pair");
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        send(&a, b"{\"k\":1}", &[7u8; 100_000], &[l.as_fd()]).expect("send");
        send(&a, b"second", b"", &[]).expect("send");
        drop(l);
        let f = recv(&b).expect("recv").expect("frame");
        assert_eq!(f.header, b"{\"k\":1}");
        assert_eq!(f.payload.len(), 100_000);
        assert_eq!(f.fds.len(), 1);
        // The listener lives on in the received descriptor.
        let l2 = std::net::TcpListener::from(f.fds.into_iter().next().expect("fd"));
        assert_eq!(l2.local_addr().expect("addr"), addr);
        let _c = std::net::TcpStream::connect(addr).expect("connect");
        assert!(l2.accept().is_ok());
        let g = recv(&b).expect("recv").expect("frame");
        assert_eq!(g.header, b"second");
        assert!(g.fds.is_empty());
        drop(a);
        assert!(recv(&b).expect("eof").is_none());
    }

    #[test]
    fn oversized_lengths_are_refused() {
        let (a, b) = UnixStream::pair().expect("pair");
        let mut w = &a;
        w.write_all(&u32::MAX.to_be_bytes()).expect("w");
        w.write_all(&0u32.to_be_bytes()).expect("w");
        assert!(recv(&b).is_err());
    }
}
