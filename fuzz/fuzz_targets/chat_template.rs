//! libFuzzer driver of `switchyard_fuzz::chat_template` (target `chat_template`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| switchyard_fuzz::chat_template::run(data));
