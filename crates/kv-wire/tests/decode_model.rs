//! The decoder against its naive model (`model/`: the same rules over `rmpv::Value` trees): on
//! payloads shaped like batches with every field's value drawn from any msgpack item (maps and
//! arrays, duplicate and nil fields, strings that are not UTF-8, integers in wide or signed
//! encodings, nesting past the depth budget), on those payloads with bytes flipped, cut,
//! inserted or appended, and on arbitrary bytes, both give the same batch, or the same kind of error (a
//! shape error in the same words).

mod model;
mod payloads;

use kvrouter_kv_wire::{decode_payload, WireError};
use model::decode_payload_model;
use payloads::{changed_payload, comparable, payload, write, V};
use proptest::prelude::*;

/// The same answer: equal batches, or errors of the same kind (shape errors in the same words).
fn same(bytes: &[u8]) -> Result<(), TestCaseError> {
    let ours = decode_payload(bytes);
    let model = decode_payload_model(bytes);
    match (&ours, &model) {
        (Ok(a), Ok(b)) => prop_assert_eq!(comparable(a), comparable(b)),
        (Err(WireError::Msgpack(_)), Err(WireError::Msgpack(_))) => {}
        (Err(WireError::Shape(a)), Err(WireError::Shape(b))) => prop_assert_eq!(a, b),
        _ => prop_assert!(false, "decoder {ours:?}, model {model:?} on {bytes:x?}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 2048,
        rng_seed: prop::test_runner::RngSeed::Fixed(0x6b76_7769_7265_6d70),
        ..ProptestConfig::default()
    })]

    #[test]
    fn payloads_decode_as_the_model_decodes_them(bytes in payload()) {
        same(&bytes)?;
    }

    #[test]
    fn changed_payloads_decode_as_the_model_decodes_them(bytes in changed_payload()) {
        same(&bytes)?;
    }

    #[test]
    fn arbitrary_bytes_decode_as_the_model_decodes_them(
        bytes in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        same(&bytes)?;
    }
}

#[test]
fn nesting_at_the_depth_budget_decodes_as_the_model_decodes_it() {
    // A BlockStored whose extra keys nest one list deeper each time, from accepted to refused.
    for extra in 0..8 {
        let mut keys = V::Str(b"salt".to_vec(), false);
        for _ in 0..extra {
            keys = V::Array(vec![keys], false);
        }
        let event = V::Array(
            vec![
                V::Str(b"BlockStored".to_vec(), false),
                V::Array(vec![V::Int(7, false)], false),
                V::Nil,
                V::Array(vec![V::Int(1, false)], false),
                V::Int(1, false),
                V::Nil,
                V::Nil,
                V::Nil,
                keys,
            ],
            false,
        );
        let batch = V::Array(vec![V::F64(1.0), V::Array(vec![event], false)], false);
        let mut bytes = Vec::new();
        write(&batch, &mut bytes);
        same(&bytes).unwrap();
    }
}

#[test]
fn the_payloads_drawn_are_mostly_batches_that_decode() {
    // Else the comparison above would compare errors only.
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut stored, mut removed) = (0, 0);
    for _ in 0..1000 {
        let bytes = payload().new_tree(&mut runner).unwrap().current();
        if let Ok(batch) = decode_payload(&bytes) {
            for e in &batch.events {
                match e {
                    kvrouter_kv_wire::WireEvent::BlockStored { .. } => stored += 1,
                    kvrouter_kv_wire::WireEvent::BlockRemoved { .. } => removed += 1,
                    _ => {}
                }
            }
        }
    }
    assert!(
        stored >= 150 && removed >= 75,
        "{stored} stored, {removed} removed"
    );
}
