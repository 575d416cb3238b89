//! The cluster summary: what a datacenter's local router publishes to the global router, and
//! its versioned byte form.
//!
//! Byte layout, version 2 (all integers little-endian; see docs/global-routing.md):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `KVRS` |
//! | 4 | 2 | format version (2) |
//! | 6 | 2 | flags (0; decoders refuse unknown flags) |
//! | 8 | 8 | `built_at` µs (the publisher's clock) |
//! | 16 | 8 | `sequence` (increases per publication) |
//! | 24 | 4 | block size, tokens |
//! | 28 | 4 | checkpoint interval, blocks |
//! | 32 | 8 | sketch seed |
//! | 40 | 1 | probes |
//! | 41 | 1 | log2 of filter blocks |
//! | 42 | 2 | name length N (≤ 255) |
//! | 44 | 8 | keys inserted |
//! | 52 | 88 | load: 8 × u64 then 3 × f64 (see [`ClusterLoad`], field order) |
//! | 140 | N | cluster name, UTF-8 |
//! | 140+N | 64 · 2^log2 | filter words |
//! | end-8 | 8 | XXH3-64 of every byte before it |

use super::sketch::{PrefixSketch, WORDS_PER_BLOCK};
use crate::ids::SequenceHash;
use crate::time::Time;
use serde::{Deserialize, Serialize};

/// The format version this build writes and reads.
pub const SUMMARY_FORMAT_VERSION: u16 = 2;
const MAGIC: &[u8; 4] = b"KVRS";
const HEADER_BYTES: usize = 140;
const MAX_NAME_BYTES: usize = 255;
/// The slowest decode a summary may state, ms a token (and per extra request): a minute. A
/// larger figure is no engine's, and would overflow the estimates it enters.
pub const MAX_STATED_DECODE_MS: f64 = 60_000.0;
/// The fastest prefill a summary may state, tokens a second.
pub const MAX_STATED_PREFILL_TOKENS_PER_S: f64 = 1e12;
/// The largest encoded summary a decoder takes: the header, the longest name, the largest
/// sketch ([`super::sketch`]: 2^20 blocks of `WORDS_PER_BLOCK` words) and the checksum. A reader
/// of summaries over the network stops reading past it.
pub const MAX_SUMMARY_BYTES: usize =
    HEADER_BYTES + MAX_NAME_BYTES + (1 << super::sketch::MAX_LOG2_BLOCKS) * WORDS_PER_BLOCK * 8 + 8;

/// A cluster's load as the global router weighs it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterLoad {
    /// Workers (ranks) that can take requests.
    pub workers: u64,
    /// Requests placed on workers and not finished.
    pub active_requests: u64,
    /// Uncached prompt tokens of placed requests not yet past their first token.
    pub active_prefill_tokens: u64,
    /// KV blocks held by active requests.
    pub active_decode_blocks: u64,
    /// Requests waiting in the local router's queue.
    pub queue_depth: u64,
    /// Prompt tokens of the queued requests.
    pub queued_prefill_tokens: u64,
    /// KV blocks free for new requests over all workers.
    pub free_kv_blocks: u64,
    /// Concurrent requests the cluster runs before queueing (sum of batch slots; 0 = unknown).
    pub max_running_requests: u64,
    /// Prefill speed of one worker, tokens per second (the host measures or configures it).
    pub prefill_tokens_per_s: f64,
    /// Inter-token latency now, ms (how fast a request placed now would decode).
    pub decode_ms_per_token: f64,
    /// How much the inter-token latency grows per extra running request on one worker, ms (the
    /// batch's effect, from the workers' speed profile; 0 = not stated).
    pub decode_ms_per_token_per_seq: f64,
}

/// What a local router publishes: its cache sketch and load, stamped.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterSummary {
    /// The cluster's name.
    pub name: String,
    /// When it was built, on the publisher's clock.
    pub built_at: Time,
    /// Publication counter; a receiver ignores one not newer than what it has.
    pub sequence: u64,
    /// Tokens per block (the global router hashes prompts with the same block size).
    pub block_size: u32,
    /// The prefix sketch.
    pub sketch: PrefixSketch,
    /// The load.
    pub load: ClusterLoad,
}

/// Why bytes are not a summary.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SummaryError {
    /// Fewer bytes than the layout needs.
    #[error("summary truncated: {0} bytes")]
    Truncated(usize),
    /// Not a summary.
    #[error("not a kvrouter cluster summary (bad magic)")]
    BadMagic,
    /// A format this build does not read.
    #[error(
        "summary format version {0} is not supported (this build reads {SUMMARY_FORMAT_VERSION})"
    )]
    UnsupportedVersion(u16),
    /// The checksum does not match (corrupt in transit or storage).
    #[error("summary checksum mismatch")]
    BadChecksum,
    /// A field is out of range.
    #[error("invalid summary: {0}")]
    Invalid(&'static str),
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        // Callers check the total length first; slicing cannot fail.
        let mut out = [0u8; N];
        out.copy_from_slice(&self.bytes[self.at..self.at + N]);
        self.at += N;
        out
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
    fn f64(&mut self) -> f64 {
        f64::from_le_bytes(self.take())
    }
}

impl ClusterSummary {
    /// The cached prefix of a prompt here, in blocks (from the sketch).
    pub fn cached_prefix_blocks(&self, blocks: &[SequenceHash]) -> usize {
        self.sketch.cached_prefix_blocks(blocks)
    }

