//! `kvrouter weights`: delta weight sync (crate `kvrouter-weights`, docs/weights.md). Each
//! subcommand prints one JSON report line on stdout (`serve` prints its address instead).

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use kvrouter_weights::bench::BenchOptions;
use kvrouter_weights::gen::{write_checkpoint, GenSpec, Update};
use kvrouter_weights::store::{self, Store};
use kvrouter_weights::transfer;
use kvrouter_weights::{checkpoint, CodecOptions};
use std::path::PathBuf;

/// Most MiB `weights gen` and `weights bench` write (1 TiB).
const MAX_MIB: u64 = 1 << 20;

/// The chunk sizes a delta may use, KiB (`--chunk-kib`, `weights bench --chunks-kib`).
const CHUNK_KIB: std::ops::RangeInclusive<u64> = 4..=256 << 10;

/// `kvrouter weights …`.
#[derive(Debug, Args)]
pub(crate) struct WeightsArgs {
    #[command(subcommand)]
    command: WeightsCommand,
}

#[derive(Debug, Subcommand)]
enum WeightsCommand {
    /// Write the XOR+zstd delta from --base to --new.
    Diff(DiffArgs),
    /// Rebuild the new checkpoint from --base and --delta into --out (verified, atomic).
    Apply(ApplyArgs),
    /// Hash a checkpoint directory and write its version marker (weights.json).
    Stamp(StampArgs),
    /// Check a checkpoint directory against its marker, or a delta file against its digests.
    Verify(VerifyArgs),
    /// Upload a version to object storage (a delta against --prev; a full checkpoint every --full-every).
    Publish(PublishArgs),
    /// Download a version from object storage (or a peer), walking the delta chain.
    Pull(PullArgs),
    /// Serve the versions in --dir to in-region peers (pulling what is missing from --store once).
    Serve(ServeArgs),
    /// Write a generated BF16 test checkpoint (the RL-step or adversarial update model).
    Gen(GenArgs),
    /// Measure diff/apply throughput, memory and delta ratios on generated checkpoints.
    Bench(BenchArgs),
}

/// The codec's flags, for the commands that write deltas (`diff`, `publish`, `bench`).
#[derive(Debug, Clone, Args)]
struct CodecArgs {
    /// zstd level (chosen by `kvrouter weights bench`, docs/weights.md).
    #[arg(long, default_value_t = kvrouter_weights::DEFAULT_ZSTD_LEVEL)]
    zstd_level: i32,
    /// Chunk size in KiB: one zstd frame each, and the unit of memory per thread (4 KiB..256 MiB).
    #[arg(long, default_value_t = (kvrouter_weights::DEFAULT_CHUNK_BYTES >> 10) as u64)]
    chunk_kib: u64,
    #[command(flatten)]
    threads: ThreadsArgs,
}

/// `--threads`, for the commands that only read or rebuild (a delta carries its own chunking
/// and level, so they take no codec flags).
#[derive(Debug, Clone, Args)]
struct ThreadsArgs {
    /// Worker threads (default: the machine's cores).
    #[arg(long)]
    threads: Option<usize>,
}

impl ThreadsArgs {
    fn get(&self) -> anyhow::Result<usize> {
        let threads = self
            .threads
            .unwrap_or_else(|| CodecOptions::default().threads);
        if threads == 0 {
            bail!("--threads must be at least 1");
        }
        Ok(threads)
    }
}

impl CodecArgs {
    fn options(&self) -> anyhow::Result<CodecOptions> {
        let threads = self.threads.get()?;
        if !CHUNK_KIB.contains(&self.chunk_kib) {
            bail!("--chunk-kib must be between 4 and 262144");
        }
        if !(-7..=22).contains(&self.zstd_level) {
            bail!("--zstd-level must be between -7 and 22");
        }
        Ok(CodecOptions {
            zstd_level: self.zstd_level,
            chunk_bytes: (self.chunk_kib << 10) as usize,
            threads,
        })
    }
}

#[derive(Debug, Clone, Args)]
struct StoreArgs {
    /// Object store URL: file:///abs/dir or s3://bucket/prefix.
    #[arg(long)]
    store: Option<String>,
    /// Backend option KEY=VALUE, repeatable (e.g. aws_endpoint=http://127.0.0.1:5000, aws_region=us-east-1, aws_allow_http=true).
    #[arg(long = "store-option", value_name = "KEY=VALUE")]
    store_options: Vec<String>,
}

impl StoreArgs {
    fn open(&self) -> anyhow::Result<Option<Store>> {
        let Some(url) = &self.store else {
            return Ok(None);
        };
        let mut opts = Vec::new();
        for o in &self.store_options {
            let (k, v) = o
                .split_once('=')
                .with_context(|| format!("--store-option `{o}` is not KEY=VALUE"))?;
            opts.push((k.to_string(), v.to_string()));
        }
        Ok(Some(Store::open(url, &opts)?))
    }

    fn require(&self) -> anyhow::Result<Store> {
        self.open()?.context("--store is required")
    }
}

#[derive(Debug, Args)]
struct DiffArgs {
    /// The base checkpoint directory.
    #[arg(long)]
    base: PathBuf,
    /// Its version (needed when it has no weights.json).
    #[arg(long)]
    base_version: Option<u64>,
    /// The new checkpoint directory.
    #[arg(long)]
    new: PathBuf,
    /// Its version.
    #[arg(long)]
    new_version: u64,
    /// The delta file to write.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    codec: CodecArgs,
}

