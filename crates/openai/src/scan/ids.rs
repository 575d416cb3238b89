//! Token-id lists in JSON text: `[id, ...]`, read by [`Cursor::list`].
//!
//! Each id is read eight bytes at a time: an id of up to 7 digits and the comma after it
//! (and one space, as Python's `json.dumps` writes `, `) are in one load, so the common step is
//! one load and no loop. A long list is read as two streams at once, from its start and from a
//! comma near the middle of the text left ([`Cursor::list_in_two`]): each step's next load
//! waits for the step before it, and two streams that do not wait for each other let the CPU
//! run both chains side by side. Whatever the list holds, the answer is the one reading the
//! whole list from its start would give, and that is the answer `serde_json` gives (the tests
//! in `ids/tests.rs` check both against `serde_json`, with the split at a bad id, beyond the
//! list and inside a string).

use super::Cursor;

/// A list with at least this much text left from its first id is read as two streams.
const SPLIT_BYTES: usize = 512;
/// How far past the middle of the text the second stream looks for the comma it starts at.
const SPLIT_SEARCH: usize = 32;

const ONES: u64 = 0x0101_0101_0101_0101;

/// Where a stream of a list is after one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    More,
    /// After its closing bracket.
    Closed,
    /// At the comma where the next stream starts.
    Joined,
    Failed,
}

/// Eight bytes of text as each byte's value less `0`, and how many digits they start with (8:
/// all of them). A byte that is no digit has a high nibble set in its value or after adding 6;
/// a carry out of such a byte only touches the bytes after it.
#[inline(always)]
fn digits_of(chunk: u64) -> (u64, usize) {
    let values = chunk ^ (0x30 * ONES);
    let not_digit = (values | values.wrapping_add(0x06 * ONES)) & (0xF0 * ONES);
    (values, (not_digit.trailing_zeros() / 8) as usize)
}

/// The number the first `digits` (1 to 7) digit values of `values` ([`digits_of`]) write: the
/// digits as the low bytes of an eight-digit number with leading zeros, folded in pairs, fours
/// and eights, each fold one multiply (`x·10ᵏ` and `x` in one product, shifted down).
#[inline(always)]
fn fold_digits(values: u64, digits: usize) -> u32 {
    let v = values << (8 * (8 - digits));
    let v = (v.wrapping_mul(10 << 8 | 1) >> 8) & 0x00FF_00FF_00FF_00FF;
    let v = (v.wrapping_mul(100 << 16 | 1) >> 16) & 0x0000_FFFF_0000_FFFF;
    (v.wrapping_mul(10_000 << 32 | 1) >> 32) as u32
}

