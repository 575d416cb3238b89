//! `kvrouter weights bench`: generates checkpoints in a scratch directory (deleted after), then
//! measures diff and apply throughput (one thread, and all), peak memory of each, the delta size
//! against the learning rate, zstd level and chunk size, and the adversarial case against plain
//! zstd of the new checkpoint.

use crate::checkpoint;
use crate::diff::{diff, CodecOptions};
use crate::error::{Result, WeightsError};
use crate::gen::{write_checkpoint, GenSpec, Update};
use serde::Serialize;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Checkpoint size for the throughput and memory runs.
    pub checkpoint_bytes: u64,
    /// Checkpoint size for the ratio sweeps (ratios do not depend on size).
    pub sweep_bytes: u64,
    /// Threads for the "total" runs.
    pub threads: usize,
    /// The RL model's learning rate for the main run.
    pub lr: f32,
    /// Learning rates of the ratio sweep.
    pub lrs: Vec<f32>,
    /// zstd levels of the level sweep.
    pub levels: Vec<i32>,
    /// Chunk sizes of the chunk sweep.
    pub chunks: Vec<usize>,
    /// The codec for the main runs.
    pub codec: CodecOptions,
}

/// One timed run.
#[derive(Clone, Debug, Serialize)]
pub struct Run {
    /// What ran.
    pub what: String,
    /// Threads.
    pub threads: usize,
    /// Seconds.
    pub secs: f64,
    /// Checkpoint GB (1e9 bytes) per second, in total.
    pub gb_per_s: f64,
    /// Per thread.
    pub gb_per_s_per_core: f64,
    /// CPU seconds the process used (all threads), where the OS reports it.
    pub cpu_secs: Option<f64>,
    /// Checkpoint GB per CPU second: throughput per core on a machine whose cores are shared.
    pub gb_per_cpu_s: Option<f64>,
    /// Peak resident memory during the run (MiB), where the OS reports it.
    pub peak_rss_mib: Option<f64>,
}

/// A delta size.
#[derive(Clone, Debug, Serialize)]
pub struct Ratio {
    /// What was compared.
    pub what: String,
    /// Delta bytes / checkpoint bytes.
    pub ratio: f64,
    /// Fraction of BF16 values that changed (RL runs).
    pub changed_values: Option<f64>,
    /// Single-thread diff speed, GB per CPU second.
    pub diff_gb_per_s_per_core: Option<f64>,
}

/// Everything measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Checkpoint bytes of the throughput runs.
    pub checkpoint_bytes: u64,
    /// Throughput and memory.
    pub runs: Vec<Run>,
    /// Sizes.
    pub ratios: Vec<Ratio>,
}

/// Resets the peak-RSS counter (Linux `clear_refs`), ignoring failure.
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Peak RSS since the last reset, MiB (Linux `VmHWM`).
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// User + system CPU seconds of this process (Linux `/proc/self/stat`, 100 ticks a second).
fn cpu_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

fn timed(what: &str, threads: usize, bytes: u64, f: impl FnOnce() -> Result<()>) -> Result<Run> {
    reset_peak();
    let cpu0 = cpu_secs();
    let t = Instant::now();
    f()?;
    let secs = t.elapsed().as_secs_f64();
    let cpu = cpu0.zip(cpu_secs()).map(|(a, b)| b - a);
    let gb = bytes as f64 / 1e9 / secs;
    Ok(Run {
        what: what.into(),
        threads,
        secs,
        gb_per_s: gb,
        gb_per_s_per_core: gb / threads as f64,
        cpu_secs: cpu,
        gb_per_cpu_s: cpu.filter(|c| *c > 0.0).map(|c| bytes as f64 / 1e9 / c),
        peak_rss_mib: peak_rss_mib(),
    })
}
fn spec(bytes: u64) -> GenSpec {
    GenSpec {
        total_bytes: bytes,
        tensor_bytes: 64 << 20,
        cols: 4096,
        files: (bytes / (512 << 20)).max(1) as usize,
        seed: 20_260_101,
    }
}

fn file_len(p: &Path) -> Result<u64> {
    Ok(std::fs::metadata(p)
        .map_err(|e| WeightsError::io(p, e))?
        .len())
}

/// Fraction of differing 2-byte values between two checkpoints of the same layout.
fn changed_fraction(a: &Path, b: &Path) -> Result<f64> {
    let (mut diff, mut total) = (0u64, 0u64);
    for f in crate::layout::read_dir_layout(a)? {
        let (x, y) = (
            std::fs::read(a.join(&f.name)).map_err(|e| WeightsError::io(a, e))?,
            std::fs::read(b.join(&f.name)).map_err(|e| WeightsError::io(b, e))?,
        );
        for (p, q) in x.chunks_exact(2).zip(y.chunks_exact(2)) {
            total += 1;
            diff += u64::from(p != q);
        }
    }
    Ok(diff as f64 / total.max(1) as f64)
}

