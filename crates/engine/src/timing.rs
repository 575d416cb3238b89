//! Timing models: how long a scheduler step takes.
//!
//! Behind one trait so the engine, the server and the simulator can swap them:
//! - [`DynamoPoly`] (the default): the published polynomial of Dynamo's mocker, so our results can
//!   be set beside theirs.
//! - [`TableProfile`]: measured or derived tables loaded from JSON, interpolated piecewise-linearly
//!   and extrapolated linearly beyond their ends (or refusing, when the profile says so). Never a
//!   silent zero.
//!
//! A [`SpeedUp`] wrapper divides every time by `speedup_ratio`.

use serde::{Deserialize, Serialize};
use std::path::Path;

pub use kvrouter_core::timing::{DynamoPoly, StepShape, TimingError, TimingModel};

/// A profile table as stored on disk.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileTable {
    /// Name shown in reports.
    pub name: String,
    /// Where the numbers come from.
    pub source: String,
    /// Extrapolate linearly beyond the table (true) or refuse (false).
    pub extrapolate: bool,
    /// Prefill: (new tokens, ms) points, sorted by tokens.
    pub prefill: Vec<(f64, f64)>,
    /// Decode grid: batch sizes (sorted).
    pub decode_batch_sizes: Vec<f64>,
    /// Decode grid: mean context lengths in tokens (sorted).
    pub decode_contexts: Vec<f64>,
    /// Decode step ms, `[batch index][context index]`.
    pub decode_ms: Vec<Vec<f64>>,
}

/// The largest profile file [`TableProfile::load`] reads (a measured table is a few KiB).
pub const MAX_PROFILE_FILE_BYTES: u64 = 4 << 20;

/// A table-driven timing model.
#[derive(Clone, Debug, PartialEq)]
pub struct TableProfile {
    table: ProfileTable,
    /// The prefill points' tokens and times, apart (no allocation per query).
    prefill_tokens: Vec<f64>,
    prefill_times: Vec<f64>,
    /// Floors of answers (half the smallest time of each table): extrapolation below the first
    /// point never reports free work.
    prefill_floor: f64,
    decode_floor: f64,
}

/// Most prefill points, and most values on each decode axis, a profile may have (a query scans
/// them, and a router asks two queries per candidate worker per decision).
pub const MAX_PROFILE_POINTS: usize = 1024;
/// The range of every time in a profile, ms: above a microsecond, below about three hours.
pub const PROFILE_MS_RANGE: (f64, f64) = (1e-3, 1e7);

/// Why a profile could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The file could not be read.
    #[error("reading profile {path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The JSON is malformed.
    #[error("parsing profile {path}: {source}")]
    Parse {
        /// The path.
        path: String,
        /// The cause.
        source: serde_json::Error,
    },
    /// No built-in has the name, and no file the path.
    #[error(
        "profile {0:?}: not dynamo-poly, a built-in (h100-llama3-8b, h200-llama3-8b) or the path \
         of a JSON profile file"
    )]
    Unknown(String),
    /// The table is inconsistent.
    #[error("profile {name}: {reason}")]
    Invalid {
        /// The profile name.
        name: String,
        /// What is wrong.
        reason: String,
    },
}

const H100: &str = include_str!("../profiles/h100-llama3-8b.json");
const H200: &str = include_str!("../profiles/h200-llama3-8b.json");

