//! libFuzzer driver of `switchyard_fuzz::proto` (target `proto_conversions`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| switchyard_fuzz::proto::run(data));
