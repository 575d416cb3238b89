//! Token-id lists against `serde_json`: every shape of id and separator, and long lists read
//! as two streams with their split anywhere (at a bad id, beyond the list, in a string).

use super::super::{object, read_ids, Cursor};
use super::Step;
use crate::body::TokenIds;
use serde_json::Value;

/// The ids `serde_json` reads from `text` when it is a list of token ids.
fn serde_ids(text: &str) -> Option<Vec<u32>> {
    let vs = serde_json::from_str::<Vec<Value>>(text).ok()?;
    vs.iter()
        .map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()))
        .collect()
}

/// Deterministic numbers (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `[ids]` with separators from `seps`, each id of 1 to `max_digits` digits.
fn list_text(rng: &mut Rng, n: usize, max_digits: u32, seps: &[&str]) -> (String, Vec<String>) {
    let ids: Vec<String> = (0..n)
        .map(|_| {
            let digits = 1 + rng.next() % u64::from(max_digits);
            (rng.next() % 10u64.pow(digits as u32)).to_string()
        })
        .collect();
    (join(rng, &ids, seps), ids)
}

fn join(rng: &mut Rng, ids: &[String], seps: &[&str]) -> String {
    let mut text = String::from("[");
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            text.push_str(seps[rng.below(seps.len())]);
        }
        text.push_str(id);
    }
    text.push(']');
    text
}

#[test]
fn only_arrays_of_ids_are_read_as_ids() {
    let flat = |ids: &[u32]| Some(TokenIds::Flat(ids.to_vec()));
    assert_eq!(read_ids(b"[]"), flat(&[]));
    assert_eq!(read_ids(b" [ 0 , 7,4294967295 ] "), flat(&[0, 7, u32::MAX]));
    assert_eq!(read_ids(b"[1,2, 3 ,4\n,5]"), flat(&[1, 2, 3, 4, 5]));
    assert_eq!(
        read_ids(b"[[1, 2], [], [3]]"),
        Some(TokenIds::Batch(vec![vec![1, 2], vec![], vec![3]]))
    );
    for raw in [
        "[4294967296]",
        "[12345678901]",
        "[-1]",
        "[1.0]",
        "[1e2]",
        "[1E2]",
        "[01]",
        "[00]",
        "[\"1\"]",
        "[[1], 2]",
        "[1, [2]]",
        "[[[1]]]",
        "[null]",
        "[1,]",
        "[,1]",
        "[1 2]",
        "[1",
        "\"[1]\"",
        "7",
        "{}",
    ] {
        assert_eq!(read_ids(raw.as_bytes()), None, "{raw}");
    }
}

/// Ids of every length, read eight bytes at a time or digit by digit (near the end of the
/// text), with every follower, read as `serde_json` reads them.
#[test]
fn ids_of_every_length_read_as_serde_reads_them() {
    let mut n: u64 = 0;
    for digits in 1..=11u32 {
        for v in [
            10u64.pow(digits - 1),
            10u64.pow(digits) - 1,
            10u64.pow(digits) / 3,
        ] {
            let v = if digits == 1 { v - 1 + n % 2 } else { v };
            n += 1;
            for text in [
                format!("[{v}]"),
                format!("[{v}, {v},{v} ,\n{v}]               "),
                format!("[{v}]{}", " ".repeat(8)),
                format!("[{v}.5]      "),
                format!("[{v}e1]      "),
                format!("[{v}x]       "),
                format!("[0{v}]       "),
            ] {
                let naive: Option<Vec<u32>> = serde_json::from_str::<Vec<Value>>(&text)
                    .ok()
                    .and_then(|vs| {
                        vs.iter()
                            .map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()))
                            .collect()
                    });
                assert_eq!(
                    read_ids(text.as_bytes()),
                    naive.map(TokenIds::Flat),
                    "{text}"
                );
            }
        }
    }
}

/// Long lists of ids of every length, with every separator and a bad id at any place,
/// read as `serde_json` reads them.
#[test]
fn long_lists_read_as_serde_reads_them() {
    let serde_ids = |text: &str| -> Option<Vec<u32>> {
        let vs = serde_json::from_str::<Vec<Value>>(text).ok()?;
        vs.iter()
            .map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()))
            .collect()
    };
    // Deterministic ids of 1 to 10 digits (xorshift).
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let seps = [",", ", ", " ,", ",\n", ",  "];
    for round in 0..300 {
        let n = 1 + next() % 60;
        let mut ids: Vec<String> = (0..n)
            .map(|_| {
                let digits = 1 + next() % 10;
                (next() % 10u64.pow(digits as u32)).to_string()
            })
            .collect();
        if round % 3 == 0 {
            // One bad id somewhere: a leading zero, a fraction, an exponent, too large, or
            // a byte above 0x7F.
            let at = (next() % n) as usize;
            let bad = ["07", "1.5", "2e3", "4294967296", "\u{e9}", "-3", "99x"];
            ids[at] = bad[(next() % bad.len() as u64) as usize].to_owned();
        }
        let mut text = String::from("[");
        for (i, id) in ids.iter().enumerate() {
            if i > 0 {
                text.push_str(seps[(next() % seps.len() as u64) as usize]);
            }
            text.push_str(id);
        }
        text.push(']');
        text.push_str(&" ".repeat((next() % 10) as usize));
        assert_eq!(
            read_ids(text.as_bytes()),
            serde_ids(&text).map(TokenIds::Flat),
            "{text}"
        );
    }
}

