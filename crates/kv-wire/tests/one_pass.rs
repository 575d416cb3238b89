//! The one-pass decoder against the checked one (`decode_checked`: the whole payload checked as
//! msgpack first, then read): wherever the one pass answers, it answers the checked reading's
//! batch, and it declines every payload the checked reading refuses; it does answer for the
//! batches engines publish (else the decode would always take the slow road). On the model
//! test's payloads, changed ones, arbitrary bytes, and values nested at the depth budget in
//! every place the one pass steps over.

mod payloads;

use kvrouter_kv_wire::decode::{decode_checked, decode_one_pass};
use kvrouter_kv_wire::{decode_payload, WireBatch, WireError};
use payloads::{changed_payload, comparable, payload, write, V};
use proptest::prelude::*;

/// The one pass answers only with the checked reading's batch, and `decode_payload` is the
/// checked reading exactly (errors in the same words).
fn agrees(bytes: &[u8]) -> Result<Option<WireBatch>, TestCaseError> {
    let fast = decode_one_pass(bytes);
    let checked = decode_checked(bytes);
    let checked_view = checked.as_ref().map(comparable);
    if let Some(batch) = &fast {
        prop_assert_eq!(Ok(comparable(batch)), checked_view, "{:x?}", bytes);
    }
    let decoded = decode_payload(bytes);
    prop_assert_eq!(decoded.as_ref().map(comparable), checked_view);
    Ok(fast)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 2048,
        rng_seed: prop::test_runner::RngSeed::Fixed(0x6f6e_6570_6173_7321),
        ..ProptestConfig::default()
    })]

    #[test]
    fn payloads_read_in_one_pass_as_checked(bytes in payload()) {
        agrees(&bytes)?;
    }

    #[test]
    fn changed_payloads_read_in_one_pass_as_checked(bytes in changed_payload()) {
        agrees(&bytes)?;
    }

    #[test]
    fn arbitrary_bytes_read_in_one_pass_as_checked(
        bytes in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        agrees(&bytes)?;
    }
}

fn s(text: &str) -> V {
    V::Str(text.as_bytes().to_vec(), false)
}

fn int(i: i128) -> V {
    V::Int(i, false)
}

/// `levels` lists around `leaf` (a string spends three levels of the budget, bytes two, an
/// empty list two: between them every cut-off of the budget is seen).
fn nested(levels: usize, leaf: &V) -> V {
    let mut v = leaf.clone();
    for _ in 0..levels {
        v = V::Array(vec![v], false);
    }
    v
}

fn stored_map(extra: Vec<(V, V)>) -> V {
    let mut entries = vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), V::Array(vec![int(7), int(-3)], false)),
        (s("parent_block_hash"), V::Nil),
        (
            s("token_ids"),
            V::Array(vec![int(1), int(300), int(70_000), int(5)], false),
        ),
        (s("block_size"), int(2)),
        (s("medium"), s("GPU")),
    ];
    entries.extend(extra);
    V::Map(entries)
}

fn batch(events: Vec<V>, rest: Vec<V>) -> Vec<u8> {
    let mut items = vec![V::F64(1.5), V::Array(events, false)];
    items.extend(rest);
    let mut out = Vec::new();
    write(&V::Array(items, false), &mut out);
    out
}

