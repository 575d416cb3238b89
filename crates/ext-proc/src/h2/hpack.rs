//! An HPACK decoder (RFC 7541): the header blocks a gateway sends, with the static and dynamic
//! tables and Huffman-coded strings. (A crate's decoder built its Huffman table, a hash map,
//! for every string: a third of the picker's CPU per exchange.) Strings are handed to the
//! caller borrowed, from the block, the tables or one scratch buffer.

use super::tables::{HUFFMAN, STATIC};
use std::collections::VecDeque;
use std::sync::OnceLock;

/// Why a header block cannot be decoded (a connection's `COMPRESSION_ERROR`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct HpackError(pub(crate) &'static str);

type Result<T> = std::result::Result<T, HpackError>;

/// The error of a header list whose decoded size passes the decoder's bound.
pub(crate) const LIST_TOO_LONG: &str = "a decoded header list over SETTINGS_MAX_HEADER_LIST_SIZE";

/// A dynamic table entry's overhead (RFC 7541 §4.1).
const ENTRY_OVERHEAD: usize = 32;

/// The dynamic table's entries (name, value), newest first.
type Table = VecDeque<(Box<[u8]>, Box<[u8]>)>;

/// One connection's decoder.
pub(crate) struct Decoder {
    table: Table,
    size: usize,
    max_size: usize,
    /// The largest size the peer may set (this side's `SETTINGS_HEADER_TABLE_SIZE`).
    allowed: usize,
    name: Vec<u8>,
    value: Vec<u8>,
    /// The largest decoded header list of one block (each field's name and value and 32
    /// bytes, as RFC 9113 §6.5.2 counts `SETTINGS_MAX_HEADER_LIST_SIZE`): a block that refers
    /// to large table entries over and over decodes to far more than its own bytes.
    max_list: usize,
}

/// Where a decoded string is.
#[derive(Clone, Copy)]
enum Str {
    /// `block[start..end]`.
    Block(usize, usize),
    /// The name scratch buffer.
    Name,
    /// The value scratch buffer.
    Value,
}

impl Decoder {
    pub(crate) fn new(allowed: usize) -> Self {
        Self {
            table: VecDeque::new(),
            size: 0,
            max_size: allowed,
            allowed,
            name: Vec::new(),
            value: Vec::new(),
            max_list: usize::MAX,
        }
    }

    /// The decoder, refusing blocks that decode to more than `max_list` bytes ([`LIST_TOO_LONG`]).
    pub(crate) fn with_list_bound(mut self, max_list: usize) -> Self {
        self.max_list = max_list;
        self
    }

    /// Decodes `block`, calling `field` with each header's name and value in order.
    pub(crate) fn decode(
        &mut self,
        block: &[u8],
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<()> {
        let mut at = 0;
        let mut listed = 0usize;
        let max_list = self.max_list;
        let mut count = |bytes: usize| {
            listed = listed.saturating_add(bytes);
            if listed > max_list {
                return Err(HpackError(LIST_TOO_LONG));
            }
            Ok(())
        };
        while at < block.len() {
            let b = block[at];
            if b & 0x80 != 0 {
                let index = int(block, &mut at, 7)?;
                let (n, v) = entry(&self.table, index)?;
                count(n.len() + v.len() + ENTRY_OVERHEAD)?;
                field(n, v);
            } else if b & 0xe0 == 0x20 {
                let size = int(block, &mut at, 5)?;
                if size > self.allowed {
                    return Err(HpackError(
                        "a table size update over SETTINGS_HEADER_TABLE_SIZE",
                    ));
                }
                self.max_size = size;
                self.evict(0);
            } else {
                // Literal: with incremental indexing (01), without (0000) or never indexed (0001).
                let indexing = b & 0xc0 == 0x40;
                let index = int(block, &mut at, if indexing { 6 } else { 4 })?;
                if index != 0 {
                    // Counted before its name is copied.
                    count(entry(&self.table, index)?.0.len() + ENTRY_OVERHEAD)?;
                }
                let name = if index == 0 {
                    self.string(block, &mut at, true)?
                } else {
                    let (n, _) = entry(&self.table, index)?;
                    self.name.clear();
                    self.name.extend_from_slice(n);
                    Str::Name
                };
                let value = self.string(block, &mut at, false)?;
                let (n, v) = (self.get(block, name), self.get(block, value));
                count(
                    if index == 0 {
                        n.len() + ENTRY_OVERHEAD
                    } else {
                        0
                    } + v.len(),
                )?;
                field(n, v);
                if indexing {
                    let (n, v): (Box<[u8]>, Box<[u8]>) = (n.into(), v.into());
                    self.insert(n, v);
                }
            }
        }
        Ok(())
    }

    fn get<'a>(&'a self, block: &'a [u8], s: Str) -> &'a [u8] {
        match s {
            Str::Block(a, b) => &block[a..b],
            Str::Name => &self.name,
            Str::Value => &self.value,
        }
    }

    /// Reads a string literal at `at` (into the name or value scratch buffer when Huffman-coded).
    fn string(&mut self, block: &[u8], at: &mut usize, is_name: bool) -> Result<Str> {
        let huffman = *block.get(*at).ok_or(HpackError("a string cut short"))? & 0x80 != 0;
        let len = int(block, at, 7)?;
        let end = at.checked_add(len).filter(|&e| e <= block.len());
        let end = end.ok_or(HpackError("a string past the block"))?;
        let (start, raw) = (*at, &block[*at..end]);
        *at = end;
        if !huffman {
            return Ok(Str::Block(start, end));
        }
        let out = if is_name {
            &mut self.name
        } else {
            &mut self.value
        };
        out.clear();
        huffman_decode(raw, out)?;
        Ok(if is_name { Str::Name } else { Str::Value })
    }

    fn insert(&mut self, name: Box<[u8]>, value: Box<[u8]>) {
        let size = name.len() + value.len() + ENTRY_OVERHEAD;
        if size > self.max_size {
            // An entry larger than the table empties it (RFC 7541 §4.4).
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict(size);
        self.size += size;
        self.table.push_front((name, value));
    }

    /// Evicts the oldest entries until `room` more fits.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max_size {
            let Some((n, v)) = self.table.pop_back() else {
                break;
            };
            self.size -= n.len() + v.len() + ENTRY_OVERHEAD;
        }
    }
}

