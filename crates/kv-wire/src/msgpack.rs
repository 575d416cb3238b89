//! A msgpack reader over a byte slice: one item at a time, strings and binaries borrowed, no
//! tree built, so a payload is decoded straight into the model (building `rmpv::Value`s
//! allocated a node per token id and cost the router about 6 µs a message). [`check`] first
//! walks a whole value as `rmpv::decode::read_value_with_max_depth` would read it (same nesting
//! budget, same refusals), so the decoder refuses as invalid msgpack exactly the payloads that
//! reader refused (in its own words).

/// An integer as msgpack holds it: non-negative, or negative.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Int {
    /// Zero or more (any unsigned or signed marker with a non-negative value).
    Pos(u64),
    /// Less than zero.
    Neg(i64),
}

impl Int {
    #[inline]
    pub(crate) fn as_u64(self) -> Option<u64> {
        match self {
            Int::Pos(v) => Some(v),
            Int::Neg(_) => None,
        }
    }

    #[inline]
    pub(crate) fn as_i64(self) -> Option<i64> {
        match self {
            Int::Pos(v) => i64::try_from(v).ok(),
            Int::Neg(v) => Some(v),
        }
    }

    #[inline(always)]
    fn signed(v: i64) -> Int {
        match u64::try_from(v) {
            Ok(u) => Int::Pos(u),
            Err(_) => Int::Neg(v),
        }
    }
}

/// One msgpack item: a scalar, a borrowed string or binary, or the header of a container whose
/// elements (`Map`: key then value, per entry) follow it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Item<'a> {
    /// `nil`, and the reserved marker `0xc1`, which rmpv reads as nil.
    Nil,
    Bool,
    Int(Int),
    F32(f32),
    F64(f64),
    /// A string's bytes (not necessarily UTF-8: see [`Item::as_str`]).
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext,
    Array(usize),
    Map(usize),
}

impl<'a> Item<'a> {
    /// The string, when this is one and is valid UTF-8 (rmpv's `Value::as_str`).
    #[inline]
    pub(crate) fn as_str(self) -> Option<&'a str> {
        match self {
            Item::Str(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    pub(crate) fn as_u64(self) -> Option<u64> {
        match self {
            Item::Int(i) => i.as_u64(),
            _ => None,
        }
    }

    pub(crate) fn as_i64(self) -> Option<i64> {
        match self {
            Item::Int(i) => i.as_i64(),
            _ => None,
        }
    }
}

/// Why bytes are not msgpack (the decoder's `WireError::Msgpack`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Invalid {
    /// The bytes end inside an item (or a declared length is past any slice).
    Truncated,
    /// Nested deeper than the budget.
    TooDeep,
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Invalid::Truncated => "the bytes end inside a value",
            Invalid::TooDeep => "values are nested too deep",
        })
    }
}

