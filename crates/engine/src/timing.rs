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
mod tests {
    use super::*;

    #[test]
    fn dynamo_poly_matches_its_published_formula() {
        let m = DynamoPoly;
        assert_eq!(m.prefill_ms(0).unwrap(), 0.0);
        let t = 1000.0f64;
        let want = 4.209989e-7 * t * t + 0.01518344 * t + 16.50142;
        assert!((m.prefill_ms(1000).unwrap() - want).abs() < 1e-9);
        let half = StepShape {
            decode_seqs: 1,
            active_kv_tokens: 50,
            kv_capacity_tokens: 100,
            ..Default::default()
        };
        let want = -25.74 * 0.25 + 54.01 * 0.5 + 5.74;
        assert!((m.decode_ms(&half).unwrap() - want).abs() < 1e-9);
        let empty = StepShape {
            decode_seqs: 1,
            kv_capacity_tokens: 100,
            ..Default::default()
        };
        assert_eq!(m.decode_ms(&empty).unwrap(), 5.74);
    }

    #[test]
    fn speedup_divides_every_time() {
        let m = SpeedUp {
            inner: DynamoPoly,
            ratio: 10.0,
        };
        assert!(
            (m.prefill_ms(1000).unwrap() * 10.0 - DynamoPoly.prefill_ms(1000).unwrap()).abs()
                < 1e-9
        );
    }

    fn table(extrapolate: bool) -> TableProfile {
        TableProfile::new(ProfileTable {
            name: "t".into(),
            source: "test".into(),
            extrapolate,
            prefill: vec![(100.0, 10.0), (1000.0, 100.0)],
            decode_batch_sizes: vec![1.0, 8.0],
            decode_contexts: vec![0.0, 1000.0],
            decode_ms: vec![vec![5.0, 6.0], vec![7.0, 9.0]],
        })
        .unwrap()
    }

    #[test]
    fn tables_interpolate_and_extrapolate_or_refuse() {
        let t = table(true);
        assert!((t.prefill_ms(550).unwrap() - 55.0).abs() < 1e-9);
        assert!((t.prefill_ms(2000).unwrap() - 200.0).abs() < 1e-9);
        assert!(t.prefill_ms(1).unwrap() > 0.0, "never a silent zero");
        let shape = StepShape {
            decode_seqs: 8,
            decode_mean_context: 500.0,
            ..Default::default()
        };
        assert!((t.decode_ms(&shape).unwrap() - 8.0).abs() < 1e-9);
        let strict = table(false);
        assert!(strict.prefill_ms(2000).is_err());
        let big = StepShape {
            decode_seqs: 64,
            decode_mean_context: 10.0,
            ..Default::default()
        };
        assert_eq!(
            strict.decode_ms(&big).unwrap_err().what,
            "decode batch size"
        );
    }

    #[test]
    fn builtin_profiles_load_and_h200_is_faster_at_decode() {
        let h100 = TableProfile::builtin("h100").unwrap();
        let h200 = TableProfile::builtin("h200").unwrap();
        let shape = StepShape {
            decode_seqs: 64,
            decode_mean_context: 4000.0,
            ..Default::default()
        };
        assert!(h200.decode_ms(&shape).unwrap() < h100.decode_ms(&shape).unwrap());
        assert!(h100.prefill_ms(4096).unwrap() > h100.prefill_ms(512).unwrap());
        assert!(TableProfile::builtin("a100").is_none());
    }

    #[test]
    fn profile_files_are_read_bounded_and_only_when_regular() {
        let dir = std::env::temp_dir().join(format!("kvr-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.json");
        std::fs::write(&good, serde_json::to_string(table(true).table()).unwrap()).unwrap();
        assert_eq!(TableProfile::load(&good).unwrap(), table(true));
        let big = dir.join("big.json");
        std::fs::write(&big, vec![b' '; MAX_PROFILE_FILE_BYTES as usize + 1]).unwrap();
        for (path, why) in [
            (big.as_path(), "larger than"),
            (Path::new("/dev/zero"), "not a regular file"),
            (dir.as_path(), "not a regular file"),
        ] {
            let err = TableProfile::load(path).unwrap_err().to_string();
            assert!(err.contains(why), "{}: {err}", path.display());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn malformed_tables_are_refused_with_a_reason() {
        let good = table(true).table().clone();
        let refused = |change: &dyn Fn(&mut ProfileTable), why: &str| {
            let mut bad = good.clone();
            change(&mut bad);
            let err = TableProfile::new(bad).unwrap_err().to_string();
            assert!(err.contains(why), "{err}");
        };
        refused(
            &|t| t.prefill = vec![(10.0, 1.0)],
            "prefill points' tokens need 2",
        );
        // Times that overflow, vanish or are not numbers: every estimate would be one too.
        for ms in [1e300, 1e-320, f64::NAN, -1.0, 0.0] {
            refused(&|t| t.prefill[1].1 = ms, "every time must be");
            refused(&|t| t.decode_ms[0][0] = ms, "every time must be");
        }
        refused(&|t| t.prefill[0].0 = -100.0, "the first at least 0");
        refused(&|t| t.decode_batch_sizes[0] = -5.0, "the first above 0");
        refused(&|t| t.decode_contexts[1] = f64::INFINITY, "finite");
        refused(
            &|t| t.prefill = (0..=MAX_PROFILE_POINTS).map(|i| (i as f64, 1.0)).collect(),
            "2 to 1024",
        );
        assert!(TableProfile::from_json("x.json", "{").is_err());
        // An error in a file names the file (its `name` may be anything, a built-in's too).
        let mut named = good.clone();
        named.prefill[1].1 = f64::MAX;
        named.name = "h100-llama3-8b".into();
        let text = serde_json::to_string(&named).unwrap();
        let err = TableProfile::from_json("mine.json", &text)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("profile mine.json (named \"h100-llama3-8b\")"),
            "{err}"
        );
    }

    #[test]
    fn queries_read_the_two_points_around_them() {
        // The grid's own points come back exactly, between them the line, beyond the last
        // point the line extended; the same figures as interpolating every row first.
        let p = table(true);
        let t = p.table().clone();
        for (b, &batch) in t.decode_batch_sizes.iter().enumerate() {
            for (c, &ctx) in t.decode_contexts.iter().enumerate() {
                let shape = StepShape {
                    decode_seqs: batch as u64,
                    decode_mean_context: ctx,
                    ..Default::default()
                };
                let ms = p.decode_ms(&shape).unwrap();
                assert!((ms - t.decode_ms[b][c]).abs() < 1e-9, "{b} {c}: {ms}");
            }
        }
        let (x0, y0) = t.prefill[0];
        let (x1, y1) = t.prefill[1];
        let mid = ((x0 + x1) / 2.0).round();
        let want = y0 + (y1 - y0) * (mid - x0) / (x1 - x0);
        assert!((p.prefill_ms(mid as u64).unwrap() - want).abs() < 1e-9);
    }
}
