//! One chunk in, one zstd frame out, and back. With a base chunk the frame holds the XOR of the
//! two: sparse (only the changed elements, [`crate::sparse`]) when few elements changed, as after
//! an RL step, else the whole XOR split into byte planes (the high bytes of BF16 weights barely
//! change, the low bytes do). Where the dense XOR compresses badly (more than half its size, as
//! when every byte changed), the new bytes are compressed too and the smaller frame kept, so a
//! delta is never much worse than plain zstd.

use crate::delta::Frame;
use crate::sparse;

/// Compressed/raw ratio above which the plain (non-XOR) chunk is tried as well.
const TRY_PLAIN_ABOVE: f64 = 0.5;

/// How a chunk was encoded (the mode fields of its [`Frame`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mode {
    pub(crate) xor: bool,
    pub(crate) planes: u8,
    pub(crate) sparse: bool,
}

/// Per-thread buffers and zstd contexts.
pub(crate) struct Codec {
    compressor: zstd::bulk::Compressor<'static>,
    decompressor: zstd::bulk::Decompressor<'static>,
    planes: Vec<u8>,
    /// The dense XOR of a chunk, or a sparse payload's changed bytes.
    scratch: Vec<u8>,
    /// A sparse payload before compression or after decompression.
    payload: Vec<u8>,
    /// The last compressed frame.
    pub(crate) out: Vec<u8>,
    spare: Vec<u8>,
}

impl Codec {
    pub(crate) fn new(level: i32, chunk_bytes: usize) -> std::io::Result<Self> {
        let mut compressor = zstd::bulk::Compressor::new(level)?;
        compressor.include_checksum(true)?;
        compressor.include_contentsize(true)?;
        let bound = zstd::zstd_safe::compress_bound(chunk_bytes);
        Ok(Codec {
            compressor,
            decompressor: zstd::bulk::Decompressor::new()?,
            planes: vec![0; chunk_bytes],
            scratch: Vec::with_capacity(chunk_bytes),
            payload: Vec::with_capacity(sparse::max_payload(chunk_bytes)),
            out: Vec::with_capacity(bound),
            spare: Vec::with_capacity(bound),
        })
    }

