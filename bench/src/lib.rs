//! `bench`: the simulated backend (`hivenet-sim`) and, later, the load
//! generator (`hivenet-bench`).
#![forbid(unsafe_code)]

pub mod sim;
