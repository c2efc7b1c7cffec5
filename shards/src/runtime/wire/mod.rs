//! Bytes and time: [`conn`] (one buffered read-and-parse loop over TCP and
//! yamux), [`link`] (with its socket, futures-io adapter and memory
//! budget) + [`mux`] + [`http_stream`] (the libp2p stack), [`handoff`] (a socket between
//! cores), [`bufpool`] and [`budget`] (buffers and memory budgets),
//! [`executor`] (pinned runtimes), [`clock`] (the one place that reads
//! time), [`exposition`] (the Prometheus text format every family is
//! written in).

pub mod budget;
pub mod bufpool;
pub mod clock;
pub mod conn;
pub mod executor;
pub mod exposition;
pub mod fd_pass;
pub mod handoff;
pub mod http_stream;
pub mod link;
pub mod mux;
