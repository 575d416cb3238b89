//! Sparse XOR payloads: only the elements where the new chunk differs from the base.
//!
//! An RL step leaves about 99 % of BF16 values unchanged, so the XOR of two versions is almost
//! all zeros. Handing zstd a megabyte of mostly zeros costs a pass of its match finder over every
//! byte; listing the changed elements first hands it 3–4 % of that, and the list compresses
//! better than the zeros did (the positions are small gaps, the changed bytes sit in planes).
//!
//! Payload (before zstd), all integers little-endian:
//! - `u64` K: the number of changed elements; `u64` G: the byte length of the gaps;
//! - G bytes: K LEB128 gaps, each the number of unchanged elements before the next changed one;
//! - `element_bytes` planes of K bytes: byte p of every changed element's XOR, in plane p.
//!
//! The scan reads both chunks eight bytes at a time and looks inside a word only when it
//! differs, so an unchanged region costs one compare per word.

/// A chunk is sparse when at most one element in this many changed (25 %); past that the dense
/// XOR planes compress smaller (the lr sweep of `kvrouter weights bench`, docs/weights.md).
const ONE_IN: usize = 4;

/// The most changed elements a sparse payload of a `len`-byte chunk may list.
pub(crate) fn max_changed(len: usize, element_bytes: usize) -> usize {
    len / element_bytes / ONE_IN
}

/// The largest payload of a `len`-byte chunk: the encoder gives up on a longer one (the dense
/// form is smaller), and a decoder allocates no more, whatever a frame claims.
pub(crate) fn max_payload(len: usize) -> usize {
    len
}

/// Appends the sparse payload of `new ^ base` (equal lengths, a multiple of `element_bytes`,
/// which is 1, 2, 4 or 8) to `out`, using `xor` as scratch. Returns `false` (and leaves `out`
/// unspecified) when more than `max_changed` elements differ or the payload would be longer
/// than [`max_payload`]: the caller then encodes densely.
pub(crate) fn encode(
    new: &[u8],
    base: &[u8],
    element_bytes: usize,
    max_changed: usize,
    xor: &mut Vec<u8>,
    out: &mut Vec<u8>,
) -> bool {
    debug_assert_eq!(new.len(), base.len());
    debug_assert!(matches!(element_bytes, 1 | 2 | 4 | 8));
    debug_assert_eq!(new.len() % element_bytes, 0);
    out.clear();
    out.extend_from_slice(&[0u8; 16]);
    xor.clear();
    let e = element_bytes;
    let per_word = 8 / e;
    let mut changed = 0usize;
    let mut last = 0usize; // the element after the last changed one
    let mut note = |idx: usize, bytes: &[u8], out: &mut Vec<u8>, xor: &mut Vec<u8>| {
        push_leb128(out, (idx - last) as u64);
        last = idx + 1;
        xor.extend_from_slice(bytes);
    };
    let cap = max_payload(new.len()).saturating_sub(e + 10);
    let bits = 8 * e as u32;
    let mask = u64::MAX >> (64 - bits);
    let words = new.len() / 8;
    let pairs = new.chunks_exact(8).zip(base.chunks_exact(8));
    for (w, (a, b)) in pairs.enumerate() {
        let x = u64::from_le_bytes(a.try_into().expect("8"))
            ^ u64::from_le_bytes(b.try_into().expect("8"));
        if x == 0 {
            continue;
        }
        let xb = x.to_le_bytes();
        for j in 0..per_word {
            if (x >> (j as u32 * bits)) & mask != 0 {
                changed += 1;
                if changed > max_changed || out.len() + xor.len() > cap {
                    return false;
                }
                note(w * per_word + j, &xb[j * e..j * e + e], out, xor);
            }
        }
    }
    for i in (words * 8 / e)..(new.len() / e) {
        let el: Vec<u8> = (0..e).map(|k| new[i * e + k] ^ base[i * e + k]).collect();
        if el.iter().any(|&v| v != 0) {
            changed += 1;
            if changed > max_changed || out.len() + xor.len() > cap {
                return false;
            }
            note(i, &el, out, xor);
        }
    }
    let gaps = out.len() - 16;
    out[0..8].copy_from_slice(&(changed as u64).to_le_bytes());
    out[8..16].copy_from_slice(&(gaps as u64).to_le_bytes());
    for p in 0..e {
        out.extend(xor.iter().skip(p).step_by(e));
    }
    true
}