/// A read position in a byte slice.
#[derive(Clone, Debug)]
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes }
    }

    /// The bytes not read yet.
    #[inline]
    pub(crate) fn rest(&self) -> &'a [u8] {
        self.bytes
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8], Invalid> {
        if n > self.bytes.len() {
            return Err(Invalid::Truncated);
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }

    #[inline]
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Invalid> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// A length of 1, 2 or 4 bytes (`width` 0, 1, 2), as the marker's low bits say.
    #[inline]
    fn length(&mut self, width: u8) -> Result<usize, Invalid> {
        Ok(match width {
            0 => usize::from(self.array::<1>()?[0]),
            1 => usize::from(u16::from_be_bytes(self.array()?)),
            // A length past the address space cannot be in the slice either.
            _ => usize::try_from(u32::from_be_bytes(self.array()?))
                .map_err(|_| Invalid::Truncated)?,
        })
    }

    /// Reads the next item's header (and a string's or binary's bytes, and an extension whole).
    #[inline]
    pub(crate) fn next(&mut self) -> Result<Item<'a>, Invalid> {
        if let Some(int) = self.int() {
            return Ok(Item::Int(int));
        }
        let marker = self.array::<1>()?[0];
        Ok(match marker {
            // `int` read every whole integer: this one is cut short.
            0x00..=0x7f | 0xcc..=0xd3 | 0xe0..=0xff => return Err(Invalid::Truncated),
            0x80..=0x8f => Item::Map(usize::from(marker & 0x0f)),
            0x90..=0x9f => Item::Array(usize::from(marker & 0x0f)),
            0xa0..=0xbf => Item::Str(self.take(usize::from(marker & 0x1f))?),
            0xc0 | 0xc1 => Item::Nil,
            0xc2 | 0xc3 => Item::Bool,
            0xc4..=0xc6 => {
                let n = self.length(marker - 0xc4)?;
                Item::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = self.length(marker - 0xc7)?;
                // The type byte, then the data.
                self.take(n.checked_add(1).ok_or(Invalid::Truncated)?)?;
                Item::Ext
            }
            0xca => Item::F32(f32::from_be_bytes(self.array()?)),
            0xcb => Item::F64(f64::from_be_bytes(self.array()?)),
            0xd4..=0xd8 => {
                self.take(1 + (1 << (marker - 0xd4)))?;
                Item::Ext
            }
            0xd9..=0xdb => {
                let n = self.length(marker - 0xd9)?;
                Item::Str(self.take(n)?)
            }
            0xdc | 0xdd => Item::Array(self.length(marker - 0xdb)?),
            0xde | 0xdf => Item::Map(self.length(marker - 0xdd)?),
        })
    }

    /// Reads the next item when it is an integer (the bulk of a payload: token ids and block
    /// hashes), read here without the general [`Reader::next`]; `None` (nothing read) when the
    /// next item is something else or the bytes end inside it.
    #[inline(always)]
    pub(crate) fn int(&mut self) -> Option<Int> {
        let b = self.bytes;
        let (&marker, rest) = b.split_first()?;
        let (int, size) = match marker {
            0x00..=0x7f => (Int::Pos(u64::from(marker)), 0),
            0xe0..=0xff => (Int::Neg(i64::from(marker as i8)), 0),
            0xcc => (Int::Pos(u64::from(*rest.first()?)), 1),
            0xcd => (Int::Pos(u64::from(u16::from_be_bytes(head(rest)?))), 2),
            0xce => (Int::Pos(u64::from(u32::from_be_bytes(head(rest)?))), 4),
            0xcf => (Int::Pos(u64::from_be_bytes(head(rest)?)), 8),
            0xd0 => (Int::signed(i64::from(i8::from_be_bytes(head(rest)?))), 1),
            0xd1 => (Int::signed(i64::from(i16::from_be_bytes(head(rest)?))), 2),
            0xd2 => (Int::signed(i64::from(i32::from_be_bytes(head(rest)?))), 4),
            0xd3 => (Int::signed(i64::from_be_bytes(head(rest)?)), 8),
            _ => return None,
        };
        self.bytes = &rest[size..];
        Some(int)
    }

    /// Skips the next value whole (a container with its elements). Only for bytes [`check`]
    /// accepted: the nesting is bounded there.
    pub(crate) fn skip(&mut self) -> Result<(), Invalid> {
        let mut pending: usize = 1;
        while pending > 0 {
            pending -= 1;
            if let Some(n) = self.bytes.first().copied().and_then(scalar_size) {
                self.take(n)?;
                continue;
            }
            pending = match self.next()? {
                Item::Array(n) => pending.checked_add(n),
                Item::Map(n) => n.checked_mul(2).and_then(|n| pending.checked_add(n)),
                _ => Some(pending),
            }
            .ok_or(Invalid::Truncated)?;
        }
        Ok(())
    }
}

/// The first `N` bytes of `bytes`, when it has them.
#[inline(always)]
fn head<const N: usize>(bytes: &[u8]) -> Option<[u8; N]> {
    bytes.get(..N)?.try_into().ok()
}

/// Walks one whole value at the start of `bytes` as rmpv's reader with `max_depth` reads it:
/// the same depth budget (a value spends one level, a container's elements one more, a string
/// or an extension two more for their bytes, a binary one), every declared length backed by
/// bytes.
/// Bytes after the value are not looked at.
pub(crate) fn check(bytes: &[u8], max_depth: u16) -> Result<(), Invalid> {
    check_value(&mut Reader::new(bytes), max_depth)
}