#[derive(Debug, Args)]
struct ApplyArgs {
    /// The base checkpoint directory.
    #[arg(long)]
    base: PathBuf,
    /// The delta file.
    #[arg(long)]
    delta: PathBuf,
    /// The directory to create.
    #[arg(long)]
    out: PathBuf,
    /// An older version directory (same file system) whose files are overwritten instead of
    /// allocating new ones; consumed once the rebuild starts (after the whole delta and the base
    /// are checked): a refused apply leaves it as it was.
    #[arg(long)]
    recycle: Option<PathBuf>,
    #[command(flatten)]
    threads: ThreadsArgs,
}

#[derive(Debug, Args)]
struct StampArgs {
    /// The checkpoint directory.
    #[arg(long)]
    dir: PathBuf,
    /// Its version.
    #[arg(long)]
    version: u64,
    #[command(flatten)]
    threads: ThreadsArgs,
}

#[derive(Debug, Args)]
struct VerifyArgs {
    /// A checkpoint directory (checked against its weights.json).
    #[arg(long, conflicts_with = "delta")]
    dir: Option<PathBuf>,
    /// A delta file.
    #[arg(long)]
    delta: Option<PathBuf>,
    #[command(flatten)]
    threads: ThreadsArgs,
}

#[derive(Debug, Args)]
struct PublishArgs {
    /// The checkpoint directory of this version.
    #[arg(long)]
    dir: PathBuf,
    /// Its version.
    #[arg(long)]
    version: u64,
    /// The local checkpoint of version − 1 (omit for the first version: a full upload).
    #[arg(long)]
    prev: Option<PathBuf>,
    /// Upload a full checkpoint every this many versions (bounds the chain a pull walks).
    #[arg(long, default_value_t = 10)]
    full_every: u64,
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    codec: CodecArgs,
}

#[derive(Debug, Args)]
struct PullArgs {
    /// The version (default: the store's latest).
    #[arg(long)]
    version: Option<u64>,
    /// The directory to create.
    #[arg(long)]
    out: PathBuf,
    /// A local checkpoint (with weights.json) to move forward by deltas instead of a full download.
    #[arg(long)]
    have: Option<PathBuf>,
    /// Downloads and intermediate versions (default OUT.work; kept after a failed transfer, so
    /// a rerun resumes; removed after a success, and after a refusal of the arguments (--have
    /// not the chain's base, a refused --recycle) if this pull created it). Must be new, empty
    /// or an earlier pull's, and may not hold --out, --have, --recycle or the store.
    #[arg(long)]
    work: Option<PathBuf>,
    /// Fetch from this in-region peer (`kvrouter weights serve`) instead of the store.
    #[arg(long)]
    peer: Option<String>,
    /// With --peer: fail when a file transfer sends nothing for this many seconds (a stalled
    /// peer).
    #[arg(long, default_value_t = 30.0)]
    peer_read_timeout_secs: f64,
    /// With --peer: how long the peer may take to answer for the version's marker (a peer
    /// without the version first fetches it from its store).
    #[arg(long, default_value_t = 1800.0)]
    peer_marker_timeout_secs: f64,
    /// An older checkpoint directory (with weights.json, same file system, neither holding
    /// --have, --out nor --work) whose files the first delta overwrites instead of allocating
    /// new ones (later deltas reuse the versions they supersede); consumed once the first apply
    /// starts (after the whole delta is checked), left alone otherwise.
    #[arg(long)]
    recycle: Option<PathBuf>,
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    threads: ThreadsArgs,
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// Cache directory: versions live in DIR/vN.
    #[arg(long)]
    dir: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8300")]
    listen: String,
    /// Versions kept in --dir (at least 1): pulling one more writes it into the files of the
    /// newest version it drops (never the base it is applied to) and deletes older ones.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    keep_versions: u64,
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    threads: ThreadsArgs,
}

#[derive(Debug, Args)]
struct GenArgs {
    /// The directory to write.
    #[arg(long)]
    out: PathBuf,
    /// Tensor bytes in total (MiB).
    #[arg(long, default_value_t = 64)]
    size_mib: u64,
    /// RL steps taken from the initial weights (0: the initial weights).
    #[arg(long, default_value_t = 0)]
    steps: u32,
    /// Learning rate of the RL-step model.
    #[arg(long, default_value_t = 1e-6)]
    lr: f32,
    /// Write the adversarial case (every byte differs from step 0) instead.
    #[arg(long)]
    adversarial: bool,
    /// Seed of every value.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Shards.
    #[arg(long, default_value_t = 2)]
    files: usize,
    #[command(flatten)]
    threads: ThreadsArgs,
}

#[derive(Debug, Args)]
struct BenchArgs {
    /// Scratch directory (created and deleted; an existing one must be empty).
    #[arg(long, default_value = "target/weights-bench")]
    scratch: PathBuf,
    /// Checkpoint size for throughput and memory (MiB).
    #[arg(long, default_value_t = 1024)]
    size_mib: u64,
    /// Checkpoint size for the ratio sweeps (MiB).
    #[arg(long, default_value_t = 256)]
    sweep_mib: u64,
    /// Learning rate of the main run.
    #[arg(long, default_value_t = 1e-6)]
    lr: f32,
    /// Learning rates of the sweep.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1e-7,1e-6,3e-6,1e-5,1e-4"
    )]
    lrs: Vec<f32>,
    /// zstd levels of the sweep.
    #[arg(long, value_delimiter = ',', default_value = "-1,1,3,6")]
    levels: Vec<i32>,
    /// Chunk sizes of the sweep (KiB).
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,16384")]
    chunks_kib: Vec<usize>,
    #[command(flatten)]
    codec: CodecArgs,
}

mod run;
pub(crate) use run::run;
