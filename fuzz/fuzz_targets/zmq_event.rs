//! libFuzzer driver of `switchyard_fuzz::zmq_event` (target `zmq_event`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| switchyard_fuzz::zmq_event::run(data));
