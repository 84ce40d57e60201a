//! The endpoint picker protocol on Envoy's ext_proc messages: what the picker reads from a
//! `ProcessingRequest` (headers, the subset hint, the served endpoint) and the
//! `ProcessingResponse`s it answers with (the destination as a header and as `envoy.lb`
//! dynamic metadata, bodies streamed back, immediate responses). Names and namespaces are the
//! protocol's (`docs/proposals/004-endpoint-picker-protocol` of the Gateway API Inference
//! Extension).

use std::collections::BTreeMap;

use prost_types::value::Kind;
use prost_types::{ListValue, Struct, Value};

use crate::proto::core::{HeaderMap, HeaderValue, HeaderValueOption, Metadata};
use crate::proto::ext_proc::processing_response::Response;
use crate::proto::ext_proc::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
};
use crate::proto::http_status::HttpStatus;

/// The header, and the `envoy.lb` metadata key, naming the chosen endpoints (`ip:port`, the
/// primary first, then fallbacks, comma-separated).
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
/// The dynamic metadata namespace of the destination and of the served endpoint.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// The filter metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The subset of endpoints the picker must choose among.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The endpoint that served the request, reported with the response.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// Body bytes per streamed message: under the 64 KiB some proxies allow per chunk (the
/// reference picker's figure).
pub const BODY_CHUNK_BYTES: usize = 62_000;

/// A request's or response's headers as Envoy sent them (names lowercase, as HTTP/2 has them).
#[derive(Debug, Default, Clone)]
pub struct Headers {
    pairs: Vec<(String, String)>,
}

impl Headers {
    pub fn from_wire(map: Option<&HeaderMap>) -> Self {
        let pairs = map
            .map(|m| {
                m.headers
                    .iter()
                    .map(|h| {
                        // Envoy fills raw_value; older versions (and some clients) value.
                        let value = if h.raw_value.is_empty() {
                            h.value.clone()
                        } else {
                            String::from_utf8_lossy(&h.raw_value).into_owned()
                        };
                        (h.key.to_ascii_lowercase(), value)
                    })
                    .collect()
            })
            .unwrap_or_default();
        Self { pairs }
    }

    /// The first value of `name` (lowercase), trimmed, when not empty.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
    }

    /// The headers as an `http::HeaderMap` (what admission reads a tenant from), leaving out
    /// pseudo-headers and values that are not valid HTTP.
    pub fn to_http(&self) -> http::HeaderMap {
        let mut map = http::HeaderMap::new();
        for (k, v) in &self.pairs {
            if k.starts_with(':') {
                continue;
            }
            if let (Ok(name), Ok(value)) = (
                http::HeaderName::from_bytes(k.as_bytes()),
                http::HeaderValue::from_str(v),
            ) {
                map.append(name, value);
            }
        }
        map
    }
}

/// The subset hint of a request: `None` when the proxy sent none (every endpoint of the pool
/// may be chosen), else the endpoints listed (possibly none). A list or a comma-separated
/// string, as different proxies write it.
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    metadata_value(metadata, SUBSET_NAMESPACE, SUBSET_KEY).map(endpoints_of)
}

/// The endpoint the proxy reports as having served the request, when it does.
pub fn served_endpoint(metadata: Option<&Metadata>) -> Option<String> {
    metadata_value(metadata, DESTINATION_NAMESPACE, SERVED_KEY)
        .map(endpoints_of)
        .and_then(|e| e.into_iter().next())
}

fn metadata_value<'a>(
    metadata: Option<&'a Metadata>,
    namespace: &str,
    key: &str,
) -> Option<&'a Value> {
    metadata?.filter_metadata.get(namespace)?.fields.get(key)
}

fn endpoints_of(value: &Value) -> Vec<String> {
    let split = |s: &str| {
        s.split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    match &value.kind {
        Some(Kind::StringValue(s)) => split(s),
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(split(s)),
                _ => None,
            })
            .flatten()
            .collect(),
        _ => Vec::new(),
    }
}