    /// Encodes `new` (against `base` when there is one) into `self.out`.
    pub(crate) fn encode(
        &mut self,
        new: &[u8],
        base: Option<&[u8]>,
        element_bytes: usize,
    ) -> std::io::Result<Mode> {
        let planes = if element_bytes > 1 && new.len() % element_bytes == 0 {
            element_bytes
        } else {
            1
        };
        let mode = |xor, sparse| Mode {
            xor,
            planes: planes as u8,
            sparse,
        };
        let Some(base) = base else {
            self.compress(new, planes, false)?;
            return Ok(mode(false, false));
        };
        if matches!(planes, 1 | 2 | 4 | 8) {
            let limit = sparse::max_changed(new.len(), planes);
            if sparse::encode(
                new,
                base,
                planes,
                limit,
                &mut self.scratch,
                &mut self.payload,
            ) {
                self.out.clear();
                self.compressor
                    .compress_to_buffer(&self.payload[..], &mut self.out)?;
                return Ok(mode(true, true));
            }
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(new);
        xor_into(&mut self.scratch, base);
        let xored = std::mem::take(&mut self.scratch);
        let done = self.compress(&xored, planes, false);
        self.scratch = xored;
        done?;
        if self.out.len() as f64 > TRY_PLAIN_ABOVE * new.len() as f64 {
            self.compress(new, planes, true)?;
            if self.spare.len() < self.out.len() {
                std::mem::swap(&mut self.out, &mut self.spare);
                return Ok(mode(false, false));
            }
        }
        Ok(mode(true, false))
    }

    fn compress(&mut self, src: &[u8], planes: usize, into_spare: bool) -> std::io::Result<()> {
        let input: &[u8] = if planes > 1 {
            let dst = &mut self.planes[..src.len()];
            split_planes(src, dst, planes);
            dst
        } else {
            src
        };
        let out = if into_spare {
            &mut self.spare
        } else {
            &mut self.out
        };
        out.clear();
        self.compressor.compress_to_buffer(input, out)?;
        Ok(())
    }

    /// Applies a sparse XOR `frame` (its bytes `data`) to `out`, which holds the base chunk.
    pub(crate) fn patch(
        &mut self,
        frame: &Frame,
        data: &[u8],
        out: &mut [u8],
    ) -> Result<(), String> {
        let (raw, planes) = (frame.raw as usize, frame.planes as usize);
        if !frame.sparse || !frame.xor || raw != out.len() {
            return Err("not a sparse XOR frame of this chunk".into());
        }
        self.payload.clear();
        self.payload.reserve(sparse::max_payload(raw));
        self.decompressor
            .decompress_to_buffer(data, &mut self.payload)
            .map_err(|e| format!("zstd: {e}"))?;
        sparse::apply(&self.payload, planes, out)
    }

    /// Decodes a dense `frame` (its bytes `data`) into `out`; with `base` (the base chunk) for XOR frames.
    pub(crate) fn decode(
        &mut self,
        frame: &Frame,
        data: &[u8],
        base: Option<&[u8]>,
        out: &mut [u8],
    ) -> Result<(), String> {
        let raw = frame.raw as usize;
        let planes = frame.planes as usize;
        if frame.sparse {
            return Err("a sparse frame is applied in place, not decoded".into());
        }
        let target: &mut [u8] = if planes > 1 {
            &mut self.planes[..raw]
        } else {
            &mut out[..raw]
        };
        let n = self
            .decompressor
            .decompress_to_buffer(data, target)
            .map_err(|e| format!("zstd: {e}"))?;
        if n != raw {
            return Err(format!("frame decoded to {n} bytes, {raw} expected"));
        }
        if planes > 1 {
            if raw % planes != 0 {
                return Err("frame length is not a multiple of its planes".into());
            }
            join_planes(&self.planes[..raw], &mut out[..raw], planes);
        }
        if frame.xor {
            let base = base.ok_or("an XOR frame without a base segment")?;
            xor_into(&mut out[..raw], base);
        }
        Ok(())
    }
}

/// `dst ^= src`, eight bytes at a time.
pub(crate) fn xor_into(dst: &mut [u8], src: &[u8]) {
    let mut d = dst.chunks_exact_mut(8);
    let mut s = src.chunks_exact(8);
    for (a, b) in (&mut d).zip(&mut s) {
        let x = u64::from_ne_bytes(a.try_into().expect("8"))
            ^ u64::from_ne_bytes(b.try_into().expect("8"));
        a.copy_from_slice(&x.to_ne_bytes());
    }
    for (a, b) in d.into_remainder().iter_mut().zip(s.remainder()) {
        *a ^= *b;
    }
}

/// Byte `p` of every element goes to plane `p`.
fn split_planes(src: &[u8], dst: &mut [u8], planes: usize) {
    let n = src.len() / planes;
    if planes == 2 {
        let (lo, hi) = dst.split_at_mut(n);
        let mut s = src.chunks_exact(8);
        let mut l = lo.chunks_exact_mut(4);
        let mut h = hi.chunks_exact_mut(4);
        for ((c, l4), h4) in (&mut s).zip(&mut l).zip(&mut h) {
            let x = u64::from_le_bytes(c.try_into().expect("8"));
            l4.copy_from_slice(&even_bytes(x).to_le_bytes());
            h4.copy_from_slice(&even_bytes(x >> 8).to_le_bytes());
        }
        for ((c, l), h) in s
            .remainder()
            .chunks_exact(2)
            .zip(l.into_remainder())
            .zip(h.into_remainder())
        {
            *l = c[0];
            *h = c[1];
        }
        return;
    }
    for (i, c) in src.chunks_exact(planes).enumerate() {
        for (p, b) in c.iter().enumerate() {
            dst[p * n + i] = *b;
        }
    }
}

/// Bytes 0, 2, 4 and 6 of `x`, packed.
fn even_bytes(x: u64) -> u32 {
    let mut v = x & 0x00FF_00FF_00FF_00FF;
    v = (v | (v >> 8)) & 0x0000_FFFF_0000_FFFF;
    v = (v | (v >> 16)) & 0x0000_0000_FFFF_FFFF;
    v as u32
}

/// The inverse of [`even_bytes`]: four bytes to bytes 0, 2, 4 and 6.
fn spread_bytes(x: u32) -> u64 {
    let mut v = u64::from(x);
    v = (v | (v << 16)) & 0x0000_FFFF_0000_FFFF;
    (v | (v << 8)) & 0x00FF_00FF_00FF_00FF
}

fn join_planes(src: &[u8], dst: &mut [u8], planes: usize) {
    let n = src.len() / planes;
    if planes == 2 {
        let (lo, hi) = src.split_at(n);
        let mut d = dst.chunks_exact_mut(8);
        let mut l = lo.chunks_exact(4);
        let mut h = hi.chunks_exact(4);
        for ((c, l4), h4) in (&mut d).zip(&mut l).zip(&mut h) {
            let x = spread_bytes(u32::from_le_bytes(l4.try_into().expect("4")))
                | spread_bytes(u32::from_le_bytes(h4.try_into().expect("4"))) << 8;
            c.copy_from_slice(&x.to_le_bytes());
        }
        for ((c, l), h) in d
            .into_remainder()
            .chunks_exact_mut(2)
            .zip(l.remainder())
            .zip(h.remainder())
        {
            c[0] = *l;
            c[1] = *h;
        }
        return;
    }
    for (i, c) in dst.chunks_exact_mut(planes).enumerate() {
        for (p, b) in c.iter_mut().enumerate() {
            *b = src[p * n + i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planes_roundtrip() {
        let src: Vec<u8> = (0..96u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut mid = vec![0; 6];
        split_planes(&src[..6], &mut mid, 2);
        assert_eq!(mid, [src[0], src[2], src[4], src[1], src[3], src[5]]);
        for len in [2, 6, 8, 10, 16, 18, 96] {
            let mut mid = vec![0; len];
            let mut back = vec![0; len];
            split_planes(&src[..len], &mut mid, 2);
            assert_eq!(
                mid[..len / 2].to_vec(),
                src[..len].iter().step_by(2).copied().collect::<Vec<_>>()
            );
            join_planes(&mid, &mut back, 2);
            assert_eq!(back, src[..len], "len {len}");
        }
        for planes in [2, 4, 8] {
            let mut mid = vec![0; src.len()];
            let mut back = vec![0; src.len()];
            split_planes(&src, &mut mid, planes);
            join_planes(&mid, &mut back, planes);
            assert_eq!(back, src, "planes {planes}");
        }
    }
}
