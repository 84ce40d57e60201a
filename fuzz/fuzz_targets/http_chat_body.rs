//! libFuzzer driver of `switchyard_fuzz::http_body` (target `http_chat_body`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| switchyard_fuzz::http_body::run(data));