/// Whether `endpoint` (`host:port`) is in `subset`, whose entries are `host:port` or a bare
/// host (any port of it).
pub fn in_subset(subset: &[String], endpoint: &str) -> bool {
    let host = endpoint.rsplit_once(':').map_or(endpoint, |(host, _)| host);
    subset.iter().any(|s| s == endpoint || s == host)
}

/// The destination (`primary,fallback,…`) as the request header mutation, with the route cache
/// cleared so the proxy routes on it.
pub fn destination_mutation(destination: &str) -> CommonResponse {
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![HeaderValueOption {
                header: Some(HeaderValue {
                    key: DESTINATION_KEY.to_owned(),
                    value: String::new(),
                    raw_value: destination.as_bytes().to_vec(),
                }),
                append_action: crate::proto::core::header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd
                    as i32,
                ..HeaderValueOption::default()
            }],
            remove_headers: Vec::new(),
        }),
        clear_route_cache: true,
        ..CommonResponse::default()
    }
}

/// The same destination as `envoy.lb` dynamic metadata.
pub fn destination_metadata(destination: &str) -> Struct {
    let inner = Struct {
        fields: BTreeMap::from([(DESTINATION_KEY.to_owned(), string_value(destination))]),
    };
    Struct {
        fields: BTreeMap::from([(
            DESTINATION_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

/// A subset hint as a proxy writes it (a list of strings): for the tests' stand-in proxy.
pub fn subset_metadata(endpoints: &[&str]) -> Metadata {
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: endpoints.iter().map(|e| string_value(e)).collect(),
        })),
    };
    namespaced(SUBSET_NAMESPACE, SUBSET_KEY, list)
}

/// The served endpoint as a proxy reports it: for the tests' stand-in proxy.
pub fn served_metadata(endpoint: &str) -> Metadata {
    namespaced(DESTINATION_NAMESPACE, SERVED_KEY, string_value(endpoint))
}

fn namespaced(namespace: &str, key: &str, value: Value) -> Metadata {
    Metadata {
        filter_metadata: std::collections::HashMap::from([(
            namespace.to_owned(),
            Struct {
                fields: BTreeMap::from([(key.to_owned(), value)]),
            },
        )]),
        ..Metadata::default()
    }
}

/// The answer to the request headers.
pub fn request_headers(common: CommonResponse, metadata: Option<Struct>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(common),
        })),
        dynamic_metadata: metadata,
        ..ProcessingResponse::default()
    }
}

/// The answer to a (buffered) request body.
pub fn request_body(common: CommonResponse, metadata: Option<Struct>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(common),
        })),
        dynamic_metadata: metadata,
        ..ProcessingResponse::default()
    }
}

/// A request body streamed back to the proxy (full-duplex mode), in chunks the proxy accepts;
/// the last carries `end_of_stream` when asked. An empty body is one empty message.
pub fn streamed_request_body(body: &[u8], end_of_stream: bool) -> Vec<ProcessingResponse> {
    let mut chunks: Vec<&[u8]> = body.chunks(BODY_CHUNK_BYTES).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| request_body(streamed(chunk, end_of_stream && i == last), None))
        .collect()
}

/// A response body chunk streamed back (full-duplex mode).
pub fn streamed_response_body(chunk: &[u8], end_of_stream: bool) -> ProcessingResponse {
    response_body(streamed(chunk, end_of_stream))
}

fn streamed(chunk: &[u8], end_of_stream: bool) -> CommonResponse {
    CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body: chunk.to_vec(),
                    end_of_stream,
                    ..StreamedBodyResponse::default()
                },
            )),
        }),
        ..CommonResponse::default()
    }
}

/// "Continue unchanged" to the response headers.
pub fn response_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse {
            response: Some(CommonResponse::default()),
        })),
        ..ProcessingResponse::default()
    }
}

/// "Continue unchanged" to a (buffered or streamed) response body chunk.
pub fn response_body(common: CommonResponse) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse {
            response: Some(common),
        })),
        ..ProcessingResponse::default()
    }
}

