//! libFuzzer driver of `switchyard_fuzz::trtllm_events` (target `trtllm_events`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| switchyard_fuzz::trtllm_events::run(data));
