//! Test data: real safetensors checkpoints of BF16 tensors, and the update models the delta is
//! judged on. Every value is a pure function of (seed, tensor, element, step), so a checkpoint of
//! any version is written in chunks without holding the previous one.
//!
//! **RL step model.** The trainer keeps FP32 master weights `w0 ~ N(0, 0.02²)`; each optimizer
//! step adds an Adam update `Δ = −lr · r` with `r ~ N(0, 0.23²)` (Adam's `m̂/√v̂` when gradients
//! are noise-dominated: the EMA of unit noise with β1 = 0.9 has std √(0.1/1.9) ≈ 0.23) and the
//! export rounds the master weights to BF16 (round to nearest even). A BF16 value changes only
//! when its master weight crosses a rounding boundary, so at RL learning rates (1e-6…1e-5) most
//! stay bit-identical. **Adversarial model:** every byte of every value differs from the base.

use crate::error::{Result, WeightsError};
use crate::parallel;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Standard deviation of the initial weights.
pub const WEIGHT_STD: f32 = 0.02;
/// Standard deviation of Adam's normalized step `m̂/√v̂` in the model.
pub const ADAM_RATIO_STD: f32 = 0.23;
/// Elements generated at a time per thread.
const GEN_CHUNK_ELEMS: usize = 1 << 20;

/// Which version of the model to write.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Update {
    /// The initial weights (`steps: 0`) or after `steps` RL steps at learning rate `lr`.
    Rl {
        /// Learning rate.
        lr: f32,
        /// Optimizer steps taken.
        steps: u32,
    },
    /// Every byte differs from the initial weights.
    Adversarial,
}

/// The shape of a generated checkpoint.
#[derive(Clone, Debug)]
pub struct GenSpec {
    /// Approximate total bytes of tensor data.
    pub total_bytes: u64,
    /// Bytes per tensor (the last may be smaller).
    pub tensor_bytes: u64,
    /// Columns of each 2-D tensor.
    pub cols: u64,
    /// Number of `.safetensors` shards.
    pub files: usize,
    /// Seed of every value.
    pub seed: u64,
}

