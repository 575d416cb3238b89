//! The gRPC codec of the ext_proc service: tonic's prost codec with a decode buffer that holds
//! a usual request body message at once.
//!
//! tonic starts each stream's decode buffer at 8 KiB and, once a message's 5-byte header says
//! how long it is, grows the buffer to hold it, copying what arrived so far. A gateway's request
//! body message is the client's whole body (a 2,048-token prompt as JSON ids is ~12 KiB), so
//! nearly every exchange paid that growth and its copy (about 1.5 % of the picker's CPU in
//! `perf`). The buffer starts at [`DECODE_BUFFER_BYTES`] instead. tonic reserves a message's
//! whole length beside what already arrived of it, so a message of up to about half the buffer
//! (16 KiB: a JSON body of about 2,700 token ids) needs no growth; a larger one grows it as
//! before (16 KiB to start would still grow for a 12 KB body). Every stream pays it, 24 KiB more
//! than tonic's 8 KiB, headers-only streams too: 240 MiB more at 10,000 streams in flight.

use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec, ProstCodec};

/// The decode buffer a stream starts with.
pub(crate) const DECODE_BUFFER_BYTES: usize = 32 * 1024;
/// tonic's default: an answer stream's encoder yields after this many bytes.
const YIELD_THRESHOLD_BYTES: usize = 32 * 1024;

/// [`ProstCodec`] with a [`DECODE_BUFFER_BYTES`] decode buffer (the generated client and
/// server use it: `build.rs`).
#[derive(Debug, Clone)]
pub(crate) struct ExtProcCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ExtProcCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for ExtProcCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <ProstCodec<T, U> as Codec>::Encoder;
    type Decoder = <ProstCodec<T, U> as Codec>::Decoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::new(
            DECODE_BUFFER_BYTES,
            YIELD_THRESHOLD_BYTES,
        ))
    }
}