/// XORs the changes in `payload` into `out` (which holds the base chunk), checking that the
/// payload is whole and every position lies inside `out`.
pub(crate) fn apply(payload: &[u8], element_bytes: usize, out: &mut [u8]) -> Result<(), String> {
    let e = element_bytes;
    if !matches!(e, 1 | 2 | 4 | 8) || out.len() % e != 0 {
        return Err(format!(
            "sparse frame with {e}-byte elements over {} bytes",
            out.len()
        ));
    }
    let head = |i: usize| -> Result<u64, String> {
        payload
            .get(i * 8..i * 8 + 8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8")))
            .ok_or_else(|| "sparse frame shorter than its header".to_string())
    };
    let (k, g) = (head(0)?, head(1)?);
    let elements = (out.len() / e) as u64;
    let body = &payload[16..];
    let want = k
        .checked_mul(e as u64)
        .and_then(|v| v.checked_add(g))
        .filter(|&v| k <= elements && v == body.len() as u64)
        .ok_or("sparse frame lengths disagree with its header")?;
    debug_assert_eq!(want as usize, body.len());
    let (k, g) = (k as usize, g as usize);
    let (mut gaps, planes) = body.split_at(g);
    let mut idx = 0u64;
    for i in 0..k {
        let gap = read_leb128(&mut gaps).ok_or("sparse frame gaps end early")?;
        idx = idx
            .checked_add(gap)
            .filter(|&v| v < elements)
            .ok_or("sparse frame position past its chunk")?;
        let at = idx as usize * e;
        for p in 0..e {
            out[at + p] ^= planes[p * k + i];
        }
        idx += 1;
    }
    if !gaps.is_empty() {
        return Err("sparse frame has gaps left over".into());
    }
    Ok(())
}

fn push_leb128(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn read_leb128(bytes: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = bytes.split_first()?;
        *bytes = rest;
        v |= u64::from(b & 0x7f).checked_shl(shift)?;
        if b < 0x80 {
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(new: &[u8], base: &[u8], e: usize) -> Option<Vec<u8>> {
        let (mut xor, mut out) = (Vec::new(), Vec::new());
        if !encode(new, base, e, usize::MAX, &mut xor, &mut out) {
            return None;
        }
        let mut rebuilt = base.to_vec();
        apply(&out, e, &mut rebuilt).expect("own payload applies");
        Some(rebuilt)
    }

    proptest! {
        /// Any pair of chunks rebuilds exactly, whatever changed and the element size; the
        /// encoder gives up only when the payload could outgrow the chunk.
        #[test]
        fn rebuilds_new_from_base(
            base in proptest::collection::vec(any::<u8>(), 0..2000),
            flips in proptest::collection::vec((any::<usize>(), 1u8..), 0..40),
            e in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
        ) {
            let len = base.len() / e * e;
            let base = &base[..len];
            let mut new = base.to_vec();
            for (at, x) in flips {
                if len > 0 { new[at % len] ^= x; }
            }
            let changed = (0..len / e).filter(|i| new[i * e..i * e + e] != base[i * e..i * e + e]).count();
            match roundtrip(&new, base, e) {
                Some(rebuilt) => prop_assert_eq!(rebuilt, new),
                None => prop_assert!(16 + changed * (e + 10) > len.saturating_sub(e + 10)),
            }
        }

        /// A cut or altered payload is an error or a different chunk, never a panic.
        #[test]
        fn damaged_payloads_never_panic(
            cut in 0usize..64, at in 0usize..64, x in 1u8..,
        ) {
            let base: Vec<u8> = (0..64u8).collect();
            let mut new = base.clone();
            new[5] ^= 3; new[40] ^= 0x80; new[41] ^= 1;
            let (mut xor, mut out) = (Vec::new(), Vec::new());
            prop_assert!(encode(&new, &base, 2, usize::MAX, &mut xor, &mut out));
            let mut bad = out.clone();
            bad.truncate(cut.min(bad.len()));
            let _ = apply(&bad, 2, &mut base.clone());
            let mut bad = out.clone();
            let i = at % bad.len();
            bad[i] ^= x;
            let _ = apply(&bad, 2, &mut base.clone());
        }
    }

    #[test]
    fn counts_changed_elements_not_bytes_and_respects_the_limit() {
        let base = vec![0u8; 64];
        let mut new = base.clone();
        new[2] = 1; // element 1
        new[3] = 1; // element 1 again
        new[63] = 9; // element 31
        let (mut xor, mut out) = (Vec::new(), Vec::new());
        assert!(encode(&new, &base, 2, 2, &mut xor, &mut out));
        assert_eq!(u64::from_le_bytes(out[0..8].try_into().unwrap()), 2);
        assert_eq!(&out[16..18], &[1, 29], "gaps: 1 unchanged, then 29");
        assert_eq!(&out[18..], &[1, 0, 1, 9], "low plane, then high plane");
        assert!(!encode(&new, &base, 2, 1, &mut xor, &mut out));
    }

    #[test]
    fn a_position_past_the_chunk_is_refused() {
        let mut payload = Vec::new();
        payload.extend_from_slice(&1u64.to_le_bytes());
        payload.extend_from_slice(&1u64.to_le_bytes());
        payload.extend_from_slice(&[32, 7, 7]); // element 32 of a 32-element chunk
        let err = apply(&payload, 2, &mut [0u8; 64]).unwrap_err();
        assert!(err.contains("past its chunk"), "{err}");
    }
}
