//! Reading the small files flags name (settings, secrets): a regular file only, and only up to
//! a bound. A device or FIFO (`/dev/zero`) would otherwise be read without end (found by a
//! probe: memory grew 1 GB/s until the process was killed).

use std::io::{Error, ErrorKind, Read};
use std::path::Path;

/// The largest config or workers file read (16 MiB): such a file holds settings.
pub(crate) const MAX_SETTINGS_FILE_BYTES: u64 = 16 << 20;

/// The text of `path`, a regular file of at most `max` bytes: `InvalidInput` ("not a regular
/// file") for anything else, `FileTooLarge` for a longer one, read no further than the bound.
pub(crate) fn read_bounded(path: &Path, max: u64) -> std::io::Result<String> {
    if !std::fs::metadata(path)?.is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, "not a regular file"));
    }
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(max + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > max {
        let why = format!("longer than {max} bytes");
        return Err(Error::new(ErrorKind::FileTooLarge, why));
    }
    Ok(text)
}