    /// The encoded size in bytes.
    pub fn encoded_len(&self) -> usize {
        HEADER_BYTES + self.name.len().min(MAX_NAME_BYTES) + self.sketch.filter_bytes() + 8
    }

    /// The version-1 byte form (see the module documentation). Names longer than 255 bytes are
    /// cut at a character boundary.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut name = self.name.as_str();
        while name.len() > MAX_NAME_BYTES {
            let mut cut = MAX_NAME_BYTES;
            while !name.is_char_boundary(cut) {
                cut -= 1;
            }
            name = &name[..cut];
        }
        let mut out = Vec::with_capacity(self.encoded_len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&SUMMARY_FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.built_at.as_micros().to_le_bytes());
        out.extend_from_slice(&self.sequence.to_le_bytes());
        out.extend_from_slice(&self.block_size.to_le_bytes());
        out.extend_from_slice(&self.sketch.checkpoint_interval_blocks().to_le_bytes());
        out.extend_from_slice(&self.sketch.seed().to_le_bytes());
        out.push(self.sketch.probes());
        out.push(self.sketch.log2_blocks() as u8);
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.sketch.keys().to_le_bytes());
        let l = &self.load;
        for v in [
            l.workers,
            l.active_requests,
            l.active_prefill_tokens,
            l.active_decode_blocks,
            l.queue_depth,
            l.queued_prefill_tokens,
            l.free_kv_blocks,
            l.max_running_requests,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&l.prefill_tokens_per_s.to_le_bytes());
        out.extend_from_slice(&l.decode_ms_per_token.to_le_bytes());
        out.extend_from_slice(&l.decode_ms_per_token_per_seq.to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        for w in self.sketch.words() {
            out.extend_from_slice(&w.to_le_bytes());
        }
        let sum = xxhash_rust::xxh3::xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// Decodes the byte form. Any malformed input is an error, never a panic.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SummaryError> {
        if bytes.len() < HEADER_BYTES + 8 {
            return Err(SummaryError::Truncated(bytes.len()));
        }
        if &bytes[..4] != MAGIC {
            return Err(SummaryError::BadMagic);
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != SUMMARY_FORMAT_VERSION {
            return Err(SummaryError::UnsupportedVersion(version));
        }
        let (body, sum) = bytes.split_at(bytes.len() - 8);
        let mut sum_bytes = [0u8; 8];
        sum_bytes.copy_from_slice(sum);
        if xxhash_rust::xxh3::xxh3_64(body) != u64::from_le_bytes(sum_bytes) {
            return Err(SummaryError::BadChecksum);
        }
        if u16::from_le_bytes([bytes[6], bytes[7]]) != 0 {
            return Err(SummaryError::Invalid("unknown flags"));
        }
        let mut r = Reader { bytes: body, at: 8 };
        let built_at = Time::from_micros(r.u64());
        let sequence = r.u64();
        let block_size = u32::from_le_bytes(r.take());
        let interval = u32::from_le_bytes(r.take());
        let seed = r.u64();
        let [probes, log2_blocks] = r.take();
        let name_len = u16::from_le_bytes(r.take()) as usize;
        let keys = r.u64();
        let mut load = ClusterLoad::default();
        for slot in [
            &mut load.workers,
            &mut load.active_requests,
            &mut load.active_prefill_tokens,
            &mut load.active_decode_blocks,
            &mut load.queue_depth,
            &mut load.queued_prefill_tokens,
            &mut load.free_kv_blocks,
            &mut load.max_running_requests,
        ] {
            *slot = r.u64();
        }
        load.prefill_tokens_per_s = r.f64();
        load.decode_ms_per_token = r.f64();
        load.decode_ms_per_token_per_seq = r.f64();
        if block_size == 0 {
            return Err(SummaryError::Invalid("block size is 0"));
        }
        let speed_ok = |v: f64, max: f64| v.is_finite() && (0.0..=max).contains(&v);
        if !(speed_ok(load.prefill_tokens_per_s, MAX_STATED_PREFILL_TOKENS_PER_S)
            && speed_ok(load.decode_ms_per_token, MAX_STATED_DECODE_MS)
            && speed_ok(load.decode_ms_per_token_per_seq, MAX_STATED_DECODE_MS))
        {
            return Err(SummaryError::Invalid(
                "speeds must be non-negative and within bounds (decode ≤ 60,000 ms a token, \
                 prefill ≤ 10^12 tokens/s)",
            ));
        }
        if u32::from(log2_blocks) > super::sketch::MAX_LOG2_BLOCKS {
            return Err(SummaryError::Invalid("filter too large"));
        }
        let filter_words = (1usize << log2_blocks) * WORDS_PER_BLOCK;
        if body.len() != HEADER_BYTES + name_len + filter_words * 8 {
            return Err(SummaryError::Invalid(
                "length does not match name and filter sizes",
            ));
        }
        let name = std::str::from_utf8(&body[HEADER_BYTES..HEADER_BYTES + name_len])
            .map_err(|_| SummaryError::Invalid("name is not UTF-8"))?
            .to_owned();
        r.at = HEADER_BYTES + name_len;
        let words = (0..filter_words).map(|_| r.u64()).collect();
        let sketch =
            PrefixSketch::from_parts(interval, seed, probes, u32::from(log2_blocks), keys, words)
                .map_err(SummaryError::Invalid)?;
        Ok(Self {
            name,
            built_at,
            sequence,
            block_size,
            sketch,
            load,
        })
    }
}
