//! gRPC over the HTTP/2 connection ([`crate::h2`]): length-prefixed messages cut out of a
//! stream's DATA, and the status codes the picker answers with.

use bytes::{Buf, Bytes, BytesMut};

/// gRPC status codes used here.
pub(crate) mod status {
    pub(crate) const OK: u32 = 0;
    pub(crate) const INVALID_ARGUMENT: u32 = 3;
    pub(crate) const NOT_FOUND: u32 = 5;
    pub(crate) const RESOURCE_EXHAUSTED: u32 = 8;
    pub(crate) const OUT_OF_RANGE: u32 = 11;
    pub(crate) const UNIMPLEMENTED: u32 = 12;
    pub(crate) const UNAVAILABLE: u32 = 14;
}

/// A message prefix's length: a compression flag and a big-endian length.
const PREFIX: usize = 5;

/// Why a stream's bytes are no message.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum MessageError {
    /// The compressed flag: the picker takes no `grpc-encoding`.
    Compressed,
    /// A message longer than the bound.
    TooLarge { len: usize, max: usize },
    /// The request ended inside a message.
    Truncated,
}

impl MessageError {
    /// The status and message a stream ends with.
    pub(crate) fn status(&self) -> (u32, String) {
        match self {
            Self::Compressed => (
                status::UNIMPLEMENTED,
                "compressed messages are not supported (send grpc-encoding identity)".into(),
            ),
            Self::TooLarge { len, max } => (
                status::OUT_OF_RANGE,
                format!("a message of {len} bytes is over the limit of {max} bytes"),
            ),
            Self::Truncated => (
                status::INVALID_ARGUMENT,
                "not an ext_proc message stream: the request ended inside a message".into(),
            ),
        }
    }
}

/// Cuts one stream's messages out of its DATA, in order. A message inside one DATA frame is
/// handed on without a copy; one split over frames is collected.
#[derive(Debug)]
pub(crate) struct Messages {
    partial: BytesMut,
    max: usize,
}

impl Messages {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            partial: BytesMut::new(),
            max,
        }
    }

    /// Bytes of a message not yet whole.
    pub(crate) fn held(&self) -> usize {
        self.partial.len()
    }

    /// Appends the messages completed by `data` to `out`; `end`: the request is over (a
    /// message cut short is an error).
    pub(crate) fn push(
        &mut self,
        mut data: Bytes,
        end: bool,
        out: &mut Vec<Bytes>,
    ) -> Result<(), MessageError> {
        if self.partial.is_empty() {
            // The usual case: whole messages inside the frame, taken without a copy.
            while let Some(len) = self.whole(&data)? {
                data.advance(PREFIX);
                out.push(data.split_to(len));
            }
            self.partial.extend_from_slice(&data);
        } else {
            // A message split over frames: its bytes are collected once, each copied once.
            self.partial.extend_from_slice(&data);
            while let Some(len) = self.whole(&self.partial)? {
                self.partial.advance(PREFIX);
                out.push(self.partial.split_to(len).freeze());
            }
        }
        if end && !self.partial.is_empty() {
            return Err(MessageError::Truncated);
        }
        Ok(())
    }

    /// The length of the message at the front of `data` when all of it is there.
    fn whole(&self, data: &[u8]) -> Result<Option<usize>, MessageError> {
        if data.len() < PREFIX {
            return Ok(None);
        }
        if data[0] != 0 {
            return Err(MessageError::Compressed);
        }
        let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
        if len > self.max {
            return Err(MessageError::TooLarge { len, max: self.max });
        }
        Ok((data.len() >= PREFIX + len).then_some(len))
    }
}

/// Appends `msg` as one gRPC message (uncompressed).
pub(crate) fn encode(msg: &impl prost::Message, out: &mut Vec<u8>) {
    let len = msg.encoded_len();
    out.reserve(PREFIX + len);
    out.push(0);
    out.extend_from_slice(&(len as u32).to_be_bytes());
    msg.encode(out).expect("a Vec grows to fit");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(payloads: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in payloads {
            out.push(0);
            out.extend_from_slice(&(p.len() as u32).to_be_bytes());
            out.extend_from_slice(p);
        }
        out
    }

    #[test]
    fn messages_come_out_whole_however_the_bytes_are_cut() {
        let payloads: [&[u8]; 4] = [b"", b"a", b"hello world", &[7; 300]];
        let wire = framed(&payloads);
        for step in [1, 2, 3, 5, 7, 64, wire.len()] {
            let mut m = Messages::new(1024);
            let mut out = Vec::new();
            let chunks: Vec<&[u8]> = wire.chunks(step).collect();
            for (i, c) in chunks.iter().enumerate() {
                m.push(Bytes::copy_from_slice(c), i + 1 == chunks.len(), &mut out)
                    .unwrap();
            }
            let got: Vec<&[u8]> = out.iter().map(|b| &b[..]).collect();
            assert_eq!(got, payloads, "cut every {step} bytes");
        }
    }

    #[test]
    fn compressed_oversized_and_truncated_messages_are_errors() {
        let mut out = Vec::new();
        let mut wire = framed(&[b"abc"]);
        wire[0] = 1;
        assert_eq!(
            Messages::new(10).push(wire.into(), false, &mut out),
            Err(MessageError::Compressed)
        );
        let wire = framed(&[&[0; 11]]);
        assert_eq!(
            Messages::new(10).push(wire.into(), false, &mut out),
            Err(MessageError::TooLarge { len: 11, max: 10 })
        );
        let wire = framed(&[b"abcdef"]);
        assert_eq!(
            Messages::new(10).push(Bytes::copy_from_slice(&wire[..7]), true, &mut out),
            Err(MessageError::Truncated)
        );
        assert!(out.is_empty());
    }
}