impl GenSpec {
    /// Tensors as (file index, name, rows, cols).
    fn tensors(&self) -> Vec<(usize, String, u64, u64)> {
        let rows_per = (self.tensor_bytes / 2 / self.cols).max(1);
        let mut rows_left = (self.total_bytes / 2 / self.cols).max(1);
        let mut out = Vec::new();
        let mut i = 0;
        while rows_left > 0 {
            let rows = rows_per.min(rows_left);
            out.push((
                0,
                format!(
                    "model.layers.{}.{}.weight",
                    i / 4,
                    ["q_proj", "k_proj", "mlp.up_proj", "mlp.down_proj"][i % 4]
                ),
                rows,
                self.cols,
            ));
            rows_left -= rows;
            i += 1;
        }
        let n = out.len();
        for (j, t) in out.iter_mut().enumerate() {
            t.0 = j * self.files.max(1) / n;
        }
        out
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// An approximately standard normal value from a 64-bit hash (Irwin–Hall of four 16-bit uniforms).
fn normal(h: u64) -> f32 {
    let s: u32 = (0..4).map(|k| ((h >> (16 * k)) & 0xFFFF) as u32).sum();
    (s as f32 / 65535.0 - 2.0) * 3f32.sqrt()
}

/// FP32 -> BF16 bits, round to nearest even.
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let round = 0x7FFF + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

fn key(seed: u64, tensor: u64, elem: u64, step: u64) -> u64 {
    splitmix(seed ^ splitmix(tensor.wrapping_mul(0x1_0000_0001) ^ splitmix(elem ^ (step << 48))))
}

fn value(seed: u64, tensor: u64, elem: u64, update: Update) -> u16 {
    let w0 = WEIGHT_STD * normal(key(seed, tensor, elem, 0));
    match update {
        Update::Rl { lr, steps } => {
            let mut w = w0;
            for s in 1..=steps as u64 {
                w -= lr * ADAM_RATIO_STD * normal(key(seed, tensor, elem, s));
            }
            bf16_bits(w)
        }
        Update::Adversarial => {
            let base = bf16_bits(w0);
            let other = bf16_bits(WEIGHT_STD * normal(key(seed ^ 0xADBE, tensor, elem, 0)));
            let mut b = other.to_le_bytes();
            for (x, y) in b.iter_mut().zip(base.to_le_bytes()) {
                if *x == y {
                    *x ^= 1;
                }
            }
            u16::from_le_bytes(b)
        }
    }
}

/// Writes the checkpoint (`model-0000i-of-0000n.safetensors` shards) into `dir` (created).
pub fn write_checkpoint(dir: &Path, spec: &GenSpec, update: Update, threads: usize) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| WeightsError::io(dir, e))?;
    let tensors = spec.tensors();
    let files = spec.files.max(1);
    let mut handles = Vec::new();
    let mut finals = Vec::new();
    let mut placements = vec![(0usize, 0u64); tensors.len()];
    for fi in 0..files {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let mut at = 0u64;
        for (ti, (tf, name, rows, cols)) in tensors.iter().enumerate() {
            if *tf != fi {
                continue;
            }
            let len = rows * cols * 2;
            header.insert(name.clone(), serde_json::json!({"dtype": "BF16", "shape": [rows, cols], "data_offsets": [at, at + len]}));
            placements[ti] = (fi, at);
            at += len;
        }
        let mut text = serde_json::to_vec(&header).expect("header serializes");
        while text.len() % 8 != 0 {
            text.push(b' ');
        }
        // Written under a hidden partial name and renamed once whole: a run killed half-way
        // leaves no shard that reads as complete (the file is sized before it is filled).
        let done = dir.join(format!("model-{:05}-of-{:05}.safetensors", fi + 1, files));
        let path = crate::diff::temp_path(&done);
        finals.push((path.clone(), done));
        let file = File::create(&path).map_err(|e| WeightsError::io(&path, e))?;
        let data_start = 8 + text.len() as u64;
        file.write_all_at(&(text.len() as u64).to_le_bytes(), 0)
            .map_err(|e| WeightsError::io(&path, e))?;
        file.write_all_at(&text, 8)
            .map_err(|e| WeightsError::io(&path, e))?;
        file.set_len(data_start + at)
            .map_err(|e| WeightsError::io(&path, e))?;
        handles.push((file, path, data_start));
    }
    let jobs: Vec<usize> = (0..tensors.len()).collect();
    parallel::run(
        threads,
        &jobs,
        || vec![0u8; GEN_CHUNK_ELEMS * 2],
        |&ti, buf| {
            let (fi, at) = placements[ti];
            let (file, path, data_start) = &handles[fi];
            let elems = tensors[ti].2 * tensors[ti].3;
            let mut e = 0u64;
            while e < elems {
                let n = (elems - e).min(GEN_CHUNK_ELEMS as u64) as usize;
                for (k, out) in buf[..2 * n].chunks_exact_mut(2).enumerate() {
                    out.copy_from_slice(
                        &value(spec.seed, ti as u64, e + k as u64, update).to_le_bytes(),
                    );
                }
                file.write_all_at(&buf[..2 * n], data_start + at + 2 * e)
                    .map_err(|err| WeightsError::io(path, err))?;
                e += n as u64;
            }
            Ok(())
        },
    )?;
    drop(handles);
    for (partial, done) in finals {
        std::fs::rename(&partial, &done).map_err(|e| WeightsError::io(&done, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3F80);
        assert_eq!(bf16_bits(f32::from_bits(0x3F80_8000)), 0x3F80); // tie -> even
        assert_eq!(bf16_bits(f32::from_bits(0x3F81_8000)), 0x3F82); // tie -> even
        assert_eq!(bf16_bits(f32::from_bits(0x3F80_8001)), 0x3F81);
    }

    #[test]
    fn rl_step_changes_few_values_and_adversarial_changes_every_byte() {
        let (mut changed, mut adv_same) = (0, 0);
        let n = 100_000;
        for e in 0..n {
            let base = value(7, 0, e, Update::Rl { lr: 0.0, steps: 0 });
            if value(7, 0, e, Update::Rl { lr: 1e-6, steps: 1 }) != base {
                changed += 1;
            }
            let a = value(7, 0, e, Update::Adversarial).to_le_bytes();
            adv_same += a
                .iter()
                .zip(base.to_le_bytes())
                .filter(|(x, y)| **x == *y)
                .count();
        }
        assert!(changed > 0 && changed < n / 10, "changed {changed} of {n}");
        assert_eq!(adv_same, 0);
    }
}