/// Entry `index` of the static then the dynamic table.
fn entry(table: &Table, index: usize) -> Result<(&[u8], &[u8])> {
    match index {
        0 => Err(HpackError("index 0")),
        1..=61 => Ok(STATIC[index - 1]),
        _ => table
            .get(index - 62)
            .map(|(n, v)| (&n[..], &v[..]))
            .ok_or(HpackError("an index past the dynamic table")),
    }
}

/// Reads an integer with an `n`-bit prefix at `at` (RFC 7541 §5.1).
fn int(block: &[u8], at: &mut usize, n: u32) -> Result<usize> {
    let max = (1usize << n) - 1;
    let first = usize::from(block[*at]) & max;
    *at += 1;
    if first < max {
        return Ok(first);
    }
    let (mut v, mut shift) = (max, 0);
    loop {
        let b = *block.get(*at).ok_or(HpackError("an integer cut short"))?;
        *at += 1;
        v += usize::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
        shift += 7;
        if shift > 28 {
            return Err(HpackError("an integer over 2^28"));
        }
    }
}

/// The Huffman code as a binary tree: node `i`'s children for a 0 and a 1 bit; a child with
/// [`LEAF`] set is a symbol.
fn tree() -> &'static [[u16; 2]] {
    static TREE: OnceLock<Vec<[u16; 2]>> = OnceLock::new();
    TREE.get_or_init(|| {
        let mut nodes = vec![[0u16; 2]];
        for (sym, &(code, len)) in HUFFMAN.iter().enumerate() {
            let mut node = 0;
            for i in (0..len).rev() {
                let bit = ((code >> i) & 1) as usize;
                if i == 0 {
                    nodes[node][bit] = LEAF | sym as u16;
                } else {
                    if nodes[node][bit] == 0 {
                        nodes.push([0; 2]);
                        nodes[node][bit] = (nodes.len() - 1) as u16;
                    }
                    node = usize::from(nodes[node][bit]);
                }
            }
        }
        nodes
    })
}

const LEAF: u16 = 0x8000;
const EOS: u16 = 256;

/// Decodes a Huffman-coded string (RFC 7541 §5.2) onto `out`.
fn huffman_decode(raw: &[u8], out: &mut Vec<u8>) -> Result<()> {
    let tree = tree();
    let (mut node, mut pending_bits, mut all_ones) = (0usize, 0u32, true);
    for &byte in raw {
        for i in (0..8).rev() {
            let bit = (byte >> i) & 1;
            let next = tree[node][usize::from(bit)];
            pending_bits += 1;
            all_ones &= bit == 1;
            if next & LEAF != 0 {
                let sym = next & !LEAF;
                if sym == EOS {
                    return Err(HpackError("EOS inside a Huffman string"));
                }
                out.push(sym as u8);
                (node, pending_bits, all_ones) = (0, 0, true);
            } else if next == 0 {
                return Err(HpackError("not a Huffman code"));
            } else {
                node = usize::from(next);
            }
        }
    }
    // Padding: fewer than 8 bits, all ones (the start of EOS).
    if pending_bits > 7 || !all_ones {
        return Err(HpackError("bad Huffman padding"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