impl Cursor<'_> {
    /// A token id: a JSON integer from 0 to `u32::MAX` (not a negative, fractional or exponent
    /// number, a larger one, or one with a leading zero).
    fn id(&mut self) -> Option<u32> {
        self.skip_whitespace();
        if let Some(id) = self.short_id() {
            return id;
        }
        let start = self.at;
        let mut value: u64 = 0;
        while let Some(&b) = self.bytes.get(self.at) {
            let digit = b.wrapping_sub(b'0');
            if digit > 9 || self.at - start == 10 {
                break;
            }
            value = value * 10 + u64::from(digit);
            self.at += 1;
        }
        let digits = self.at - start;
        if digits == 0 || (digits > 1 && self.bytes[start] == b'0') {
            return None;
        }
        match self.bytes.get(self.at) {
            Some(b'0'..=b'9' | b'.' | b'e' | b'E') => None,
            _ => u32::try_from(value).ok(),
        }
    }

    /// [`Cursor::id`] of an id of at most 7 digits with 8 bytes of text from the cursor, read
    /// from one load; `None` when it does not apply (the caller reads the id digit by digit).
    fn short_id(&mut self) -> Option<Option<u32>> {
        let eight: [u8; 8] = self.bytes.get(self.at..self.at + 8)?.try_into().ok()?;
        let (values, digits) = digits_of(u64::from_le_bytes(eight));
        if digits == 8 {
            return None;
        }
        let start = self.at;
        self.at += digits;
        if digits == 0 || (digits > 1 && self.bytes[start] == b'0') {
            return Some(None);
        }
        if let Some(b'.' | b'e' | b'E') = self.bytes.get(self.at) {
            return Some(None);
        }
        Some(Some(fold_digits(values, digits)))
    }

    /// `[id, ...]`, with room for `capacity` ids.
    pub(super) fn list(&mut self, capacity: usize) -> Option<Vec<u32>> {
        if self.next()? != b'[' {
            return None;
        }
        let mut ids = Vec::with_capacity(capacity);
        if self.peek()? == b']' {
            self.at += 1;
            return Some(ids);
        }
        if let Some(split) = self.split_point() {
            return self.list_in_two(split, ids);
        }
        loop {
            match self.step(&mut ids, usize::MAX) {
                Step::More => {}
                Step::Closed => return Some(ids),
                _ => return None,
            }
        }
    }

    /// Where the second stream of a long list (cursor at its first id) starts: a comma near
    /// the middle of the text left. `None` for short text, or no comma near the middle.
    fn split_point(&self) -> Option<usize> {
        let left = self.bytes.len() - self.at;
        if left < SPLIT_BYTES {
            return None;
        }
        let mid = self.at + left / 2;
        let near = &self.bytes[mid..(mid + SPLIT_SEARCH).min(self.bytes.len())];
        near.iter().position(|&b| b == b',').map(|n| mid + n)
    }

    /// The rest of a list (cursor at its first id, `first` empty) read as two streams at
    /// once: this one, which ends where it meets the comma at `split`, and one from that
    /// comma. If this stream meets the comma, the list is both; if it closes before, the
    /// comma was beyond the list and the other stream is dropped. A stream that fails on the
    /// way fails the list, as one stream reading the whole list would.
    fn list_in_two(&mut self, split: usize, mut first: Vec<u32>) -> Option<Vec<u32>> {
        let mut other = Cursor {
            bytes: self.bytes,
            at: split + 1,
        };
        other.skip_whitespace();
        let mut second = Vec::with_capacity(first.capacity() / 2 + 1);
        let mut state = Step::More;
        loop {
            match self.step(&mut first, split) {
                Step::More => {}
                Step::Closed => return Some(first),
                Step::Failed => return None,
                Step::Joined => break,
            }
            if state == Step::More {
                state = other.step(&mut second, usize::MAX);
            }
        }
        while state == Step::More {
            state = other.step(&mut second, usize::MAX);
        }
        if state != Step::Closed {
            return None;
        }
        self.at = other.at;
        first.append(&mut second);
        Some(first)
    }

    /// One id of a list and the separator after it, and the whitespace after a comma;
    /// `split`: the comma where this stream joins the next one.
    #[inline(always)]
    fn step(&mut self, ids: &mut Vec<u32>, split: usize) -> Step {
        // The common case first: an id of 1 to 7 digits followed at once by a comma, both in
        // one eight-byte load.
        if let Some(eight) = self.bytes.get(self.at..self.at + 8) {
            let chunk = u64::from_le_bytes(eight.try_into().expect("eight bytes"));
            let (values, digits) = digits_of(chunk);
            let follower = (chunk >> (8 * (digits & 7))) as u8;
            let leading_zero = digits > 1 && values as u8 == 0;
            if digits != 0 && follower == b',' && !leading_zero && self.at + digits != split {
                ids.push(fold_digits(values, digits));
                self.at += digits + 1;
                // `, `: the space is in the load too (a branch, not arithmetic, so that the
                // next step's load need not wait for the comparison).
                if digits < 7 && (chunk >> (8 * (digits + 1))) as u8 == b' ' {
                    self.at += 1;
                }
                return Step::More;
            }
        }
        let Some(id) = self.id() else {
            return Step::Failed;
        };
        ids.push(id);
        let separator = match self.bytes.get(self.at) {
            Some(&b @ (b',' | b']')) => {
                self.at += 1;
                b
            }
            _ => match self.next() {
                Some(b) => b,
                None => return Step::Failed,
            },
        };
        match separator {
            b',' if self.at - 1 == split => Step::Joined,
            b',' => {
                self.skip_whitespace();
                Step::More
            }
            b']' => Step::Closed,
            _ => Step::Failed,
        }
    }
}

#[cfg(test)]
mod tests;