/// "Continue unchanged" to trailers of the request (`request: true`) or the response.
pub fn trailers(request: bool) -> ProcessingResponse {
    let answer = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if request {
            Response::RequestTrailers(answer)
        } else {
            Response::ResponseTrailers(answer)
        }),
        ..ProcessingResponse::default()
    }
}

/// The proxy answers the client itself with `status` and a JSON `body` (an OpenAI error object);
/// `details` goes to the proxy's access log.
pub fn immediate(
    status: u16,
    body: &serde_json::Value,
    details: &str,
    headers: &[(http::HeaderName, http::HeaderValue)],
) -> ProcessingResponse {
    let header = |key: &str, value: &[u8]| HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            value: String::new(),
            raw_value: value.to_vec(),
        }),
        ..HeaderValueOption::default()
    };
    let mut set_headers = vec![header("content-type", b"application/json")];
    set_headers.extend(
        headers
            .iter()
            .map(|(name, value)| header(name.as_str(), value.as_bytes())),
    );
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers,
                remove_headers: Vec::new(),
            }),
            body: body.to_string().into_bytes(),
            grpc_status: None,
            details: details.to_owned(),
        })),
        ..ProcessingResponse::default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn subsets_read_as_lists_or_comma_separated_strings() {
        let list = subset_metadata(&["10.0.0.1:8000", "10.0.0.2:8000, 10.0.0.3:8000"]);
        assert_eq!(
            subset_hint(Some(&list)).unwrap(),
            ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
        );
        let string = namespaced(SUBSET_NAMESPACE, SUBSET_KEY, string_value("a:1,b:2"));
        assert_eq!(subset_hint(Some(&string)).unwrap(), ["a:1", "b:2"]);
        let empty = subset_metadata(&[]);
        assert_eq!(subset_hint(Some(&empty)).unwrap(), Vec::<String>::new());
        assert_eq!(subset_hint(None), None);
        assert_eq!(subset_hint(Some(&Metadata::default())), None);
        assert!(in_subset(&["10.0.0.1".into()], "10.0.0.1:8000"));
        assert!(!in_subset(&["10.0.0.1:9000".into()], "10.0.0.1:8000"));
        assert_eq!(
            served_endpoint(Some(&served_metadata("10.0.0.2:8000"))).as_deref(),
            Some("10.0.0.2:8000")
        );
    }

    #[test]
    fn header_and_metadata_carry_the_same_destination() {
        let common = destination_mutation("a:1,b:2");
        let set = &common.header_mutation.unwrap().set_headers[0];
        let header = set.header.as_ref().unwrap();
        assert_eq!(header.key, DESTINATION_KEY);
        assert_eq!(header.raw_value, b"a:1,b:2");
        assert!(common.clear_route_cache);
        let metadata = destination_metadata("a:1,b:2");
        let Some(Kind::StructValue(inner)) = &metadata.fields[DESTINATION_NAMESPACE].kind else {
            panic!("envoy.lb is a struct");
        };
        assert_eq!(
            inner.fields[DESTINATION_KEY].kind,
            Some(Kind::StringValue("a:1,b:2".into()))
        );
    }

    #[test]
    fn bodies_stream_back_in_bounded_chunks_ending_once() {
        let body = vec![7u8; BODY_CHUNK_BYTES * 2 + 5];
        let parts = streamed_request_body(&body, true);
        assert_eq!(parts.len(), 3);
        let mut joined = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            let Some(Response::RequestBody(b)) = &part.response else {
                panic!("a request body answer");
            };
            let mutation = b.response.as_ref().unwrap().body_mutation.as_ref().unwrap();
            let Some(body_mutation::Mutation::StreamedResponse(s)) = &mutation.mutation else {
                panic!("streamed");
            };
            assert_eq!(s.end_of_stream, i == 2);
            joined.extend_from_slice(&s.body);
        }
        assert_eq!(joined, body);
        assert_eq!(streamed_request_body(&[], true).len(), 1);
    }
}