/// Plain zstd (level 3, the `zstd` CLI's default) of every file of `dir`, multithreaded: bytes out.
fn plain_zstd_bytes(dir: &Path, threads: usize) -> Result<u64> {
    struct Count(u64);
    impl Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len() as u64;
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut total = 0;
    for f in crate::layout::read_dir_layout(dir)? {
        let path = dir.join(&f.name);
        let mut enc =
            zstd::stream::Encoder::new(Count(0), 3).map_err(|e| WeightsError::io(&path, e))?;
        enc.multithread(threads as u32)
            .map_err(|e| WeightsError::io(&path, e))?;
        let mut file = std::fs::File::open(&path).map_err(|e| WeightsError::io(&path, e))?;
        std::io::copy(&mut file, &mut enc).map_err(|e| WeightsError::io(&path, e))?;
        total += enc.finish().map_err(|e| WeightsError::io(&path, e))?.0;
    }
    Ok(total)
}

/// Runs the benchmark in `scratch` (created, and removed afterwards whatever happens). An
/// existing `scratch` must be an empty directory: removing one with files in it would lose them.
pub fn run(
    scratch: &Path,
    o: &BenchOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<BenchReport> {
    crate::workdir::no_parent_steps("--scratch", scratch)?;
    crate::workdir::refuse_link("--scratch", scratch)?;
    match std::fs::read_dir(scratch) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(WeightsError::Invalid(format!(
                    "--scratch {}: the directory is not empty (the bench removes its scratch \
                     directory after it); give a new or empty one",
                    scratch.display()
                )));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(WeightsError::io(scratch, e)),
    }
    std::fs::create_dir_all(scratch).map_err(|e| WeightsError::io(scratch, e))?;
    let r = run_in(scratch, o, progress);
    let _ = std::fs::remove_dir_all(scratch);
    r
}