/// Values nested from well within to past the depth budget in every place the one pass steps
/// over (an unknown key's value, an unknown key, a field it does not read as a list, an array
/// event's extra position, the batch's extra items): both readings agree, the one pass answers
/// while the nesting is within the budget and declines past it.
#[test]
fn nesting_at_the_depth_budget_is_read_as_checked() {
    let mut answered = 0;
    let mut refused = 0;
    let leaves = [s("x"), V::Bin(vec![1, 2]), V::Array(vec![], false)];
    for (levels, leaf) in (0..16).flat_map(|l| leaves.iter().map(move |leaf| (l, leaf))) {
        let deep = nested(levels, leaf);
        let array_event = V::Array(
            vec![
                s("BlockRemoved"),
                V::Array(vec![int(9)], false),
                s("GPU"),
                V::Nil,
                deep.clone(),
            ],
            false,
        );
        for bytes in [
            batch(vec![stored_map(vec![(s("other"), deep.clone())])], vec![]),
            batch(vec![stored_map(vec![(deep.clone(), int(1))])], vec![]),
            batch(
                vec![stored_map(vec![(s("lora_name"), deep.clone())])],
                vec![],
            ),
            batch(
                vec![stored_map(vec![(s("extra_keys"), deep.clone())])],
                vec![],
            ),
            batch(vec![array_event], vec![]),
            batch(vec![stored_map(vec![])], vec![int(0), deep.clone()]),
        ] {
            let fast = agrees(&bytes).unwrap();
            match decode_checked(&bytes) {
                Ok(_) => {
                    assert!(fast.is_some(), "{levels} levels: declined {bytes:x?}");
                    answered += 1;
                }
                Err(e) => {
                    assert!(matches!(e, WireError::Msgpack(_)), "{e:?}");
                    refused += 1;
                }
            }
        }
    }
    // Both sides of the budget were reached.
    assert!(
        answered > 20 && refused > 20,
        "{answered} answered, {refused} refused"
    );
}

/// A field the event's tag does not read may be anything the checked reading accepts; the one
/// pass declines what it cannot read as a list (a string of token ids) and the checked reading
/// answers.
#[test]
fn odd_fields_are_declined_and_read_the_checked_way() {
    let removed_with_odd_tokens = V::Map(vec![
        (s("type"), s("BlockRemoved")),
        (s("block_hashes"), V::Array(vec![int(9)], false)),
        (s("token_ids"), V::Array(vec![s("one")], false)),
    ]);
    let bytes = batch(vec![removed_with_odd_tokens], vec![]);
    assert_eq!(decode_one_pass(&bytes), None);
    assert!(decode_payload(&bytes).is_ok());
    let first_key_wins = stored_map(vec![(s("token_ids"), s("later, ignored"))]);
    let bytes = batch(vec![first_key_wins], vec![int(3)]);
    let fast = decode_one_pass(&bytes).expect("the one pass reads it");
    assert_eq!(Ok(fast), decode_checked(&bytes));
}

/// A batch of fewer than two items, and the first of repeated `type` keys (a nil one names no
/// tag): declined, or read as the checked reading reads them.
#[test]
fn short_batches_and_repeated_types_are_read_as_checked() {
    for bytes in [&[0x91, 0x00, 0x90, 0xc0][..], &[0x90], &[0x90, 0x00, 0x90]] {
        assert_eq!(decode_one_pass(bytes), None, "{bytes:x?}");
        assert!(decode_checked(bytes).is_err());
    }
    let typed = |first: V, second: V| {
        let mut entries = vec![(s("type"), first)];
        if let V::Map(rest) = stored_map(vec![(s("type"), second)]) {
            entries.extend(rest.into_iter().skip(1));
        }
        batch(vec![V::Map(entries)], vec![])
    };
    let nil_first = typed(V::Nil, s("BlockStored"));
    assert_eq!(decode_one_pass(&nil_first), None);
    assert!(decode_checked(&nil_first).is_err());
    let stored_first = typed(s("BlockStored"), s("Other"));
    let fast = decode_one_pass(&stored_first).expect("the one pass reads it");
    assert!(matches!(
        fast.events[0],
        kvrouter_kv_wire::WireEvent::BlockStored { .. }
    ));
    agrees(&stored_first).unwrap();
}

/// The batches engines publish are read in one pass: most drawn payloads that decode are.
#[test]
fn the_one_pass_answers_for_most_batches_that_decode() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut decoded, mut fast) = (0, 0);
    for _ in 0..1000 {
        let bytes = payload().new_tree(&mut runner).unwrap().current();
        if decode_payload(&bytes).is_ok() {
            decoded += 1;
            fast += usize::from(decode_one_pass(&bytes).is_some());
        }
    }
    assert!(
        decoded >= 200 && fast * 10 >= decoded * 7,
        "{fast} of {decoded}"
    );
}