/// Where a list's second stream starts (`None`: the list is read as one stream).
fn split_of(text: &str) -> Option<usize> {
    let mut c = Cursor::new(text.as_bytes());
    assert_eq!(c.next(), Some(b'['));
    c.skip_whitespace();
    c.split_point()
}

/// Long lists, read as two streams, with every separator and, in most rounds, a bad item
/// somewhere: often right at the split (the comma the second stream starts from, the ids on
/// either side of it), as `serde_json` reads them.
#[test]
fn long_lists_in_two_streams_read_as_serde_reads_them() {
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let seps = [",", ", ", " ,", ",\n", ",  ", " , "];
    let bad = [
        "07",
        "1.5",
        "2e3",
        "4294967296",
        "\u{e9}",
        "-3",
        "99x",
        "",
        " ",
        "\"a,b\"",
        "[1]",
    ];
    let mut split_rounds = 0;
    for round in 0..400 {
        let n = 100 + rng.below(1500);
        let max_digits = 1 + rng.below(10) as u32;
        let (text, mut ids) = list_text(&mut rng, n, max_digits, &seps[..1 + round % 6]);
        let split = split_of(&text);
        if split.is_some() {
            split_rounds += 1;
        }
        let text = if round % 4 == 0 {
            text
        } else {
            // A bad item: at the split's ids, or anywhere.
            let at = match split {
                Some(s) if round % 2 == 0 => {
                    let before = text[..s].matches(',').count();
                    (before + rng.below(2)).min(n - 1)
                }
                _ => rng.below(n),
            };
            ids[at] = bad[rng.below(bad.len())].to_owned();
            join(&mut rng, &ids, &seps[..1 + round % 6])
        };
        assert_eq!(
            read_ids(text.as_bytes()),
            serde_ids(&text).map(TokenIds::Flat),
            "{text}"
        );
    }
    // The rounds above really read lists in two streams.
    assert!(split_rounds > 350, "{split_rounds}");
}

/// Two commas in a row, a comma or space where an id should be, and a missing comma, at the
/// split of a long list.
#[test]
fn a_long_list_broken_at_its_split_is_refused() {
    let ids: Vec<String> = (0..400).map(|i| (1000 + i).to_string()).collect();
    let text = format!("[{}]", ids.join(","));
    let s = split_of(&text).expect("a long list is split");
    for (cut, insert) in [
        (s, ","),
        (s + 1, ","),
        (s + 1, " ,"),
        (s, "]"),
        (s + 1, "x"),
    ] {
        let broken = format!("{}{}{}", &text[..cut], insert, &text[cut..]);
        assert_eq!(read_ids(broken.as_bytes()), None, "{broken}");
        assert_eq!(serde_ids(&broken), None, "{broken}");
    }
    // Cut short anywhere from the split on (no closing bracket): each stream meets the end.
    for cut in (s - 3..text.len()).step_by(7) {
        assert_eq!(read_ids(&text.as_bytes()[..cut]), None, "{}", &text[..cut]);
    }
    let joined = format!("{}{}", &text[..s], &text[s + 1..]);
    assert_eq!(
        read_ids(joined.as_bytes()),
        serde_ids(&joined).map(TokenIds::Flat)
    );
    assert_eq!(
        read_ids(text.as_bytes()),
        serde_ids(&text).map(TokenIds::Flat)
    );
}