fn run_in(s: &Path, o: &BenchOptions, progress: &mut dyn FnMut(&str)) -> Result<BenchReport> {
    let n = o.checkpoint_bytes;
    let (base, new, adv) = (s.join("base"), s.join("new"), s.join("adv"));
    progress("generating the base, RL-step and adversarial checkpoints");
    write_checkpoint(
        &base,
        &spec(n),
        Update::Rl { lr: o.lr, steps: 0 },
        o.threads,
    )?;
    write_checkpoint(&new, &spec(n), Update::Rl { lr: o.lr, steps: 1 }, o.threads)?;
    checkpoint::write_marker(&base, &checkpoint::stamp(&base, 0, o.threads)?)?;
    let size = crate::layout::total_bytes(&crate::layout::read_dir_layout(&base)?);
    let mut runs = Vec::new();
    let mut ratios = Vec::new();
    let delta = s.join("d.kvwd");
    for threads in [1, o.threads] {
        let opts = CodecOptions {
            threads,
            ..o.codec.clone()
        };
        progress(&format!("diff, {threads} thread(s)"));
        let _ = std::fs::remove_file(&delta);
        runs.push(timed("diff (RL step)", threads, size, || {
            diff(&base, None, &new, 1, &delta, &opts).map(|_| ())
        })?);
        let out = s.join(format!("applied-{threads}"));
        progress(&format!("apply, {threads} thread(s)"));
        runs.push(timed("apply (RL step)", threads, size, || {
            crate::apply::apply(&base, &delta, &out, threads).map(|_| ())
        })?);
        if threads == 1 {
            // The same apply into the pages of the version just written (a worker that keeps
            // two versions): no fresh page-cache pages to allocate.
            let again = s.join("applied-recycled");
            progress("apply into a recycled directory, 1 thread");
            runs.push(timed("apply (RL step, recycled output)", 1, size, || {
                crate::apply::apply_recycling(&base, &delta, &again, 1, Some(&out)).map(|_| ())
            })?);
            std::fs::remove_dir_all(&again).map_err(|e| WeightsError::io(&again, e))?;
        } else {
            std::fs::remove_dir_all(&out).map_err(|e| WeightsError::io(&out, e))?;
        }
    }
    let plain_new = plain_zstd_bytes(&new, o.threads)?;
    ratios.push(Ratio {
        what: format!(
            "RL step lr={:e}: delta (level {}, {} MiB chunks)",
            o.lr,
            o.codec.zstd_level,
            o.codec.chunk_bytes >> 20
        ),
        ratio: file_len(&delta)? as f64 / size as f64,
        changed_values: Some(changed_fraction(&base, &new)?),
        diff_gb_per_s_per_core: None,
    });
    ratios.push(Ratio {
        what: "RL step: plain zstd -3 of the new checkpoint".into(),
        ratio: plain_new as f64 / size as f64,
        changed_values: None,
        diff_gb_per_s_per_core: None,
    });
    std::fs::remove_dir_all(&new).map_err(|e| WeightsError::io(&new, e))?;

    progress("adversarial case");
    write_checkpoint(&adv, &spec(n), Update::Adversarial, o.threads)?;
    let _ = std::fs::remove_file(&delta);
    let opts = CodecOptions {
        threads: o.threads,
        ..o.codec.clone()
    };
    runs.push(timed("diff (adversarial)", o.threads, size, || {
        diff(&base, None, &adv, 1, &delta, &opts).map(|_| ())
    })?);
    let out = s.join("applied-adv");
    runs.push(timed("apply (adversarial)", o.threads, size, || {
        crate::apply::apply(&base, &delta, &out, o.threads).map(|_| ())
    })?);
    ratios.push(Ratio {
        what: "adversarial: delta".into(),
        ratio: file_len(&delta)? as f64 / size as f64,
        changed_values: Some(changed_fraction(&base, &adv)?),
        diff_gb_per_s_per_core: None,
    });
    ratios.push(Ratio {
        what: "adversarial: plain zstd -3 of the new checkpoint".into(),
        ratio: plain_zstd_bytes(&adv, o.threads)? as f64 / size as f64,
        changed_values: None,
        diff_gb_per_s_per_core: None,
    });
    std::fs::remove_dir_all(&adv).map_err(|e| WeightsError::io(&adv, e))?;
    std::fs::remove_dir_all(&out).map_err(|e| WeightsError::io(&out, e))?;
    std::fs::remove_dir_all(&base).map_err(|e| WeightsError::io(&base, e))?;

    // Sweeps on a smaller checkpoint.
    let m = o.sweep_bytes;
    let (sb, sn) = (s.join("sweep-base"), s.join("sweep-new"));
    write_checkpoint(&sb, &spec(m), Update::Rl { lr: o.lr, steps: 0 }, o.threads)?;
    checkpoint::write_marker(&sb, &checkpoint::stamp(&sb, 0, o.threads)?)?;
    let msize = crate::layout::total_bytes(&crate::layout::read_dir_layout(&sb)?);
    let mut generated: Option<f32> = None;
    let mut one = |what: String,
                   lr: f32,
                   opts: CodecOptions,
                   progress: &mut dyn FnMut(&str)|
     -> Result<Ratio> {
        progress(&what);
        if generated != Some(lr) {
            let _ = std::fs::remove_dir_all(&sn);
            write_checkpoint(&sn, &spec(m), Update::Rl { lr, steps: 1 }, o.threads)?;
            generated = Some(lr);
        }
        let _ = std::fs::remove_file(&delta);
        let opts1 = CodecOptions { threads: 1, ..opts };
        let run = timed(&what, 1, msize, || {
            diff(&sb, None, &sn, 1, &delta, &opts1).map(|_| ())
        })?;
        let changed = changed_fraction(&sb, &sn)?;
        Ok(Ratio {
            what,
            ratio: file_len(&delta)? as f64 / msize as f64,
            changed_values: Some(changed),
            diff_gb_per_s_per_core: Some(run.gb_per_cpu_s.unwrap_or(run.gb_per_s)),
        })
    };
    for &lr in &o.lrs {
        ratios.push(one(
            format!("lr sweep: lr={lr:e}"),
            lr,
            o.codec.clone(),
            progress,
        )?);
    }
    for &level in &o.levels {
        ratios.push(one(
            format!("level sweep: lr={:e} level {level}", o.lr),
            o.lr,
            CodecOptions {
                zstd_level: level,
                ..o.codec.clone()
            },
            progress,
        )?);
    }
    for &chunk in &o.chunks {
        ratios.push(one(
            format!("chunk sweep: lr={:e} chunk {} KiB", o.lr, chunk >> 10),
            o.lr,
            CodecOptions {
                chunk_bytes: chunk,
                ..o.codec.clone()
            },
            progress,
        )?);
    }
    Ok(BenchReport {
        checkpoint_bytes: size,
        runs,
        ratios,
    })
}
