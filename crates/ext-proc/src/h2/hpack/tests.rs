//! The decoder against RFC 7541's examples, and against `loona-hpack`'s decoder on random
//! blocks (every representation, Huffman or not, table size updates included).

use super::*;
use proptest::prelude::*;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn decoded(d: &mut Decoder, block: &[u8]) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::new();
    d.decode(block, |n, v| out.push((n.to_vec(), v.to_vec())))?;
    Ok(out)
}

fn pairs(v: &[(&str, &str)]) -> Vec<(Vec<u8>, Vec<u8>)> {
    v.iter()
        .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
}

#[test]
fn rfc_7541_c4_requests_with_huffman_decode() {
    let mut d = Decoder::new(4096);
    let first = hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff");
    assert_eq!(
        decoded(&mut d, &first).unwrap(),
        pairs(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com")
        ])
    );
    let second = hex("8286 84be 5886 a8eb 1064 9cbf");
    assert_eq!(
        decoded(&mut d, &second).unwrap(),
        pairs(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
            ("cache-control", "no-cache")
        ])
    );
    let third = hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf");
    assert_eq!(
        decoded(&mut d, &third).unwrap(),
        pairs(&[
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/index.html"),
            (":authority", "www.example.com"),
            ("custom-key", "custom-value")
        ])
    );
    assert_eq!(d.size, 164, "RFC 7541 C.4.3's table size");
}

#[test]
fn broken_blocks_are_errors_not_panics() {
    for block in [
        &[0x80][..],                                 // index 0
        &[0xff, 0xff, 0xff, 0xff],                   // integer cut short
        &[0xbf],                                     // index past the tables
        &[0x40, 0x05, b'a'],                         // string past the block
        &[0x3f, 0xe2, 0x1f], // table size update to 4,097 (over the allowed size)
        &[0x00, 0x81, 0x00, 0x00], // Huffman: padding of zeros
        &[0x00, 0x84, 0xff, 0xff, 0xff, 0xff, 0x00], // Huffman: EOS
    ] {
        assert!(
            Decoder::new(4096).decode(block, |_, _| {}).is_err(),
            "{block:?}"
        );
    }
}

/// Huffman-codes `s` (the test's encoder, from the same table).
fn huffman(s: &[u8]) -> Vec<u8> {
    let (mut out, mut acc, mut bits) = (Vec::new(), 0u64, 0u32);
    for &b in s {
        let (code, len) = HUFFMAN[usize::from(b)];
        acc = (acc << len) | u64::from(code);
        bits += u32::from(len);
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        out.push(((acc << (8 - bits)) as u8) | (0xff >> bits));
    }
    out
}

fn int(out: &mut Vec<u8>, first: u8, n: u32, v: usize) {
    crate::h2::frame::hpack_int(out, first, n, v);
}

fn string(out: &mut Vec<u8>, s: &[u8], huff: bool) {
    if huff {
        let h = huffman(s);
        int(out, 0x80, 7, h.len());
        out.extend_from_slice(&h);
    } else {
        int(out, 0, 7, s.len());
        out.extend_from_slice(s);
    }
}

/// One field representation, as a test writes it.
#[derive(Clone, Debug)]
enum Rep {
    Indexed(usize),
    Literal {
        kind: u8,
        name_index: usize,
        name: Vec<u8>,
        value: Vec<u8>,
        huff: (bool, bool),
    },
    SizeUpdate(usize),
}

fn rep() -> impl Strategy<Value = Rep> {
    let bytes = proptest::collection::vec(any::<u8>(), 0..40);
    prop_oneof![
        (1usize..75).prop_map(Rep::Indexed),
        (
            0u8..3,
            0usize..70,
            bytes.clone(),
            bytes,
            any::<(bool, bool)>()
        )
            .prop_map(|(kind, name_index, name, value, huff)| Rep::Literal {
                kind,
                name_index,
                name,
                value,
                huff
            }),
        (0usize..300).prop_map(Rep::SizeUpdate),
    ]
}

fn write(reps: &[Rep]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in reps {
        match r {
            Rep::Indexed(i) => int(&mut out, 0x80, 7, *i),
            Rep::SizeUpdate(s) => int(&mut out, 0x20, 5, *s),
            Rep::Literal {
                kind,
                name_index,
                name,
                value,
                huff,
            } => {
                let (first, n) = [(0x40, 6), (0x00, 4), (0x10, 4)][usize::from(*kind)];
                int(&mut out, first, n, *name_index);
                if *name_index == 0 {
                    string(&mut out, name, huff.0);
                }
                string(&mut out, value, huff.1);
            }
        }
    }
    out
}

proptest! {
    #[test]
    fn huffman_strings_round_trip(s in proptest::collection::vec(any::<u8>(), 0..200)) {
        let mut out = Vec::new();
        huffman_decode(&huffman(&s), &mut out).unwrap();
        prop_assert_eq!(out, s);
    }

    /// Blocks in sequence on one connection decode as `loona-hpack` decodes them, or both
    /// refuse them (after which the connection ends).
    #[test]
    fn blocks_decode_as_a_reference_decoder_decodes_them(
        blocks in proptest::collection::vec(proptest::collection::vec(rep(), 0..12), 1..6)
    ) {
        let (mut ours, mut theirs) = (Decoder::new(256), loona_hpack::Decoder::new());
        theirs.set_max_allowed_table_size(256);
        theirs.set_max_table_size(256);
        for reps in &blocks {
            let block = write(reps);
            let a = decoded(&mut ours, &block);
            let b = theirs.decode(&block);
            // The reference also refuses a block that ends with a size update, which this
            // decoder accepts (RFC 7541 does not forbid it).
            let ends_with_update = matches!(reps.last(), Some(Rep::SizeUpdate(_)));
            match (a, b) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(_), Err(_)) => return Ok(()),
                (Ok(_), Err(_)) if ends_with_update => return Ok(()),
                (a, b) => prop_assert!(false, "ours {:?}, reference {:?}", a, b.map(|_| ())),
            }
        }
    }
}

/// A block that refers to a large table entry over and over decodes to far more than its own
/// bytes: past the list bound it is refused, whether the entry is referred to whole or by
/// name (a literal with a new value, which would copy the name each time).
#[test]
fn a_block_decoding_past_the_list_bound_is_refused() {
    let name = vec![b'n'; 4000];
    // A literal with incremental indexing and a new name: table entry 62.
    // Its name's length, 4,000: 127 in the 7-bit prefix, the rest in 7-bit groups.
    let mut first = vec![0x40, 0x7f];
    let mut n = 4000 - 127;
    while n >= 128 {
        first.push((n % 128) as u8 | 0x80);
        n /= 128;
    }
    first.push(n as u8);
    first.extend_from_slice(&name);
    first.push(0);
    for reference in [&[0x80 | 62][..], &[0x40 | 62, 0][..]] {
        let mut d = Decoder::new(4096).with_list_bound(64 * 1024);
        assert_eq!(decoded(&mut d, &first).unwrap().len(), 1);
        // 15 references: 15 × 4,032 bytes, under 64 KiB.
        let block: Vec<u8> = reference.repeat(15);
        assert_eq!(decoded(&mut d, &block).unwrap().len(), 15);
        // 17: over.
        let block: Vec<u8> = reference.repeat(17);
        assert_eq!(decoded(&mut d, &block).unwrap_err().0, LIST_TOO_LONG);
    }
}