/// The size in bytes, marker included, of a scalar whose marker this is and whose size the
/// marker alone gives (nil, booleans, integers, floats).
#[inline]
fn scalar_size(marker: u8) -> Option<usize> {
    match marker {
        0x00..=0x7f | 0xe0..=0xff | 0xc0..=0xc3 => Some(1),
        0xcc | 0xd0 => Some(2),
        0xcd | 0xd1 => Some(3),
        0xca | 0xce | 0xd2 => Some(5),
        0xcb | 0xcf | 0xd3 => Some(9),
        _ => None,
    }
}

fn spend(depth: u16) -> Result<u16, Invalid> {
    depth.checked_sub(1).ok_or(Invalid::TooDeep)
}

/// [`check`] of the value at `r`, past it, with `depth` of the budget left there.
pub(crate) fn check_value(r: &mut Reader<'_>, depth: u16) -> Result<(), Invalid> {
    let depth = spend(depth)?;
    let item = r.next()?;
    match item {
        Item::Str(_) => {
            spend(spend(depth)?)?;
        }
        Item::Bin(_) => {
            spend(depth)?;
        }
        Item::Ext => {
            spend(spend(depth)?)?;
        }
        Item::Array(n) | Item::Map(n) => {
            let inner = spend(depth)?;
            let values = if matches!(item, Item::Map(_)) {
                n.checked_mul(2).ok_or(Invalid::Truncated)?
            } else {
                n
            };
            for _ in 0..values {
                // A fixed-size scalar (most of a payload: token ids, hashes) is stepped over
                // here; it spends a level of the budget as any value does.
                match r.bytes.first().copied().map(scalar_size) {
                    Some(Some(n)) if inner > 0 => {
                        r.take(n)?;
                    }
                    _ => check_value(r, inner)?,
                }
            }
        }
        Item::Nil | Item::Bool | Item::Int(_) | Item::F32(_) | Item::F64(_) => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rmpv_ok(bytes: &[u8], depth: usize) -> bool {
        rmpv::decode::read_value_with_max_depth(&mut &bytes[..], depth).is_ok()
    }

    #[test]
    fn the_depth_budget_is_rmpvs() {
        // Nested one-element arrays around a scalar, a string, a binary, an extension.
        for leaf in [&[0x01][..], &[0xa1, b'x'], &[0xc4, 1, 0], &[0xd4, 1, 0]] {
            for nesting in 0..12 {
                let mut bytes = vec![0x91; nesting];
                bytes.extend_from_slice(leaf);
                for depth in 0..24u16 {
                    assert_eq!(
                        check(&bytes, depth).is_ok(),
                        rmpv_ok(&bytes, depth.into()),
                        "{bytes:x?} at depth {depth}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_marker_reads_checks_and_skips_as_rmpv_reads_it() {
        // Each marker with enough bytes after it for any header and a short body, cut at every
        // length: `check` accepts what rmpv reads, and `next` (for scalars), `int` and `skip`
        // end where rmpv's reader ends.
        for marker in 0..=255u8 {
            let mut bytes = vec![marker, 0, 0, 0, 2, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06];
            bytes.extend([0x07; 8]);
            for len in 0..=bytes.len() {
                let b = &bytes[..len];
                let mut cursor = b;
                let rmpv = rmpv::decode::read_value_with_max_depth(&mut cursor, 16);
                assert_eq!(check(b, 16).is_ok(), rmpv.is_ok(), "{b:x?}");
                let Ok(value) = rmpv else { continue };
                let mut r = Reader::new(b);
                r.skip().unwrap();
                assert_eq!(r.rest(), cursor, "skip {b:x?}");
                let mut r = Reader::new(b);
                let item = r.next().unwrap();
                if !matches!(item, Item::Array(_) | Item::Map(_)) {
                    assert_eq!(r.rest(), cursor, "next {b:x?}");
                }
                assert_eq!(item.as_u64(), value.as_u64(), "{b:x?}");
                assert_eq!(item.as_i64(), value.as_i64(), "{b:x?}");
                assert_eq!(item.as_str(), value.as_str(), "{b:x?}");
                assert_eq!(item == Item::Nil, value.is_nil(), "{b:x?}");
            }
        }
    }

    #[test]
    fn maps_spend_the_depth_budget_as_rmpv_does() {
        // {"k": {"k": ... 1}} nested, and a map whose key is nested.
        for nesting in 0..10 {
            let mut values = vec![0x01];
            let mut keys = vec![0x01];
            for _ in 0..nesting {
                let mut v = vec![0x81, 0xa1, b'k'];
                v.extend(&values);
                values = v;
                let mut k = vec![0x81];
                k.extend(&keys);
                k.push(0xc0);
                keys = k;
            }
            for bytes in [&values, &keys] {
                for depth in 0..24u16 {
                    assert_eq!(
                        check(bytes, depth).is_ok(),
                        rmpv_ok(bytes, depth.into()),
                        "{bytes:x?} at depth {depth}"
                    );
                }
            }
        }
    }

    #[test]
    fn declared_lengths_need_their_bytes() {
        assert_eq!(
            check(&[0xdd, 0xff, 0xff, 0xff, 0xff], 16),
            Err(Invalid::Truncated)
        );
        assert_eq!(
            check(&[0xc6, 0xff, 0xff, 0xff, 0xff, 0], 16),
            Err(Invalid::Truncated)
        );
        assert_eq!(
            check(&[0xdb, 0, 0, 0, 2, b'a'], 16),
            Err(Invalid::Truncated)
        );
        assert_eq!(check(&[], 16), Err(Invalid::Truncated));
        assert_eq!(
            check(&[0x92, 0x01, 0x02, 0x03], 16),
            Ok(()),
            "trailing bytes are not read"
        );
    }

    #[test]
    fn integers_read_as_rmpv_reads_them() {
        let cases: [(&[u8], Option<u64>, Option<i64>); 6] = [
            (&[0x05], Some(5), Some(5)),
            (&[0xff], None, Some(-1)),
            (&[0xd0, 0x05], Some(5), Some(5)),
            (&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], None, Some(i64::MIN)),
            (
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                Some(u64::MAX),
                None,
            ),
            (&[0xcd, 0x01, 0x00], Some(256), Some(256)),
        ];
        for (bytes, u, i) in cases {
            let item = Reader::new(bytes).next().unwrap();
            let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
            assert_eq!((item.as_u64(), item.as_i64()), (u, i), "{bytes:x?}");
            assert_eq!((value.as_u64(), value.as_i64()), (u, i), "{bytes:x?}");
        }
    }

    #[test]
    fn int_reads_what_next_reads() {
        let all: Vec<Vec<u8>> = (0..=255u8)
            .map(|m| {
                let mut b = vec![m];
                b.extend([0x81, 2, 3, 4, 5, 6, 7, 8, 9]);
                b
            })
            .collect();
        for bytes in &all {
            for len in 0..=bytes.len() {
                let (mut a, mut b) = (Reader::new(&bytes[..len]), Reader::new(&bytes[..len]));
                match (a.int(), b.next()) {
                    (Some(i), Ok(Item::Int(j))) => {
                        assert_eq!(i, j, "{:x?}", &bytes[..len]);
                        assert_eq!(a.rest(), b.rest());
                    }
                    (None, Ok(Item::Int(_))) => panic!("{:x?} is an integer", &bytes[..len]),
                    (None, _) => assert_eq!(a.rest(), &bytes[..len], "nothing read"),
                    (Some(i), other) => panic!("{:x?}: {i:?} but {other:?}", &bytes[..len]),
                }
            }
        }
    }

    #[test]
    fn skip_passes_over_a_whole_value() {
        // [1, {"a": [2, "b"]}, bin(1)] then 7.
        let bytes = [
            0x93, 0x01, 0x81, 0xa1, b'a', 0x92, 0x02, 0xa1, b'b', 0xc4, 1, 9, 0x07,
        ];
        let mut r = Reader::new(&bytes);
        r.skip().unwrap();
        assert_eq!(r.rest(), &[0x07]);
    }
}