impl TableProfile {
    /// Validates a table: at least two and at most [`MAX_PROFILE_POINTS`] strictly increasing
    /// finite values on each axis (tokens and contexts ≥ 0, batch sizes > 0), a full decode
    /// grid, and every time finite and within [`PROFILE_MS_RANGE`].
    pub fn new(table: ProfileTable) -> Result<Self, ProfileError> {
        let invalid = |reason: String| ProfileError::Invalid {
            name: table.name.clone(),
            reason,
        };
        let prefill_tokens: Vec<f64> = table.prefill.iter().map(|p| p.0).collect();
        let prefill_times: Vec<f64> = table.prefill.iter().map(|p| p.1).collect();
        let axis = |what: &str, v: &[f64], min: f64, above: bool| {
            let ok = (2..=MAX_PROFILE_POINTS).contains(&v.len())
                && v.iter().all(|x| x.is_finite())
                && v.windows(2).all(|w| w[0] < w[1])
                && if above { v[0] > min } else { v[0] >= min };
            match ok {
                true => Ok(()),
                false => Err(invalid(format!(
                    "{what} need 2 to {MAX_PROFILE_POINTS} finite, strictly increasing values, \
                     the first {} {min}",
                    if above { "above" } else { "at least" }
                ))),
            }
        };
        axis("prefill points' tokens", &prefill_tokens, 0.0, false)?;
        axis("decode batch sizes", &table.decode_batch_sizes, 0.0, true)?;
        axis("decode contexts", &table.decode_contexts, 0.0, false)?;
        if table.decode_ms.len() != table.decode_batch_sizes.len()
            || table
                .decode_ms
                .iter()
                .any(|row| row.len() != table.decode_contexts.len())
        {
            return Err(invalid("decode_ms must be batch sizes × contexts".into()));
        }
        let (lo, hi) = PROFILE_MS_RANGE;
        let decode = table.decode_ms.iter().flatten().copied();
        if prefill_times
            .iter()
            .copied()
            .chain(decode.clone())
            .any(|v| !(lo..=hi).contains(&v))
        {
            return Err(invalid(format!(
                "every time must be a number of ms from {lo} to {hi}"
            )));
        }
        Ok(Self {
            // Half the first segment's smaller time, and half the grid's smallest.
            prefill_floor: prefill_times[0].min(prefill_times[1]) * 0.5,
            decode_floor: decode.clone().fold(f64::INFINITY, f64::min) * 0.5,
            prefill_tokens,
            prefill_times,
            table,
        })
    }

    /// Parses and validates a JSON profile.
    pub fn from_json(path: &str, text: &str) -> Result<Self, ProfileError> {
        let table: ProfileTable =
            serde_json::from_str(text).map_err(|source| ProfileError::Parse {
                path: path.into(),
                source,
            })?;
        Self::new(table).map_err(|e| match e {
            // Named by its file, which is what the caller gave (its `name` may be anything).
            ProfileError::Invalid { name, reason } if name != path => ProfileError::Invalid {
                name: format!("{path} (named {name:?})"),
                reason,
            },
            e => e,
        })
    }

    /// Loads a JSON profile from a file: a regular file of at most [`MAX_PROFILE_FILE_BYTES`]
    /// (a device, a FIFO or a directory is refused before it is opened, so `/dev/zero` or a
    /// pipe nobody writes cannot hold the caller).
    pub fn load(path: &Path) -> Result<Self, ProfileError> {
        use std::io::Read;
        let shown = path.display().to_string();
        let io = |source| ProfileError::Io {
            path: shown.clone(),
            source,
        };
        let refuse = |why: String| io(std::io::Error::new(std::io::ErrorKind::InvalidInput, why));
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(refuse("not a regular file".into()));
        }
        let too_large = || refuse(format!("larger than {MAX_PROFILE_FILE_BYTES} bytes"));
        if meta.len() > MAX_PROFILE_FILE_BYTES {
            return Err(too_large());
        }
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_PROFILE_FILE_BYTES + 1).read_to_string(&mut text))
            .map_err(io)?;
        if text.len() as u64 > MAX_PROFILE_FILE_BYTES {
            return Err(too_large());
        }
        Self::from_json(&shown, &text)
    }

    /// A built-in profile by name: `h100-llama3-8b` or `h200-llama3-8b`.
    pub fn builtin(name: &str) -> Option<Self> {
        let text = match name {
            "h100-llama3-8b" | "h100" => H100,
            "h200-llama3-8b" | "h200" => H200,
            _ => return None,
        };
        Some(Self::from_json(name, text).expect("built-in profiles are valid"))
    }

    /// The table.
    pub fn table(&self) -> &ProfileTable {
        &self.table
    }

    fn err(&self, what: &'static str, value: f64) -> TimingError {
        TimingError {
            profile: self.table.name.clone(),
            what,
            value,
        }
    }

    /// Piecewise-linear interpolation along sorted `xs`, with linear extrapolation at the ends
    /// when allowed.
    fn interp(
        &self,
        xs: &[f64],
        ys: &[f64],
        x: f64,
        what: &'static str,
    ) -> Result<f64, TimingError> {
        let i = self.segment(xs, x, what)?;
        Ok(along(xs, ys, i, x))
    }

    /// The segment `i..=i + 1` of sorted `xs` that holds `x` (the first or last when `x` is
    /// outside, if the profile extrapolates).
    fn segment(&self, xs: &[f64], x: f64, what: &'static str) -> Result<usize, TimingError> {
        let n = xs.len();
        if (x < xs[0] || x > xs[n - 1]) && !self.table.extrapolate {
            return Err(self.err(what, x));
        }
        Ok(match xs.iter().position(|&v| v >= x) {
            Some(0) => 0,
            Some(i) => i - 1,
            None => n - 2,
        })
    }
}