/// A short id list followed by other values, long enough that the second stream starts in
/// them: in another list of ids (which it reads to its end), in a string with commas, in an
/// object. The list is the short one, and the other values are read as `serde_json` reads them.
#[test]
fn a_second_stream_beyond_the_list_is_dropped() {
    let long: Vec<String> = (0..600).map(|i| (10_000 + i).to_string()).collect();
    let long = long.join(", ");
    let text_commas = "a, b, ".repeat(200);
    for (i, rest) in [
        format!("\"stop_token_ids\": [{long}]"),
        format!("\"stop_token_ids\": [{long}, -1]"),
        format!("\"suffix\": \"{text_commas}\""),
        format!("\"meta\": {{\"a\": [{long}], \"b\": [1, {{}}]}}"),
    ]
    .iter()
    .enumerate()
    {
        let raw = format!("{{\"prompt\": [1, 2, 3], {rest}}}");
        // The split lands beyond the prompt.
        let at = raw.find('[').expect("the prompt");
        let mut c = Cursor::new(&raw.as_bytes()[at..]);
        assert_eq!(c.next(), Some(b'['));
        assert!(c.split_point().is_some_and(|s| s > 10), "{i}");
        let fields = object(raw.as_bytes()).expect("an object");
        assert_eq!(fields.prompt, Some(TokenIds::Flat(vec![1, 2, 3])), "{i}");
        let whole: Value = serde_json::from_str(&raw).expect("valid JSON");
        let mut expected = whole.as_object().expect("an object").clone();
        expected.remove("prompt");
        assert_eq!(fields.map, expected, "{i}");
    }
}

/// A list that ends where its split would have been read as a whole, and one split where the
/// second half is empty text to the closing bracket.
#[test]
fn lists_of_every_length_around_the_split_threshold() {
    for n in 60..140 {
        let ids: Vec<String> = (0..n).map(|i| (100_000 + i).to_string()).collect();
        for sep in [",", ", "] {
            let text = format!("[{}]", ids.join(sep));
            let expected: Vec<u32> = (0..n).map(|i| 100_000 + i).collect();
            assert_eq!(
                read_ids(text.as_bytes()),
                Some(TokenIds::Flat(expected)),
                "{n}"
            );
        }
    }
}

/// A stream meets the comma where the next one starts and stops there (`Joined`), whether it
/// reads the id before it from one load (`,` right after it) or digit by digit (` ,`, or an id
/// of 8 digits); and the two streams of a long list do join, rather than the first reading the
/// whole list alone (which would give the same ids for twice the work).
#[test]
fn a_stream_stops_at_the_comma_where_the_next_starts() {
    for text in [
        "[1000,1001,1002]",
        "[1000 ,1001]",
        "[1000, 1001]",
        "[12345678,9]",
    ] {
        let split = text.find(',').expect("a comma");
        let mut c = Cursor::new(text.as_bytes());
        c.at = 1;
        let mut ids = Vec::new();
        assert_eq!(c.step(&mut ids, split), Step::Joined, "{text}");
        assert_eq!(c.at, split + 1, "{text}");
        assert_eq!(ids.len(), 1);
        // With no split there, the same step goes on to the next id.
        let mut c = Cursor::new(text.as_bytes());
        c.at = 1;
        assert_eq!(c.step(&mut Vec::new(), usize::MAX), Step::More, "{text}");
    }
    let ids: Vec<String> = (0..400).map(|i| (1000 + i).to_string()).collect();
    let text = format!("[{}]", ids.join(","));
    let split = split_of(&text).expect("a long list is split");
    let mut c = Cursor::new(text.as_bytes());
    c.at = 1;
    let mut first = Vec::new();
    while c.step(&mut first, split) == Step::More {}
    assert_eq!(c.at, split + 1);
    // Every id before the split, the one before it included.
    assert_eq!(first.len(), text[..split].matches(',').count() + 1);
}

/// A short id list before a long text keeps no room sized by the text.
#[test]
fn a_short_list_before_a_long_field_keeps_little_room() {
    let raw = format!(
        r#"{{"prompt": [1, 2, 3], "suffix": "{}"}}"#,
        "x".repeat(100_000)
    );
    let fields = object(raw.as_bytes()).expect("an object");
    let Some(TokenIds::Flat(ids)) = fields.prompt else {
        panic!("ids");
    };
    assert_eq!(ids, [1, 2, 3]);
    assert!(ids.capacity() < 1_100, "{}", ids.capacity());
}

/// The eight-byte fold against the number itself: every digit count, with leading zeros (the
/// fold does not check them; the callers do), boundaries and a sample between.
#[test]
fn the_fold_reads_every_digit_count() {
    let mut rng = Rng(0x5eed_f01d);
    for digits in 1..=7usize {
        let top = 10u64.pow(digits as u32);
        let samples = [0, 1, 9, top / 10, top / 2, top - 1]
            .into_iter()
            .chain((0..2_000).map(|_| rng.next() % top));
        for n in samples {
            let text = format!("{n:0digits$},9876543");
            let chunk = u64::from_le_bytes(text.as_bytes()[..8].try_into().unwrap());
            let (values, counted) = super::digits_of(chunk);
            assert_eq!(counted, digits, "{text}");
            assert_eq!(u64::from(super::fold_digits(values, digits)), n, "{text}");
        }
    }
}
