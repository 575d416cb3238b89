//! probe
pub mod pb;
