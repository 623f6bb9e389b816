//! Fuzzes ContainerReader::open, tensor/array access, checksum checks and restore_sources on
//! containers built from the input (format in ../src/lib.rs). Must never panic.
//!
//! Run (from crates/format/fuzz; cargo-fuzz on a stable toolchain needs RUSTC_BOOTSTRAP):
//!   cargo run --release --bin make_seeds corpus/container_reader
//!   RUSTC_BOOTSTRAP=1 cargo fuzz run container_reader corpus/container_reader -- \
//!       -dict=container_reader.dict -max_len=8192 -timeout=10 -max_total_time=660
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    entrollm_format_fuzz::run(data);
});
