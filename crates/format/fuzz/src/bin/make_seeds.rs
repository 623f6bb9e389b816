//! Writes the seed corpus of `container_reader` into the directory given as the first argument
//! (default `corpus/container_reader`): a valid single-shard container in raw form, and the
//! mutate-mode input with no damage (the two-shard base container).

use entrollm_format_fuzz::{build_container, encode_raw};

fn main() {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "corpus/container_reader".to_string());
    std::fs::create_dir_all(&out).expect("create corpus dir");
    let one = build_container(u64::MAX, false);
    std::fs::write(format!("{out}/raw-valid"), encode_raw(&one[0].1, &one[1].1)).unwrap();
    std::fs::write(format!("{out}/mutate-none"), [1u8]).unwrap();
    // Damage in each file of the base container, as starting points for the mutate mode.
    for file in 0..4u8 {
        std::fs::write(
            format!("{out}/mutate-file{file}"),
            [1, file, 0, 40, 0, 0, 0, 0x20],
        )
        .unwrap();
    }
    println!("wrote 6 seeds to {out}");
}
