//! Bytes that are no ext_proc message end the stream with `INVALID_ARGUMENT`, not with a clean
//! `OK` as if the gateway had ended it; the picker goes on serving.

use super::{connect, request_headers, Envoy, Out, BUFFERED};
use bytes::{Buf, BufMut};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::{Code, Status};

/// Sends each item's bytes as one gRPC message, whatever they are.
#[derive(Clone, Copy, Default)]
struct Raw;

impl Encoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let mut v = vec![0; src.remaining()];
        src.copy_to_slice(&mut v);
        Ok(Some(v))
    }
}

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

/// A gRPC client that sends and reads messages as raw bytes ([`Raw`]), ready.
async fn raw_client(grpc: &str) -> tonic::client::Grpc<tonic::transport::Channel> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{grpc}"))
        .expect("a URI")
        .connect()
        .await
        .expect("connect");
    let mut raw = tonic::client::Grpc::new(channel);
    raw.ready().await.expect("ready");
    raw
}

#[tokio::test]
async fn bytes_that_are_no_message_end_the_stream_with_invalid_argument() {
    let (_p, _base, grpc) = super::picker("1", &[]).await;
    let mut raw = raw_client(&grpc).await;
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
    );
    // Field 1 with wire type 7, which protobuf does not have.
    let bad = futures::stream::iter([vec![0x0f, 0x0f, 0x0f]]);
    let outcome = match raw.streaming(tonic::Request::new(bad), path, Raw).await {
        Ok(response) => response.into_inner().message().await.map(|_| ()),
        Err(status) => Err(status),
    };
    let status = outcome.expect_err("the stream ends with an error");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    // The picker still serves a well-formed stream.
    let mut client = connect(&grpc).await;
    let mut envoy = Envoy::open(&mut client).await;
    envoy.send(request_headers(BUFFERED, &[], None)).await;
    let r = envoy.recv().await;
    assert!(matches!(r.response, Some(Out::RequestHeaders(_))), "{r:?}");
}

#[tokio::test]
async fn a_method_the_picker_does_not_have_is_unimplemented() {
    let (_p, _base, grpc) = super::picker("1", &[]).await;
    let mut raw = raw_client(&grpc).await;
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.ext_proc.v3.ExternalProcessor/Other",
    );
    let status = raw
        .unary(tonic::Request::new(vec![]), path, Raw)
        .await
        .expect_err("no such method");
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
}