/// The line through points `i` and `i + 1` of (`xs`, `ys`) at `x`.
fn along(xs: &[f64], ys: &[f64], i: usize, x: f64) -> f64 {
    let (x0, x1, y0, y1) = (xs[i], xs[i + 1], ys[i], ys[i + 1]);
    y0 + (y1 - y0) * (x - x0) / (x1 - x0)
}

impl TimingModel for TableProfile {
    fn prefill_ms(&self, tokens: u64) -> Result<f64, TimingError> {
        if tokens == 0 {
            return Ok(0.0);
        }
        let ms = self.interp(
            &self.prefill_tokens,
            &self.prefill_times,
            tokens as f64,
            "prefill tokens",
        )?;
        // Linear extrapolation below the first point can reach zero: never report free work.
        Ok(ms.max(self.prefill_floor))
    }

    fn decode_ms(&self, shape: &StepShape) -> Result<f64, TimingError> {
        let t = &self.table;
        let batch = shape.decode_seqs as f64;
        let ctx = shape.decode_mean_context.max(0.0);
        // Along context in the two batch rows around `batch`, then along batch between them.
        let b = self.segment(&t.decode_batch_sizes, batch, "decode batch size")?;
        let c = self.segment(&t.decode_contexts, ctx, "decode context")?;
        let rows = [b, b + 1].map(|r| along(&t.decode_contexts, &t.decode_ms[r], c, ctx));
        let ms = along(&t.decode_batch_sizes[b..], &rows, 0, batch);
        Ok(ms.max(self.decode_floor))
    }
}

/// A timing model by name: `dynamo-poly`, a built-in profile (`h100-llama3-8b`,
/// `h200-llama3-8b`) or the path of a JSON profile; every time divided by `speedup_ratio`.
pub fn by_name(name: &str, speedup_ratio: f64) -> Result<Box<dyn TimingModel>, ProfileError> {
    model(name, speedup_ratio, false)
}

/// [`by_name`] as a router prices workers with it: a table profile extrapolates beyond its
/// points whatever its file says (a router must price every request; a profile refusing a
/// query outside its table would price that request at the cost policy's 1,000 s per step).
pub fn for_router(name: &str, speedup_ratio: f64) -> Result<Box<dyn TimingModel>, ProfileError> {
    model(name, speedup_ratio, true)
}

fn model(
    name: &str,
    speedup_ratio: f64,
    extrapolate: bool,
) -> Result<Box<dyn TimingModel>, ProfileError> {
    if name == "dynamo-poly" {
        return Ok(Box::new(SpeedUp {
            inner: DynamoPoly,
            ratio: speedup_ratio,
        }));
    }
    let mut profile = match TableProfile::builtin(name) {
        Some(p) => p,
        None if name.is_empty() || !Path::new(name).exists() => {
            return Err(ProfileError::Unknown(name.to_owned()))
        }
        None => TableProfile::load(Path::new(name))?,
    };
    if extrapolate {
        profile.table.extrapolate = true;
    }
    Ok(Box::new(SpeedUp {
        inner: profile,
        ratio: speedup_ratio,
    }))
}

/// Divides every time of an inner model by `ratio` (> 0).
#[derive(Debug)]
pub struct SpeedUp<M> {
    /// The model.
    pub inner: M,
    /// The divisor.
    pub ratio: f64,
}

impl<M: TimingModel> TimingModel for SpeedUp<M> {
    fn prefill_ms(&self, tokens: u64) -> Result<f64, TimingError> {
        Ok(self.inner.prefill_ms(tokens)? / self.ratio)
    }
    fn decode_ms(&self, shape: &StepShape) -> Result<f64, TimingError> {
        Ok(self.inner.decode_ms(shape)? / self.ratio)
    }
}

#[cfg(test)]
#[path = "timing_tests.rs"]
mod tests;
